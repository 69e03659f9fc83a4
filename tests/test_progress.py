"""What a search shows of its progress: a ``tqdm`` bar per cell on a terminal (runs done of runs planned,
elapsed time and time left), plain lines without one, fused units that move their cell's count before
they end, a resume that starts at the runs recorded, and nothing of the runs of a private search.

Real searches run in a pseudo-terminal (what a user's console is) or with their output captured (what a
CI log is); the driver's callback is driven with real records and real ``tqdm`` bars."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import tempfile
import termios
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, SHORT_PRIVATE, SearchRun, search_command
from dptune.contract import TrialResult
from dptune.records import read_table
from dptune.search.runs.execution import FinishedRun, run_configurations, run_spec, write_result
from dptune.search.scheduling.progress import CellTally, SearchProgress, recorded_statuses
from dptune.search.scheduling.searcher import SCORES_KEY, Unit
from dptune.search.scheduling.tune_adapters import (
    RUN_STATUSES_KEY,
    RUNS_TRAINED_KEY,
    CellRun,
    RecordAndReport,
    TuneRunState,
)
from test_execution import FIRST, SECOND
from test_execution import context as fused_context
from test_tune_adapters import PARAMS, trial
from test_tune_adapters import context as cell_context

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"
#: A cell's bar as ``tqdm`` draws it: its label, runs done of runs planned, [elapsed<left, rate, postfix].
BAR = re.compile(
    r"(?P<label>eps=\S+ \w+)\s*:\s+\d+%\|[^|]*\| (?P<done>[\d.]+)/(?P<planned>\d+) "
    r"\[(?P<elapsed>[\d:]+)<(?P<left>[\d:?]+), [^\]]*\]"
)
#: A cell's plain line's count: runs done of runs planned, elapsed time, and the estimate of the time left.
PACE = re.compile(r"(?P<done>[\d.]+)/(?P<planned>\d+) runs done, [\d:]+ elapsed, (about [\d:]+ left|time left unknown)")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(autouse=True)
def _cache(dptune_cache_dir: Path) -> None:
    """Features and σ calibrations in the session's test cache, never the user's."""


def watched_search(env: dict[str, str], *args: str, timeout: float = 900) -> str:
    """``python -m dptune.search`` with the test caps and ``args`` on a pseudo-terminal of 160 columns (as
    a console runs it), to its end (exit 0); everything it drew there, terminal escapes removed."""
    main, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    process = subprocess.Popen(
        search_command(*args), cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal
    )
    os.close(terminal)
    drawn = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main], [], [], 1)[0]:
                try:
                    chunk = os.read(main, 1 << 16)
                except OSError:  # the search closed the terminal: it ended
                    break
                if not chunk:
                    break
                drawn += chunk
            elif process.poll() is not None:
                break
    finally:
        os.close(main)
        if process.poll() is None:
            process.kill()
    assert process.wait(timeout=60) == 0, drawn.decode(errors="replace")[-3000:]
    return ANSI.sub("", drawn.decode(errors="replace"))


def _planned_runs(root: Path) -> dict[str, int]:
    """Runs each cell (``<cell id> <clipping>``, as a bar's label) recorded, pruned configurations aside."""
    trials = read_table(str(root), "trials")
    ran = trials[trials["status"] != "pruned_min_steps"]
    return {f"{cell} {clipping}": len(rows) for (cell, clipping), rows in ran.groupby(["cell_id", "clipping"])}


# --------------------------------------------------------------------------- real searches


def test_a_search_on_a_terminal_draws_a_bar_per_cell_that_moves_inside_fused_units_and_ends_at_its_plan(
    search_env: dict[str, str], tmp_path: Path
) -> None:
    # each cell in one fused unit (4 configurations of B = 32 and 64: two fused groups each), so only the
    # unit's own reports can move its bar before the cell ends; every draw shown (TQDM_MININTERVAL)
    drawn = watched_search(
        {**search_env, "TQDM_MININTERVAL": "0"},
        *("--space", str(TINY), "--storage", str(tmp_path), "--no-report"),
        *("--set", "resources.configurations_per_trial=4"),
    )
    states: dict[str, list[re.Match[str]]] = {}
    for piece in re.split(r"[\r\n]", drawn):
        if match := BAR.search(piece):
            states.setdefault(match["label"], []).append(match)
    planned = _planned_runs(tmp_path / "tiny")
    assert sorted(states) == sorted(planned) and len(planned) == 4  # ε ∈ {1, 8} × {normalized, AUTO-S}
    assert planned == {label: 4 if label.endswith("normalized") else 2 for label in planned}
    for label, drawn_states in states.items():
        last = drawn_states[-1]
        assert float(last["done"]) == int(last["planned"]) == planned[label], label
        assert f"{planned[label]} ok" in last.group(0)  # the postfix counts the runs by status
        # between 0 and the plan: a fused unit's report after its first group (the unit is the whole cell)
        assert [s for s in drawn_states if 0 < float(s["done"]) < planned[label]], label
        assert all(s["planned"] == last["planned"] for s in drawn_states)
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d, ", drawn)  # elapsed < time left, once the rate is known
    assert "configurations:" not in drawn  # the bars replace the plain lines
    # what moved the bars: each fused unit's Tune reports of its runs trained, strictly inside the unit
    reports = [
        json.loads(line)
        for path in (tmp_path / "tiny/_tune/search").glob("*/result.json")
        for line in path.read_text().splitlines()
    ]
    inside = [report[RUNS_TRAINED_KEY] for report in reports if RUNS_TRAINED_KEY in report]
    assert len(inside) >= 4 and all(0 < runs < 4 for runs in inside)


def test_a_search_without_a_terminal_prints_plain_lines_that_end_at_each_cells_plan(tiny_search: SearchRun) -> None:
    out = tiny_search.stdout
    assert "\r" not in out and "%|" not in out  # no bar redrawn into a log
    last: dict[str, re.Match[str]] = {}
    for line in out.splitlines():
        if (label := re.match(r"\[(eps=\S+ \w+)\] ", line)) and (pace := PACE.search(line)):
            last[label[1]] = pace
    planned = _planned_runs(tiny_search.root)
    assert sorted(last) == sorted(planned)
    for label, pace in last.items():
        assert float(pace["done"]) == int(pace["planned"]) == planned[label], label
        assert "about" in pace.group(0)  # an estimate from the runs done since the search began


def test_a_private_search_on_a_terminal_shows_no_bar_count_or_estimate(search_env: dict[str, str]) -> None:
    temporary = Path(tempfile.mkdtemp(prefix="prg-", dir="/tmp"))  # a short path for Ray's sockets
    try:
        drawn = watched_search(
            {**search_env, "TMPDIR": str(temporary), "TQDM_MININTERVAL": "0"},
            *("--space", str(REPO_ROOT / "search_spaces/private.yaml"), "--storage", str(temporary / "results")),
            *("--no-report", *SHORT_PRIVATE),
        )
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    assert "no per-run progress is shown" in drawn and "the release of this end-to-end private search" in drawn
    search = drawn.split("running the private search", 1)[1]  # after loading and encoding the data
    for revealing in ("%|", "run/s", "s/run", "runs done", "elapsed", " left", "configurations:", "best so far"):
        assert revealing not in search, revealing
    assert not BAR.search(search) and not PACE.search(search)


# --------------------------------------------------------------------------- a fused unit, in process


def test_a_fused_unit_tells_its_runs_trained_after_each_epoch_and_group_but_its_last(tmp_path: Path) -> None:
    told: list[tuple[float, bool]] = []
    # B = 32 and 64: two fused groups of one configuration each, E = 2 epochs
    outcome = run_configurations(
        fused_context(tmp_path, replicates=1, fused=True),
        [FIRST, SECOND],
        progress=lambda runs, recorded: told.append((runs, recorded)),
    )
    assert outcome.ran == 2 and outcome.statuses == ["ok", "ok"]
    # half of the first group, the first group recorded, half of the second; its end is the unit's own report
    assert told == [(0.5, False), (1.0, True), (1.5, False)]


# --------------------------------------------------------------------------- the driver's display


def _recorded(cell_root: Path, replicates: int, params: list[dict[str, float]]) -> None:
    """Record every replicate of ``params`` as finished runs of the test cell at ``cell_root``."""
    cell = cell_context(cell_root, replicates)
    for configuration in params:
        for replicate in range(replicates):
            spec = run_spec(cell, configuration, replicate)
            result = TrialResult(
                config=spec.config, status="ok", steps=12, steps_taken=12, epsilon_spent=2.0, val_accuracy=0.5
            )
            write_result(cell, FinishedRun(spec, result))


def test_a_resumed_search_starts_each_bar_at_the_runs_recorded_and_counts_none_twice(tmp_path: Path) -> None:
    cell = cell_context(tmp_path, replicates=1)
    recorded = [{**PARAMS, "clip_bound": c} for c in (0.5, 1.0)]
    _recorded(tmp_path, 1, recorded)
    assert len(recorded_statuses(str(tmp_path), "s")[cell.cell_key]) == 2
    assert recorded_statuses(str(tmp_path), "another search") == {}
    assert f"{cell.cell_key}-auto_s" not in recorded_statuses(str(tmp_path), "s")  # another clipping rule's cell

    screen = io.StringIO()
    tally = CellTally("eps=8|epochs=4 normalized", 5, 1, recorded_statuses(str(tmp_path), "s")[cell.cell_key])
    progress = SearchProgress({cell.cell_key: tally}, stream=screen, interactive=True)
    progress.close()
    bars = [m for m in map(BAR.search, screen.getvalue().split("\r")) if m]
    assert bars and all((bar["done"], bar["planned"]) == ("2", "5") for bar in bars)  # from its first draw
    assert "2 ok" in bars[-1].group(0)

    # the driver's callback, as a resumed search starts it: a unit that runs one recorded configuration
    # again (its record is kept) and a new one counts the new one only
    callback = RecordAndReport({cell.cell_key: CellRun(cell, "eps=8|epochs=4 normalized", 5)}, TuneRunState())
    callback.setup()
    assert callback.progress.cells[cell.cell_key].done == 2
    unit = Unit(cell.cell_key, "t0", [recorded[0], {**PARAMS, "clip_bound": 2.0}])
    stub = trial(unit, {"done_recording": False, RUNS_TRAINED_KEY: 0.5}, saved_in=cell)
    callback.on_trial_result(0, [], stub, stub.last_result)
    assert callback.progress.cells[cell.cell_key].done == 2.5  # the unit's pending run, half trained
    stub.run_metadata.last_result = {"done_recording": True, SCORES_KEY: [0.5, 0.6], RUN_STATUSES_KEY: '["ok", "ok"]'}
    callback.on_trial_complete(0, [], stub)
    assert callback.progress.cells[cell.cell_key].done == 3 and callback.progress.cells[cell.cell_key].training == {}


def test_without_a_terminal_a_cell_prints_a_line_per_unit_and_per_tenth_of_its_plan(tmp_path: Path) -> None:
    screen = io.StringIO()
    progress = SearchProgress({"c": CellTally("eps=1|epochs=3 normalized", 5, 2)}, stream=screen)
    assert not progress.interactive  # a StringIO is no terminal
    for runs in (0.5, 1.0, 1.5, 2.5):  # a unit of 4 runs reporting: 5 %, 10 %, 15 %, 25 % of the 10 planned
        progress.training("c", "t0", runs)
    progress.ended("c", "t0", {f"c-{index:012x}-r{r}": "ok" for index in range(2) for r in range(2)})
    lines = screen.getvalue().splitlines()
    assert [PACE.search(line)["done"] for line in lines] == ["1", "2.5", "4"]  # 10 %, 20 %, and the unit's end
    assert lines[0].startswith("[eps=1|epochs=3 normalized] 1/10 runs done, ") and lines[0].endswith("(units training)")
    assert lines[2].startswith("[eps=1|epochs=3 normalized] 2/5 configurations × 2 replicates: runs 4 ok; 4/10 runs")
