"""What the driver shows of a search as it runs: per cell, runs done of runs planned (configurations ×
replicates), the time elapsed and an estimate of the time left (:class:`SearchProgress`). Ray-free.

Where someone watches, a terminal or a Jupyter notebook (``tqdm.auto``: a widget there, a text bar on a
terminal), each cell has a bar whose postfix counts the cell's runs by status and shows its best score so
far. Elsewhere (CI, ``ray job submit`` logs, a file) nothing is redrawn: a cell prints one plain line when
a unit of it ends, and in between one each time its runs done pass another 1/:data:`LINE_STEPS` of its plan.

A run is done once it is recorded, whatever its status: a run that ASHA stopped, that diverged or that
failed counts as done (the postfix and the lines say how many of each). A running unit adds the runs it
reported trained (:meth:`SearchProgress.training`: a fused unit's are fractional inside a group, a trial
unit's advance epoch by epoch), so a cell trained in a few large units moves between their ends. A
resumed search starts each cell at the runs its results folder holds (:func:`recorded_statuses`).

An end-to-end private search shows none of this: its units report nothing of their runs, and a count of
runs done would reveal the secret number of runs K.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from dptune.records import RecordsError, read_table

#: Without a bar, a cell prints a line each time its runs done pass another 1/LINE_STEPS of its plan.
LINE_STEPS = 10


@dataclass
class CellTally:
    """What one cell has done, in runs. ``label`` names the cell in the display; ``budget`` is its
    configurations and ``replicates`` R, so it plans ``budget × R`` runs. ``statuses``: the status of
    each run done (recorded), by trial id; ``training``: per running unit (by Tune trial id), the runs
    it reported trained so far (≥ 0, fractional inside a fused group); ``initial``: runs done when this
    driver began to show the cell (the clock of its estimate starts then); ``best``: its best score so far
    and the configuration that reached it, as shown (empty: none yet)."""

    label: str
    budget: int
    replicates: int
    statuses: dict[str, str] = field(default_factory=dict)
    training: dict[str, float] = field(default_factory=dict)
    initial: float = 0.0
    best: str = ""

    @property
    def planned(self) -> int:
        """Runs the cell plans: configurations × replicates, or the runs it recorded where more (a racing
        round adds runs: the plan grows with each round)."""
        return max(self.budget * self.replicates, len(self.statuses) + math.ceil(sum(self.training.values())))

    @property
    def done(self) -> float:
        """Runs done, those of running units counted as far as they reported (at most :attr:`planned`)."""
        return min(float(self.planned), len(self.statuses) + sum(self.training.values()))

    def counts(self) -> Counter[str]:
        """Runs done by status."""
        return Counter(self.statuses.values())

    def configurations_done(self) -> int:
        """Configurations whose every replicate is done (a trial id is ``<configuration id>-r<replicate>``)."""
        per_configuration = Counter(trial_id.rsplit("-r", 1)[0] for trial_id in self.statuses)
        return sum(count >= self.replicates for count in per_configuration.values())


#: A trial id: its cell key, its configuration's 12 hex digits and its replicate (``records.ids``).
TRIAL_ID = re.compile(r"(?P<cell>.+)-[0-9a-f]{12}-r\d+")


def recorded_statuses(results_root: str, search_id: str) -> dict[str, dict[str, str]]:
    """The status of each run of search ``search_id`` recorded at ``results_root``, by cell key, then by trial
    id (one read of the ``trials`` table); configurations the min-step rule pruned are not runs of the plan
    (they never count against its budget). A table that cannot be read counts none (the display starts at
    zero; what reads the records says why)."""
    try:
        trials = read_table(results_root, "trials", ["trial_id", "search_id", "status"])
    except (OSError, RecordsError):
        return {}
    rows = trials[(trials["search_id"] == search_id) & (trials["status"] != "pruned_min_steps")]
    by_cell: dict[str, dict[str, str]] = {}
    for trial_id, status in zip(rows["trial_id"], rows["status"], strict=True):
        if match := TRIAL_ID.fullmatch(str(trial_id)):
            by_cell.setdefault(match["cell"], {})[str(trial_id)] = str(status)
    return by_cell


def watched(stream: TextIO) -> bool:
    """Whether someone watches ``stream`` redraw: ``tqdm.auto`` chose its notebook widget (Jupyter), or
    ``stream`` is a terminal."""
    from tqdm import auto

    isatty = getattr(stream, "isatty", None)
    notebook = any(base.__module__ == "tqdm.notebook" for base in auto.tqdm.__mro__)
    return notebook or bool(isatty is not None and isatty())


def say(line: str) -> None:
    """Print ``line`` on the console above any progress bar (``tqdm.write``, which redraws the bars after it)."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def _shown(runs: float) -> float | int:
    """``runs`` as a bar shows them: to a tenth, and whole numbers without a decimal point."""
    rounded = round(float(runs), 1)
    return int(rounded) if rounded.is_integer() else rounded


