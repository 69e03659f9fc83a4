"""`python -m dptune`: version and the list of entry points."""

from __future__ import annotations

import argparse

from dptune import __version__

ENTRY_POINTS = {
    "dptune.plan": "batch-size plan before any compute: σ, σ√T and the min-step rule per (ε, B)",
    "dptune.search": "the joint (C, B, η) search per (ε, epochs) on Ray Tune; writes Parquet results",
    "dptune.report": "difficulty-stratified HTML report and figures from Parquet results",
    "dptune.predict": "label new rows with a model a search published (<results>/models/<cell>/)",
    "dptune.data.example": "write the worked example's CSV files of search_spaces/own_data.yaml",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dptune",
        description="dptune: DP transfer-learning hyperparameter search. Entry points:\n"
        + "\n".join(f"  python -m {name:<20} {what}" for name, what in ENTRY_POINTS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    parser.parse_args(argv)
    parser.print_help()


if __name__ == "__main__":
    main()
