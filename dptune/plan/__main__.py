"""``python -m dptune.plan``: :func:`dptune.plan.cli.main`."""

from dptune.plan.cli import main

main()
