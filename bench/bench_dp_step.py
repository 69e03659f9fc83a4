"""Time one DP training step against the plain (non-private) step: FiLM engine and Opacus hooks.

A step is what a trial does per Poisson batch: the gradient (plain ``loss.backward()``, or an
engine's ``noisy_gradient``: per-example gradients, clipped, summed, noised, scaled by 1/(C·B)),
one Adam step, ``zero_grad`` and reading the loss as a float (one device sync). Every method
steps its own copy of the same model (an engine's disabled hooks never touch another method's
step) on the same fixed batch in the same precision, normalized clipping, σ = 1. The figure
that matters is the ratio plain step time / DP step time (1.0 = privacy is free; the targets
were ≥ 0.90 for ViT-B bf16 on a GPU and ≥ 0.85 on the CPU cases).

Cases. ``--device cpu``: ViT-Ti/16 FiLM at 64 px (17 tokens, B = 64) and MiniLM FiLM (its real
config, 32 tokens with padding, B = 32), float32. ``--device cuda``: ViT-B/16 and ViT-Ti/16 FiLM
at 224 px, B = 128 and 256, bf16 autocast and float32 (TF32 on), ViT-B bf16 first. Models have
random weights (the speed does not depend on them; no hub access) and 100 classes (the setting
of /work/shared/anchors.md); ``d`` is the number of trainable parameters (FiLM: every
LayerNorm's scale and shift + the head).

Timing: ``--warmup`` untimed steps per method, then ``--repeats`` rounds that each time every
method for up to ``--steps`` steps (methods interleaved, so contention from other processes hits
them alike); per method the best round's mean step time (other processes only ever add time).
CUDA steps are timed by the wall clock, every timed interval starting and ending with
``torch.cuda.synchronize()``, and peak memory is recorded per method; CPU steps by this process'
CPU time (with ``--threads 1`` that is the step's compute time, robust to other processes on
shared cores). Each (case, method) gets at most ``--case-cap-s`` seconds (fewer steps when a step
is slow); cases left when ``--total-cap-s`` is spent are recorded as skipped, and a case or method
that fails (e.g. out of memory) is recorded with its error while the run goes on. Results are
rewritten after every case to ``<out>.json`` and ``<out>.md``, so a run cut short keeps what it
measured. A last column checks that the FiLM engine computes what Opacus does:
‖g_FiLM − g_Opacus‖/‖g_Opacus‖ of the noise-free clipped gradient of the case's batch.

Run (from the repository root)::

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_dp_step.py --device cpu --threads 1 --out build/bench/dp_step_cpu
    # on a GPU machine without the venv (the device image has torch, timm, transformers but no
    # Opacus): copy the venv's pure-Python opacus package to build/device/ (git-ignored), carry it
    mkdir -p build/device && cp -r .venv/lib/python3.11/site-packages/opacus build/device/
    PYTHONPATH=.:build/device python3 bench/bench_dp_step.py --device cuda --out "$OUT/dp_step_h200"

The CUDA run takes about 80 s on one H200 (``--total-cap-s`` 200 by default).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from torch import nn

from dptune.dp.engine import DPStepSpec, EngineFactory, summed_cross_entropy
from dptune.dp.film import FilmEngine
from dptune.dp.opacus_engine import OpacusEngine
from dptune.dp.precision import autocast
from dptune.models import build_model, trainable_parameter_count

PLAIN = "plain"
#: DP engines by method name; ``plain`` (the non-private step) is always timed as the reference.
ENGINES: dict[str, EngineFactory] = {"film": FilmEngine, "opacus": OpacusEngine}
VIT_B = "vit_base_patch16_224.augreg_in21k"
VIT_TI = "vit_tiny_patch16_224.augreg_in21k"
NUM_CLASSES = 100


@dataclass(frozen=True)
class Case:
    """One model × batch size × precision to time."""

    label: str
    backbone: str
    batch_size: int
    precision: str  # "fp32" or "bf16" (autocast)
    image_size: int | None = None  # px, image backbones
    tokens: int | None = None  # sequence length, text backbones


@dataclass
class Timing:
    """One method on one case: seconds per step (best round), examples per second."""

    method: str
    step_s: float = float("nan")
    examples_per_s: float = float("nan")
    ratio_to_plain: float = float("nan")  # plain step time ÷ this method's step time
    steps_timed: int = 0
    rounds_s: list[float] = field(default_factory=list)
    peak_memory_gib: float | None = None
    error: str = ""


def cases_for(device: str) -> list[Case]:
    """The benchmarked cases of ``device`` (module docstring)."""
    if device == "cpu":
        return [
            Case("ViT-Ti/16 FiLM 64px", VIT_TI, 64, "fp32", image_size=64),
            Case("MiniLM FiLM 32 tokens", "minilm", 32, "fp32", tokens=32),
        ]
    grid = [(VIT_B, "ViT-B/16"), (VIT_TI, "ViT-Ti/16")]
    ordered = [(b, n, p, bs) for p in ("bf16", "fp32") for b, n in grid for bs in (128, 256)]
    return [Case(f"{n} FiLM 224px", b, bs, p, image_size=224) for b, n, p, bs in ordered]


def make_batch(case: Case, device: torch.device, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A fixed batch as ``dptune.data`` yields it: images in [0, 255] or (ids, mask) with padding."""
    n = case.batch_size
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    if case.tokens is None:
        images = torch.rand(n, 3, case.image_size, case.image_size, generator=generator) * 255
        return images.to(device), labels.to(device)
    lengths = torch.randint(case.tokens // 4, case.tokens + 1, (n,), generator=generator)
    mask = (torch.arange(case.tokens)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1000, 20000, (n, case.tokens), generator=generator) * mask
    return ids.to(device), mask.to(device), labels.to(device)


def step_function(
    method: str, model: nn.Module, batch: tuple[torch.Tensor, ...], spec: DPStepSpec, device: torch.device
) -> Callable[[], float]:
    """One training step of ``method`` (``plain`` or an engine name); returns the summed loss."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    *inputs, labels = batch
    if method == PLAIN:

        def plain() -> float:
            with autocast(device.type, spec.autocast_dtype):
                logits = model(*inputs)
            loss = summed_cross_entropy(logits, labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        return plain
    engine = ENGINES[method](model, spec, torch.Generator(device=device).manual_seed(0))

    def private() -> float:
        loss = engine.noisy_gradient([batch])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return private


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_clock(device: torch.device) -> Callable[[], float]:
    """Wall clock on CUDA; on the CPU this process' CPU time, which other processes sharing the
    cores do not inflate (with one thread it is the step's compute time)."""
    return time.perf_counter if device.type == "cuda" else time.process_time


def time_steps(step: Callable[[], float], steps: int, device: torch.device) -> float:
    """Mean seconds per step over ``steps`` steps."""
    clock = step_clock(device)
    synchronize(device)
    start = clock()
    for _ in range(steps):
        step()
    synchronize(device)
    return (clock() - start) / steps


def run_case(
    case: Case, methods: list[str], args: argparse.Namespace, device: torch.device
) -> tuple[list[Timing], float | None, int]:
    """Time every method on ``case``; also return the FiLM engine's relative gap to Opacus (when
    both are timed) and the number of trainable parameters d."""
    torch.manual_seed(0)
    model = build_model(case.backbone, "film", NUM_CLASSES, pretrained=False, image_size=case.image_size)
    dimension = trainable_parameter_count(model)
    models = {method: copy.deepcopy(model).to(device).train() for method in methods}
    del model
    batch = make_batch(case, device, torch.Generator().manual_seed(0))
    spec = DPStepSpec(
        noise_multiplier=1.0,
        clip_bound=1.0,
        rule="normalized",
        expected_batch_size=case.batch_size,
        autocast_dtype=torch.bfloat16 if case.precision == "bf16" else None,
    )
    agreement = (
        film_vs_opacus(models["film"], models["opacus"], batch, spec, device)  # before any step
        if {"film", "opacus"} <= set(methods)
        else None
    )
    timings = {m: Timing(m) for m in methods}
    steps: dict[str, Callable[[], float]] = {}
    for method in methods:  # build and warm up every method first
        try:
            steps[method] = step_function(method, models[method], batch, spec, device)
            started = time.perf_counter()
            for _ in range(args.warmup):
                steps[method]()
            synchronize(device)
            warm_step_s = (time.perf_counter() - started) / max(args.warmup, 1)
            per_round = args.case_cap_s / args.repeats
            timings[method].steps_timed = max(1, min(args.steps, int(per_round / max(warm_step_s, 1e-6))))
        except Exception as error:  # an OOM or failure is recorded, the run goes on
            timings[method].error = f"{type(error).__name__}: {str(error)[:300]}"
            steps.pop(method, None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for _ in range(args.repeats):
        for method, step in steps.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            timings[method].rounds_s.append(time_steps(step, timings[method].steps_timed, device))
            if device.type == "cuda":
                timings[method].peak_memory_gib = torch.cuda.max_memory_allocated(device) / 2**30
    for timing in timings.values():
        if timing.rounds_s:
            timing.step_s = min(timing.rounds_s)
            timing.examples_per_s = case.batch_size / timing.step_s
    for timing in timings.values():
        timing.ratio_to_plain = timings[PLAIN].step_s / timing.step_s
    del steps, models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return list(timings.values()), agreement, dimension


def film_vs_opacus(
    film_model: nn.Module,
    opacus_model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    spec: DPStepSpec,
    device: torch.device,
) -> float:
    """‖g_film − g_opacus‖ / ‖g_opacus‖ of the noise-free clipped gradient on the case's batch, in
    the case's precision, on two copies of one model: the timed engine computes what Opacus does."""
    noise_free = replace(spec, noise_multiplier=0.0)
    flats = []
    for engine_type, model in ((FilmEngine, film_model), (OpacusEngine, opacus_model)):
        params = [p for p in model.parameters() if p.requires_grad]
        torch.manual_seed(0)  # the same dropout masks in both forwards
        engine_type(model, noise_free, torch.Generator(device=device)).noisy_gradient([batch])
        flats.append(torch.cat([p.grad.flatten() for p in params]))
        for p in params:
            p.grad = None
    return float(torch.linalg.vector_norm(flats[0] - flats[1]) / torch.linalg.vector_norm(flats[1]))


def cpu_name() -> str:
    """The processor's model name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def package_version(name: str) -> str:
    """The installed version of ``name``; without distribution metadata (the device image's Opacus
    is a copied package on ``PYTHONPATH``) the module's ``__version__``."""
    try:
        return version(name)
    except PackageNotFoundError:
        return getattr(__import__(name), "__version__", "unknown")


def environment(args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """Where and with what the figures were measured (host load matters on a shared CPU)."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        **{name: package_version(name) for name in ("torch", "timm", "transformers", "opacus")},
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "clock": "wall clock" if device.type == "cuda" else "process CPU time",
        "tf32": device.type == "cuda",
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "case_cap_s": args.case_cap_s,
        "total_cap_s": args.total_cap_s,
    }


def timing_cell(method: str, timing: dict[str, object]) -> str:
    """One method's table cell: examples/s (and its ratio to the plain step), or the error."""
    if timing["error"]:
        return f"error: {str(timing['error'])[:60]}"
    text = f"{timing['examples_per_s']:.0f}"
    return text if method == PLAIN else f"{text} ({timing['ratio_to_plain']:.2f}x)"


def markdown(env: dict[str, object], methods: list[str], results: list[dict[str, object]]) -> str:
    """The results as a markdown table headed by how they were measured."""
    names = {PLAIN: "plain", "film": "FiLM engine", "opacus": "Opacus hooks"}
    lines = [
        f"DP step vs plain step, {env['device']}, torch {env['torch']}, timm {env['timm']}, opacus {env['opacus']}, "
        f"{env['threads']} thread(s), {env['clock']}, load average {env['load_average_1min']}, {env['date']}. "
        f"Examples/s (ratio to the plain step), best of {env['repeats']} rounds; last column: "
        "‖g_FiLM − g_Opacus‖/‖g_Opacus‖ without noise.",
        "",
        f"| case | B | precision | d | {' | '.join(names[m] for m in methods)} | peak GiB "
        f"{' / '.join(names[m] for m in methods)} | FiLM vs Opacus |",
        "|" + "---|" * (len(methods) + 6),
    ]
    for result in results:
        case = result["case"]
        if "skipped" in result:
            lines.append(
                f"| {case['label']} | {case['batch_size']} | {case['precision']} | | {result['skipped']} |"
                + " |" * (len(methods) + 1)
            )
            continue
        timings = {t["method"]: t for t in result["timings"]}

        memory = " / ".join(
            "–" if timings[m]["peak_memory_gib"] is None else f"{timings[m]['peak_memory_gib']:.1f}" for m in methods
        )
        agreement = result["film_vs_opacus_relative_difference"]
        lines.append(
            f"| {case['label']} | {case['batch_size']} | {case['precision']} | "
            f"{result['trainable_parameters']} | "
            f"{' | '.join(timing_cell(m, timings[m]) for m in methods)} | {memory} | "
            f"{'–' if agreement is None else f'{agreement:.1e}'} |"
        )
    return "\n".join(lines) + "\n"


def write(out: Path, env: dict[str, object], methods: list[str], results: list[dict[str, object]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "results": results}, indent=2))
    out.with_suffix(".md").write_text(markdown(env, methods, results))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, required=True, help="output prefix: writes <out>.json and <out>.md")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=tuple(ENGINES),
        default=list(ENGINES),
        help="DP engines timed against the plain step (default: all)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per method")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method and round (at most)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per case")
    parser.add_argument(
        "--case-cap-s",
        type=float,
        default=None,
        help="seconds of timed steps per method and case (default 12 cuda, 60 cpu)",
    )
    parser.add_argument(
        "--total-cap-s",
        type=float,
        default=None,
        help="no new case starts after this many seconds (default 200 cuda, 1200 cpu)",
    )
    args = parser.parse_args(argv)
    for name in ("threads", "warmup", "steps", "repeats"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            parser.error(f"--{name} must be ≥ {0 if name == 'warmup' else 1}, got {value}")
    for name in ("case_cap_s", "total_cap_s"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device; use --device cpu")
    cuda = args.device == "cuda"
    args.case_cap_s = args.case_cap_s or (12.0 if cuda else 60.0)
    args.total_cap_s = args.total_cap_s or (200.0 if cuda else 1200.0)
    return args


def main(argv: list[str] | None = None, cases: Callable[[str], list[Case]] = cases_for) -> int:
    """Run every case ``cases(device)`` of ``--device``; exit status 1 when a case or method failed."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    methods = [PLAIN, *dict.fromkeys(args.engines)]
    env = environment(args, device)
    results: list[dict[str, object]] = []
    failed = False
    started = time.perf_counter()
    for case in cases(args.device):
        if time.perf_counter() - started > args.total_cap_s:
            results.append({"case": asdict(case), "skipped": f"skipped: --total-cap-s {args.total_cap_s:.0f} s spent"})
        else:
            case_start = time.perf_counter()
            try:
                timings, agreement, dimension = run_case(case, methods, args, device)
            except Exception as error:  # e.g. out of memory building the model: next case
                failed = True
                results.append({"case": asdict(case), "skipped": f"failed: {type(error).__name__}: {str(error)[:200]}"})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            else:
                failed = failed or any(t.error for t in timings)
                results.append(
                    {
                        "case": asdict(case),
                        "trainable_parameters": dimension,
                        "timings": [asdict(t) for t in timings],
                        "film_vs_opacus_relative_difference": agreement,
                        "wall_s": time.perf_counter() - case_start,
                    }
                )
        write(args.out, env, methods, results)
        print(markdown(env, methods, results).splitlines()[-1], flush=True)
    print(markdown(env, methods, results))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
