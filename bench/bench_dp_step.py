"""Time one DP training step against the plain non-private step of the same model, PEFT and batch.

For every (model, precision) case, on the same fixed batch of B examples: (a) the non-private
step — forward, mean cross-entropy, backward, Adam step — and (b) the DP step of each engine —
``engine.noisy_gradient`` (per-example gradients, clipping, noise; one physical batch) then the
same Adam step. Each kind steps its own copy of the model. After ``--warmup`` untimed steps of
each kind, ``--rounds`` rounds time ``--steps`` steps of every kind in turn (interleaved, so load
from other processes falls on all kinds alike); the median round is reported (CUDA: wall clock;
CPU: process CPU time, as the host may be shared). Prints examples/s
and the ratio DP/non-private (the figure that matters: 1.0 = DP is free) as a markdown table and
writes JSON (``--json``). A case or engine that fails is recorded with its error; the run goes on
and exits 1.

Defaults by device:

- ``--device cpu``: ViT-Ti/16 FiLM at 64 px and MiniLM FiLM at 64 tokens, B = 32, fp32;
- ``--device cuda``: ViT-B/16 and ViT-Ti/16 FiLM at 224 px, B = 128, fp32 (TF32 on) and bf16
  autocast (the configuration of ``/work/shared/anchors.md``).

ViTs are randomly initialised (the timing does not depend on the weights; no hub access);
MiniLM loads its packaged weights. Example::

    python bench/bench_dp_step.py --device cuda --json bench/dp_step_cuda.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dptune.dp.engine import DPEngine, DPStepSpec, EngineFactory, film_engine_refusal
from dptune.dp.film import FilmEngine
from dptune.dp.opacus_engine import OpacusEngine, autocast
from dptune.models import build_model, trainable_parameter_count

VIT_TINY = "vit_tiny_patch16_224.augreg_in21k"
VIT_BASE = "vit_base_patch16_224.augreg_in21k"
MINILM = "minilm"
#: Engines by name (``auto`` is a trial-time choice, not an engine).
ENGINES: dict[str, EngineFactory] = {"opacus": OpacusEngine, "film": FilmEngine}
NON_PRIVATE = "non_private"


@dataclass(frozen=True)
class Case:
    """One benchmarked model: backbone with FiLM, input size (px or tokens), classes, batch B."""

    backbone: str
    input_size: int
    num_classes: int
    batch_size: int
    precision: str  # "fp32" or "bf16"


@dataclass
class Timing:
    """Examples per second of one step kind, over ``steps`` timed steps."""

    examples_per_s: float
    seconds_per_step: float
    peak_memory_gib: float | None = None


@dataclass
class CaseResult:
    case: Case
    trainable_parameters: int = 0
    non_private: Timing | None = None
    dp: dict[str, Timing] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)  # DP examples/s ÷ non-private examples/s
    errors: dict[str, str] = field(default_factory=dict)


def make_model_and_batch(case: Case, device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The FiLM model of ``case`` on ``device`` and one fixed batch ``(*inputs, labels)``."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, case.num_classes, (case.batch_size,), generator=generator)
    if case.backbone == MINILM:
        model = build_model(MINILM, "film", case.num_classes, pretrained=True)
        ids = torch.randint(1000, 20000, (case.batch_size, case.input_size), generator=generator)
        inputs: tuple[torch.Tensor, ...] = (ids, torch.ones_like(ids))
    else:
        model = build_model(case.backbone, "film", case.num_classes, pretrained=False, image_size=case.input_size)
        size = (case.batch_size, 3, case.input_size, case.input_size)
        inputs = (torch.randint(0, 256, size, dtype=torch.uint8, generator=generator),)
    model.to(device).train()
    return model, tuple(t.to(device) for t in (*inputs, labels))


def time_kinds(
    steps: dict[str, Callable[[], None]], device: torch.device, warmup: int, rounds: int, per_round: int, batch_size: int
) -> dict[str, Timing]:
    """Time each step kind in interleaved rounds; report the median round (robust to a busy host).

    Every kind first runs ``warmup`` untimed steps; then each of ``rounds`` rounds times
    ``per_round`` steps of every kind in turn, so that load from other processes falls on all
    kinds alike. On CUDA: wall clock, synchronised around each timed block. On the CPU: this
    process's CPU time (a shared host's other processes do not count; with several torch threads
    it sums them, so examples/s are per CPU-second).
    """
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for step in steps.values():
        for _ in range(warmup):
            step()
    seconds: dict[str, list[float]] = {kind: [] for kind in steps}
    peaks: dict[str, float] = {}
    for _ in range(rounds):
        for kind, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = clock()
            for _ in range(per_round):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peaks[kind] = torch.cuda.max_memory_allocated(device) / 2**30
            seconds[kind].append((clock() - start) / per_round)
    result = {}
    for kind, values in seconds.items():
        median = statistics.median(values)
        result[kind] = Timing(examples_per_s=batch_size / median, seconds_per_step=median, peak_memory_gib=peaks.get(kind))
    return result


def run_case(case: Case, engines: list[str], device: torch.device, warmup: int, rounds: int, per_round: int) -> CaseResult:
    """Time the non-private step and each engine's DP step of ``case``."""
    result = CaseResult(case)
    dtype = torch.bfloat16 if case.precision == "bf16" else None
    try:
        model, batch = make_model_and_batch(case, device)
    except Exception as error:  # a case that cannot even be built is reported, not fatal
        result.errors["build"] = f"{type(error).__name__}: {error}"
        return result
    *inputs, labels = batch
    result.trainable_parameters = trainable_parameter_count(model)
    spec = DPStepSpec(
        noise_multiplier=1.0, clip_bound=1.0, rule="normalized", expected_batch_size=case.batch_size, autocast_dtype=dtype
    )

    def adam(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-4)

    def non_private_step(module: nn.Module) -> Callable[[], None]:
        optimizer = adam(module)

        def step() -> None:
            with autocast(device.type, dtype):
                logits = module(*inputs)
            F.cross_entropy(logits.float(), labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def dp_step(module: nn.Module, engine: DPEngine) -> Callable[[], None]:
        optimizer = adam(module)

        def step() -> None:
            engine.noisy_gradient([batch])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    # each kind steps its own copy of the model: an engine's hooks never touch another kind's step
    steps: dict[str, Callable[[], None]] = {NON_PRIVATE: non_private_step(copy.deepcopy(model))}
    for name in engines:
        if name == "film" and (refusal := film_engine_refusal(model, "film")) is not None:
            result.errors[name] = refusal
            continue
        try:
            own = copy.deepcopy(model)
            steps[name] = dp_step(own, ENGINES[name](own, spec, torch.Generator(device=device).manual_seed(1)))
        except Exception as error:
            result.errors[name] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
    try:
        timings = time_kinds(steps, device, warmup, rounds, per_round, case.batch_size)
    except Exception as error:
        result.errors["timing"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
        return result
    result.non_private = timings.pop(NON_PRIVATE)
    result.dp = timings
    result.ratio = {name: t.examples_per_s / result.non_private.examples_per_s for name, t in timings.items()}
    return result


def default_cases(device: torch.device) -> list[Case]:
    if device.type == "cuda":
        return [
            Case(backbone, 224, 100, 128, precision)
            for backbone in (VIT_BASE, VIT_TINY)
            for precision in ("fp32", "bf16")
        ]
    return [Case(VIT_TINY, 64, 100, 32, "fp32"), Case(MINILM, 64, 20, 32, "fp32")]


def cpu_name() -> str:
    """The processor's model name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment(device: torch.device, threads: int) -> dict[str, object]:
    """Where and with what the figures were measured (host load matters on a shared CPU)."""
    described = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": f"{device.type}: {described}",
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "torch_threads": threads,
        "python": platform.python_version(),
        **{package: version(package) for package in ("torch", "opacus", "timm", "transformers")},
    }


def markdown(results: list[CaseResult], engines: list[str]) -> str:
    header = "| model | input | B | precision | d | non-private ex/s | " + " | ".join(
        f"{name} ex/s (ratio)" for name in engines
    )
    lines = [header + " |", "|" + "---|" * (6 + len(engines))]
    for r in results:
        c = r.case
        base = f"{r.non_private.examples_per_s:.1f}" if r.non_private else f"error: {r.errors.get('timing', r.errors.get('build'))}"
        cells = []
        for name in engines:
            if name in r.dp:
                ratio = f" ({r.ratio[name]:.2f}x)" if name in r.ratio else ""
                cells.append(f"{r.dp[name].examples_per_s:.1f}{ratio}")
            else:
                cells.append(f"n/a: {r.errors.get(name, r.errors.get('build', ''))}")
        row = f"| {c.backbone} FiLM | {c.input_size} | {c.batch_size} | {c.precision} | {r.trainable_parameters} | {base} | "
        lines.append(row + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--engine", choices=["opacus", "film", "all"], default="all", help="DP engine(s) to time")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each kind first (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds, median reported (default 5)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default 10 on cuda, 2 on cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda but CUDA is not available")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    steps = args.steps or (10 if device.type == "cuda" else 2)
    engines = list(ENGINES) if args.engine == "all" else [args.engine]
    results = []
    for case in default_cases(device):
        results.append(run_case(case, engines, device, args.warmup, args.rounds, steps))
        print(f"done: {case}", file=sys.stderr, flush=True)
    env = environment(device, torch.get_num_threads())
    table = markdown(results, engines)
    print(json.dumps(env))
    print(f"warm-up {args.warmup} steps, then the median of {args.rounds} interleaved rounds of {steps} timed steps\n")
    print(table)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"environment": env, "warmup": args.warmup, "rounds": args.rounds, "steps_per_round": steps,
                       "results": [asdict(r) for r in results], "markdown": table}, out, indent=2)
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
