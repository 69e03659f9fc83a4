"""The scan of what an end-to-end private search leaves outside its trust boundary.

A private search's runs (their number K, configurations, scores, statuses and ids) live inside
``<results>/inside_trust_boundary/`` only. :func:`hidden_needles` lists what of them a scan looks
for; :func:`assert_none_in` scans bytes for it; :func:`assert_nothing_of_the_hidden_runs_outside`
scans a finished search's results folder and console.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
import tempfile
from pathlib import Path

import pandas as pd

from conftest import run_search
from dptune.records import TRUST_BOUNDARY, read_table
from dptune.records.weights import read_weights

#: A timestamp as Ray's and Tune's log lines print one.
LOG_TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")
#: The released configuration's columns (published in the release table, so not searched for).
_CONFIGURATION = ("clip_bound", "batch_size", "base_learning_rate")


def private_search(
    env: dict[str, str], storage: Path, space: Path, name: str, *flags: str
) -> subprocess.CompletedProcess:
    """Run the private search of ``space`` into ``storage`` under its own short temporary folder
    (``TMPDIR``, linked at ``<storage>/<name>-tmp``: the embedded Ray's session folder goes below it,
    and a socket's path has ≤ 107 bytes); assert it exited 0."""
    temporary = Path(tempfile.mkdtemp(prefix=f"{name[:3]}-", dir="/tmp"))
    (storage / f"{name}-tmp").symlink_to(temporary)
    completed = run_search(
        {**env, "TMPDIR": str(temporary)},
        "--space",
        str(space),
        "--storage",
        str(storage),
        "--name",
        name,
        "--no-report",
        *flags,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


#: The shortest float a scan looks for: a shorter one (a noisy score of 0.2 = 30/150) stands for too many
#: other numbers (ε, δ, an accuracy rounded for print) to be told apart.
_MIN_FLOAT_CHARS = 6


def card_numbers(*roots: Path) -> set[float]:
    """Every number on the model cards the searches at ``roots`` published (``models/*/model_card.json``):
    the release's configuration (σ, q = B/N, T, η = η₀·√(B/B_ref) besides C, B, η₀), its scores and
    intervals. They are public, so a hidden run's number equal to one of them (a noisy score k/150
    equals q = 16/150 for B = 32 of N = 300) tells nothing of that run."""
    numbers: set[float] = set()

    def collect(value: object) -> None:
        if isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, list):
            for item in value:
                collect(item)
        elif isinstance(value, float):
            numbers.add(value)

    for root in roots:
        for card in root.glob("models/*/model_card.json"):
            collect(json.loads(card.read_text()))
    return numbers


def hidden_needles(
    trials: pd.DataFrame, release: pd.DataFrame, public: set[float] | None = None, *, scores: bool = True
) -> dict[bytes, str]:
    """What identifies a hidden run, each with what it is: every run's trial and configuration id,
    and every noisy score (unless not ``scores``), clipping bound and learning rate (as Python and JSON
    write a float, at least ``_MIN_FLOAT_CHARS`` long) other than the released ones and the ``public``
    numbers (:func:`card_numbers`)."""
    needles = {}
    for run in trials.itertuples():
        needles[run.trial_id.encode()] = f"trial id of {run.trial_id}"
        needles[run.configuration_id.encode()] = f"configuration id of {run.trial_id}"
    # a hidden run's noisy score k/n_val can equal a released number (the release's own score, or its
    # test accuracy k'/n_test on a split of the same size, which its model card writes as JSON): that
    # number is public already, so finding it outside tells nothing of the hidden run
    released_score = set(release["noisy_val_accuracy"]) | set(release["test_accuracy"].dropna())
    released_configuration = set(map(tuple, release[list(_CONFIGURATION)].to_numpy().tolist()))
    floats = {}
    for run in trials.itertuples():
        if tuple(getattr(run, column) for column in _CONFIGURATION) not in released_configuration:
            for column in ("clip_bound", "base_learning_rate"):
                floats[float(getattr(run, column))] = f"{column} of {run.trial_id}"
        score = run.noisy_val_accuracy
        if scores and not pd.isna(score) and score not in released_score:
            floats[float(score)] = f"noisy score of {run.trial_id}"
    needles |= {
        repr(value).encode(): what
        for value, what in floats.items()
        if len(repr(value)) >= _MIN_FLOAT_CHARS and value not in (public or set())
    }
    return needles


def private_data_digests(inside: Path) -> dict[bytes, str]:
    """The sha256 of the private rows, as the runs' own weights (single files or their units' bundles)
    record it inside the trust boundary (``provenance.data_sha256``): what no released byte may hold."""
    runs = read_table(str(inside), "trials", columns=["trial_id", "status"])
    models = [read_weights(str(inside), trial_id) for trial_id in runs.loc[runs["status"] == "ok", "trial_id"]]
    digests = {model.provenance.get("data_sha256") for model in models if model is not None}
    found = {digest.encode(): "the private rows' sha256" for digest in digests if digest}
    assert found, f"no run in {inside} recorded the data's digest"
    return found


def assert_owner_only(root: Path) -> None:
    """Every folder and file a private search created under ``root`` (and ``root`` itself) is the
    owner's alone: no permission bit for the group or others."""
    opened = [
        f"{path} {stat.filemode(path.lstat().st_mode)}"
        for path in [root, *root.rglob("*")]
        if not path.is_symlink() and path.lstat().st_mode & 0o077
    ]
    assert not opened, "readable by others:\n" + "\n".join(opened[:10])


def assert_none_in(blob: bytes, needles: dict[bytes, str], where: str) -> None:
    """Fail naming the first needles found in ``blob`` (a number only where no digit or point
    continues it: 0.25 is not found in 0.257) and ``where`` they were."""
    found = [
        what
        for needle, what in needles.items()
        if needle in blob and re.search(rb"(?<![0-9.])" + re.escape(needle) + rb"(?![0-9])", blob)
    ]
    assert not found, f"{where} holds {found[:5]}"


def outside_bytes(root: Path) -> bytes:
    """Every file of the results folder ``root`` outside its trust boundary, concatenated."""
    return b"".join(
        path.read_bytes() for path in root.rglob("*") if path.is_file() and TRUST_BOUNDARY not in path.parts
    )


def assert_nothing_of_the_hidden_runs_outside(
    root: Path, out: str, temporary: Path | None, slots: int, public: set[float] | None = None
) -> None:
    """Outside ``inside_trust_boundary/`` of the private search at ``root`` that printed ``out``: none of
    :func:`hidden_needles` nor the private rows' digest (:func:`private_data_digests`: the model file's
    header, its cards), no timestamped log line on the console; an embedded Ray's owner-only
    session folder gone from ``temporary``, and no shared one left there; and Ray Tune ran a number of
    units that does not depend on K (``slots``, the trial slots, per cell), each holding one constant
    report. ``public``: numbers published anywhere (default: this search's model cards)."""
    inside = root / TRUST_BOUNDARY
    trials, release = pd.read_parquet(inside / "trials"), pd.read_parquet(root / "release")
    needles = hidden_needles(trials, release, card_numbers(root) if public is None else public)
    needles |= private_data_digests(inside)
    assert_none_in(outside_bytes(root), needles, f"{root} outside {TRUST_BOUNDARY}")
    assert_none_in(out.encode(), needles, "the console")
    stamped = [line for line in out.splitlines() if LOG_TIME.search(line)]
    assert not stamped, "timestamped log lines on the console:\n" + "\n".join(stamped)
    if temporary is not None:
        assert not [p.name for p in temporary.iterdir() if p.name.startswith("dptune-ray-") or p.name == "ray"]
    units = [p for p in (inside / "_tune" / "search").iterdir() if p.is_dir()]
    assert len(units) == slots
    for unit in units:
        (line,) = (unit / "result.json").read_text().splitlines()
        assert json.loads(line)["val_accuracy"] == 0.0
