"""How a search's driver takes SIGTERM outside its Tune run (inside it, ``tune_adapters.stop_on_signals``).

``ray job stop`` and ``kill`` send SIGTERM. Python's default ends the process at once, and Ray's handler
(installed by ``ray.init``) exits with status 15 and no line. While a search runs, SIGTERM instead raises
:class:`~dptune.errors.StopSignal` where the driver is, as Ctrl+C raises ``KeyboardInterrupt``, so every
phase (loading, planning, composing, the report) ends the same way: one line saying what is done, exit
status 143, the results folder's lease released on the way out.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from dptune.errors import StopSignal


def _raise_stop(signum: int, frame: Any) -> None:
    raise StopSignal(signum)


def sigterm_raises() -> None:
    """From now on SIGTERM (``ray job stop``, ``kill``) raises :class:`~dptune.errors.StopSignal` in the driver,
    as Ctrl+C raises ``KeyboardInterrupt``: the phase it hits ends the search in its one line (the Tune run
    has its own handler: ``tune_adapters.stop_on_signals``). Called again after Ray starts, whose ``ray.init``
    installs a handler that exits with status 15 and no line. Only the main thread takes signals."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_stop)


@contextlib.contextmanager
def sigterm_stops_the_search() -> Iterator[None]:
    """:func:`sigterm_raises` while the search runs; the handler before it comes back afterwards."""
    previous = signal.getsignal(signal.SIGTERM)
    sigterm_raises()
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
