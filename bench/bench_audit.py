"""The empirical privacy audit at full size (issue 55): the embedded workload's best configurations,
audited as a data owner would, and every broken mechanism of ``dptune.dp.faults``.

1. ``search``: the default space searched as shipped (``dptune.tune``, 20 Newsgroups, MiniLM features,
   ε ∈ {1, 8}, E ∈ {5, 20}); its published best model of each cell is audited with ``--model``
   (``dptune.audit(model=…)``), ``--repeats`` times with fresh coins, at m = 1,000 and 5,000 canaries:
   every empirical ε lower bound, black-box and white-box, against the claim, and each audit's wall time;
2. ``faults``: the ε = 1, E = 5 best model's configuration with each fault injected, m = 1,000;
3. ``power``: noise off at m = 20,000 (the one-run theorem's ceiling at δ = 1e-5 is largest near there,
   8.2) against the claimed ε = 1;
4. ``together``: 8 configurations of one cell audited in one training (the fused runner's groups)
   against the same 8 one at a time, wall seconds of each.

    OMP_NUM_THREADS=2 nice .venv/bin/python bench/bench_audit.py --scratch /tmp/dptune-bench-audit \\
        --out bench/results/audit.json
    .venv/bin/python bench/bench_audit.py --table --out bench/results/audit.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from machine import machine

ROOT = Path(__file__).resolve().parent.parent
SPACE = str(ROOT / "search_spaces" / "default.yaml")


def _rows(report: Any, seconds: float, **extra: Any) -> list[dict[str, Any]]:
    """The audit's rows as plain records, with its wall seconds and ``extra``."""
    keep = [
        "threat_model",
        "epsilon",
        "epochs",
        "clip_bound",
        "batch_size",
        "base_learning_rate",
        "noise_multiplier",
        "canaries",
        "score",
        "guesses",
        "correct",
        "epsilon_lower_bound",
        "ceiling",
        "claim_p_value",
        "claim_refuted",
        "val_accuracy",
    ]
    return [
        {
            **{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items() if k in keep},
            "seconds": seconds,
            **extra,
        }
        for row in report.rows.to_dict("records")
    ]


def timed_audit(out: Path, **kwargs: Any) -> tuple[Any, float]:
    """``dptune.audit(**kwargs)`` into ``out`` and its wall seconds."""
    import dptune

    started = time.perf_counter()
    report = dptune.audit(SPACE, out=out, progress=False, **kwargs)
    return report, time.perf_counter() - started


def best_models(scratch: Path) -> dict[tuple[float, int], str]:
    """The default search's published best model of each cell (searched once into ``scratch``)."""
    import dptune

    storage = scratch / "search"
    result = dptune.tune(SPACE, storage=str(storage)) if not (storage / "done").exists() else None
    if result is not None:
        (storage / "done").write_text("")
    models = {}
    for folder in sorted((storage).rglob("model_card.json")):
        card = json.loads(folder.read_text())
        models[(float(card["privacy"]["epsilon"]), int(card["configuration"]["epochs"]))] = str(folder.parent)
    return models


def run(scratch: Path, repeats: int) -> dict[str, Any]:
    from dptune.dp import faults

    models = best_models(scratch)
    found: dict[str, Any] = {"machine": machine(), "search": [], "faults": [], "power": [], "together": {}}
    for (epsilon, epochs), model in sorted(models.items()):
        for canaries in (1000, 5000):
            for repeat in range(repeats):
                report, seconds = timed_audit(
                    scratch / f"a{epsilon}-{epochs}-{canaries}-{repeat}", model=model, canaries=canaries
                )
                found["search"] += _rows(report, seconds, repeat=repeat)
                print(
                    f"ε {epsilon} E {epochs} m {canaries} #{repeat}: lower bounds "
                    f"{report.rows.set_index('threat_model')['epsilon_lower_bound'].to_dict()} ({seconds:.1f} s)",
                    file=sys.stderr,
                )
    model = models[(1.0, 5)]
    for fault in faults.FAULTS:
        with faults.injected(fault):
            report, seconds = timed_audit(scratch / f"fault-{fault}", model=model, canaries=1000)
        found["faults"] += _rows(report, seconds, fault=fault)
        print(f"{fault}: {report.rows[['threat_model', 'epsilon_lower_bound']].values.tolist()}", file=sys.stderr)
    with faults.injected("noise_off"):
        report, seconds = timed_audit(scratch / "power", model=model, canaries=20_000)
    found["power"] = _rows(report, seconds, fault="noise_off")
    configurations = [(c, b, 3e-3) for c in (0.1, 0.3, 1.0, 3.0) for b in (256, 1024)]
    _, together = timed_audit(scratch / "together", configurations=configurations, canaries=1000)
    alone = sum(
        timed_audit(scratch / f"alone-{i}", configurations=[c], canaries=1000)[1] for i, c in enumerate(configurations)
    )
    found["together"] = {"configurations": len(configurations), "together_s": together, "one_at_a_time_s": alone}
    return found


def markdown(frame: Any) -> str:
    """A DataFrame as a Markdown table (numbers to 3 significant digits)."""
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row] for row in frame.itertuples(index=False)]
    return "\n".join(
        ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
        + ["| " + " | ".join(row) + " |" for row in cells]
    )


def table(found: dict[str, Any]) -> str:
    """Markdown tables of a result file."""
    import pandas as pd

    lines = [f"Machine: {found['machine']['cpu']} ({', '.join(found['machine']['flags'])})", ""]
    search = pd.DataFrame(found["search"])
    summary = search.groupby(["epsilon", "epochs", "canaries", "threat_model"]).agg(
        audits=("epsilon_lower_bound", "size"),
        lower_max=("epsilon_lower_bound", "max"),
        lower_mean=("epsilon_lower_bound", "mean"),
        refuted=("claim_refuted", "sum"),
        seconds=("seconds", "mean"),
    )
    lines += [markdown(summary.reset_index()), ""]
    faults = pd.DataFrame(found["faults"] + found["power"])
    lines += [
        markdown(
            faults[
                [
                    "fault",
                    "canaries",
                    "threat_model",
                    "score",
                    "correct",
                    "guesses",
                    "epsilon_lower_bound",
                    "ceiling",
                    "claim_p_value",
                    "seconds",
                ]
            ]
        ),
        "",
    ]
    together = found["together"]
    lines.append(
        f"{together['configurations']} configurations: {together['together_s']:.1f} s in one audit, "
        f"{together['one_at_a_time_s']:.1f} s one at a time"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/dptune-bench-audit"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "audit.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--table", action="store_true", help="print the tables of --out")
    args = parser.parse_args()
    if not args.table:
        found = run(args.scratch, args.repeats)
        args.out.write_text(json.dumps(found, indent=1))
    print(table(json.loads(args.out.read_text())))


if __name__ == "__main__":
    main()
