"""``python -m dptune.search``: see :mod:`dptune.search.cli`."""

from dptune.search.cli import main

main()
