"""``python -m dptune.audit``: :func:`dptune.audit.cli.main`."""

from dptune.audit.cli import main

main()