class SearchProgress:
    """The display of every cell of one Tune run (``cells``: each cell's :class:`CellTally`, by cell key):
    a ``tqdm.auto`` bar per cell when ``interactive`` (by default: when someone watches ``stream``,
    :func:`watched`), else plain lines on ``stream``. :meth:`close` ends the bars (left on screen)."""

    def __init__(
        self, cells: Mapping[str, CellTally], stream: TextIO | None = None, interactive: bool | None = None
    ) -> None:
        self.cells = dict(cells)
        self.stream = sys.stdout if stream is None else stream
        self.interactive = watched(self.stream) if interactive is None else interactive
        self.started = time.monotonic()
        for tally in self.cells.values():
            tally.initial = tally.done
        self._steps_shown = {key: self._step(key) for key in self.cells}
        self._bars: dict[str, Any] = {}
        if self.interactive:
            from tqdm.auto import tqdm

            width = max((len(tally.label) for tally in self.cells.values()), default=0)
            for position, (key, tally) in enumerate(self.cells.items()):
                self._bars[key] = tqdm(
                    total=tally.planned,
                    initial=_shown(tally.done),
                    desc=tally.label.ljust(width),  # the bars of every cell start in one column
                    unit="run",
                    position=position,
                    leave=True,
                    miniters=0,  # redraw on any change, at most every mininterval (TQDM_MININTERVAL)
                    dynamic_ncols=True,
                    file=self.stream,
                )
                self._bars[key].set_postfix_str(self._postfix(key), refresh=True)

    def training(self, cell_key: str, unit: str, runs: float) -> None:
        """Running unit ``unit`` of cell ``cell_key`` reported ``runs`` of its runs trained."""
        self.cells[cell_key].training[unit] = max(0.0, runs)
        if self.interactive:
            self._draw(cell_key)
        elif (step := self._step(cell_key)) > self._steps_shown[cell_key]:
            self._steps_shown[cell_key] = step
            self._print(f"[{self.cells[cell_key].label}] {self.pace(cell_key)} (units training)")

    def ended(self, cell_key: str, unit: str, statuses: Mapping[str, str], what: str = "", show: bool = False) -> None:
        """Unit ``unit`` of cell ``cell_key`` ended: its runs' ``statuses`` (by trial id) are recorded, and
        ``what`` happened (a line says so without a bar; with bars only when ``show``, the postfix counts
        the rest)."""
        tally = self.cells[cell_key]
        tally.training.pop(unit, None)
        tally.statuses.update(statuses)
        if self.interactive:
            self._draw(cell_key, self.line(cell_key, what) if show else None)
            return
        self._steps_shown[cell_key] = max(self._steps_shown[cell_key], self._step(cell_key))
        self._print(f"{self.line(cell_key, what)}; {self.pace(cell_key)}")

    def failed(self, cell_key: str, unit: str, what: str) -> None:
        """Unit ``unit`` of cell ``cell_key`` failed (``what``: how, and what becomes of its runs): its runs
        trained so far no longer count, and a line says so."""
        self.cells[cell_key].training.pop(unit, None)
        if self.interactive:
            self._draw(cell_key, self.line(cell_key, what))
        else:
            self._print(self.line(cell_key, what))

    def line(self, cell_key: str, what: str = "") -> str:
        """One line of the cell: configurations done of its budget, its runs done by status (the counts the
        summary table shows at the end), ``what`` happened now and its best score so far."""
        tally = self.cells[cell_key]
        replicates = f" × {tally.replicates} replicates" if tally.replicates > 1 else ""
        counts = ", ".join(f"{count} {status}" for status, count in sorted(tally.counts().items())) or "no run ended"
        now = f" ({what})" if what else ""
        best = f"; best so far {tally.best}" if tally.best else ""
        return (
            f"[{tally.label}] {tally.configurations_done()}/{tally.budget} configurations{replicates}: "
            f"runs {counts}{now}{best}"
        )

    def pace(self, cell_key: str) -> str:
        """Runs done of runs planned, the time since this driver began and an estimate of the time left."""
        from tqdm.auto import tqdm

        tally = self.cells[cell_key]
        elapsed = time.monotonic() - self.started
        ran = tally.done - tally.initial
        left = (
            f"about {tqdm.format_interval((tally.planned - tally.done) * elapsed / ran)} left"
            if ran > 0
            else "time left unknown"
        )
        return f"{_shown(tally.done)}/{tally.planned} runs done, {tqdm.format_interval(elapsed)} elapsed, {left}"

    def close(self) -> None:
        """Draw each bar's last state and leave it on screen."""
        for key, bar in self._bars.items():
            bar.n = max(bar.n, _shown(self.cells[key].done))
            bar.set_postfix_str(self._postfix(key), refresh=False)
            bar.close()
        self._bars.clear()

    def _step(self, cell_key: str) -> int:
        """How many 1/:data:`LINE_STEPS` shares of its plan the cell has done."""
        tally = self.cells[cell_key]
        return int(tally.done * LINE_STEPS / tally.planned) if tally.planned else 0

    def _postfix(self, cell_key: str) -> str:
        """The bar's postfix: the cell's runs done by status, and its best score so far."""
        tally = self.cells[cell_key]
        counts = ", ".join(f"{count} {status.replace('_', ' ')}" for status, count in sorted(tally.counts().items()))
        return f"{counts}; best {tally.best}" if tally.best else counts

    def _draw(self, cell_key: str, line: str | None = None) -> None:
        """Move the cell's bar to its runs done (never back: a lost unit's runs train again), printing
        ``line`` above the bars first."""
        bar = self._bars[cell_key]
        if line is not None:
            bar.write(line, file=self.stream)
        bar.total = max(bar.total, self.cells[cell_key].planned)
        bar.n = max(bar.n, _shown(self.cells[cell_key].done))
        bar.set_postfix_str(self._postfix(cell_key), refresh=False)
        bar.update(0)  # redraws when mininterval has passed since the last draw

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
