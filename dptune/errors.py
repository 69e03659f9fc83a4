"""The one root of dptune's errors, and how a command line reports them.

Every error class dptune defines derives from ``DptuneError``. Those a user can cause (a bad flag,
spec, path, address, config or results folder) are ``ValueError``s too, one per module
(``SpaceError``, ``SearchError``, ``RecordsError``, ``PrivacyParameterError``...), so callers that
catch ``ValueError`` keep working. :class:`TrialFailed` (a trial that failed after training began)
is a ``RuntimeError`` and never a ``ValueError``: the trial's contract is that a ``ValueError``
means nothing was spent. A command's ``main()`` catches ``DptuneError`` only and prints one line
shaped ``error: <where>: <what> (<what is allowed>)`` with exit status 2; anything else is a bug
and keeps its traceback.

The trial's errors live here too (:class:`TrialConfigError`, :class:`TrialFailed`): ``dptune.runners.trial`` and
its implementation ``dptune.runners.trainer`` both raise them. This module imports nothing else from
dptune, so every module can import it.
"""

from __future__ import annotations

import argparse
import errno
import reprlib
import sys
from typing import NoReturn

#: Longest repr of user input an error message shows (a hostile input must not flood the terminal).
MAX_SHOWN_CHARS = 80

#: Exit status of a command refused for bad input (argparse's status for bad flags).
USER_ERROR_EXIT = 2
#: Exit status of a command that started and could not finish (a full disk, runs that still failed).
INCOMPLETE_EXIT = 1

#: ``errno`` values that mean the results location cannot take more writes.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


class DptuneError(Exception):
    """The root of dptune's errors. For input a user can fix, the message names where (flag, file,
    key), what is wrong and what is allowed. ``exit_status``: what a command exits with."""

    exit_status = USER_ERROR_EXIT


class SearchError(DptuneError):
    """Bad flags or an unusable results location, reported before any compute."""


class SearchIncomplete(DptuneError, RuntimeError):
    """A search that started could not finish (results folder full or read-only, runs whose process
    kept being lost): what finished is kept; the message says what to do (usually ``--resume``)."""

    exit_status = INCOMPLETE_EXIT


class SearchInterrupted(SearchIncomplete):
    """A search stopped by a signal (Ctrl+C's SIGINT, SIGTERM as ``ray job stop`` sends): before it
    finished (nothing is marked finished, what finished is kept, ``--resume`` runs the rest), or once its
    runs were recorded (the message says what is not done; ``--resume`` does it). Its exit status is
    128 + the signal's number, as a shell reports a process that signal ended."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.exit_status = 128 + signal_number


class StopSignal(KeyboardInterrupt):
    """SIGTERM (``ray job stop``, ``kill``) received by a search's driver outside its Tune run: raised where
    the driver is, as Ctrl+C raises ``KeyboardInterrupt``, so every phase ends in the same one line
    (:func:`stop_named`), with exit status 128 + 15, its lease released on the way out."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal_number)
        self.signal_number = signal_number


def stop_named(interrupt: KeyboardInterrupt) -> tuple[str, int]:
    """How the command's line names what stopped it, and the signal's number: ``Ctrl+C (SIGINT)`` for a
    ``KeyboardInterrupt``, the signal's name for a :class:`StopSignal`."""
    import signal

    if isinstance(interrupt, StopSignal):
        return signal.Signals(interrupt.signal_number).name, interrupt.signal_number
    return "Ctrl+C (SIGINT)", int(signal.SIGINT)


def storage_error(error: BaseException) -> str | None:
    """``"<strerror> (errno NAME)"`` when ``error`` or an exception it was raised from or while handling
    is an ``OSError`` of ``STORAGE_ERRNOS`` (no space, quota, read-only, file too large), else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in STORAGE_ERRNOS:
            return f"{current.strerror or current} ({errno.errorcode.get(current.errno, current.errno)})"
        current = current.__cause__ or current.__context__
    return None


class TrialConfigError(DptuneError, ValueError):
    """A trial's ``dptune.contract.TrialConfig`` cannot run; raised before training, naming the allowed values."""


class TrialFailed(DptuneError, RuntimeError):
    """A trial failed after training began; carries what it spent, so the search can account it.

    ``steps_taken`` Poisson steps at (``noise_multiplier``, ``sample_rate``) ran before the error
    (the ``__cause__``); ``epsilon_spent`` is their ε at the trial's δ.
    """

    def __init__(
        self,
        message: str,
        *,
        noise_multiplier: float,
        sample_rate: float,
        steps: int,
        steps_taken: int,
        epsilon_spent: float,
    ) -> None:
        super().__init__(message)
        self.noise_multiplier = noise_multiplier
        self.sample_rate = sample_rate
        self.steps = steps
        self.steps_taken = steps_taken
        self.epsilon_spent = epsilon_spent


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """A repr of user input of at most ``limit`` characters (plus a note when cut).

    Built with ``reprlib``, which stops at a few levels and items, so a large or deeply nested
    value (an expanded YAML alias bomb) costs bounded time and output.
    """
    text = _REPR.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… (cut at {limit} characters)"


def _make_repr() -> reprlib.Repr:
    bounded = reprlib.Repr()
    bounded.maxlevel, bounded.maxstring, bounded.maxother, bounded.maxlong = 3, MAX_SHOWN_CHARS, MAX_SHOWN_CHARS, 40
    bounded.maxdict = bounded.maxlist = bounded.maxtuple = bounded.maxset = 6
    return bounded


_REPR = _make_repr()


def report_and_exit(error: DptuneError) -> NoReturn:
    """Print ``error: <message>`` on stderr and exit with the error's ``exit_status`` (no traceback)."""
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(error.exit_status)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with dptune's error shape: ``error: <what>`` and a pointer to ``--help``."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT)
