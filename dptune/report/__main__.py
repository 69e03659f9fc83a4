"""``python -m dptune.report``: see :mod:`dptune.report.cli`."""

from dptune.report.cli import main

main()
