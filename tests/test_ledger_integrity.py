"""A ledger that detects every damage, and a search id that formatting does not move (issue 49).

Every ledger entry file carries a checksum: a one-bit flip that leaves it parseable (a digit of σ, of
the planned or taken steps, a byte of the search id) is damage, never a smaller ε. A damaged start file
is refused before anything trains (or charged conservatively), a damaged end file is skipped (its runs
at their planned steps). The search id hashes the validated space, not its text. Fast: no Ray.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from dptune.records import ledger
from dptune.records.ledger import LedgerError, RunEnd, RunStart
from dptune.search import preflight
from dptune.search.preflight import PreflightError
from dptune.space import load_space, parse_space

TINY = REPO_ROOT / "tests/spaces/tiny.yaml"
#: The tiny space written another way: block and flow lists swapped, keys reordered, comments, and
#: its numbers spelt otherwise (``1e-05``, ``1.0``, ``1.00``).
TINY_REFORMATTED = """
name: tiny  # the same search
privacy: {delta: 1e-05, epsilons: [1.0, 8]}
task: {peft: head, backbone: minilm, max_tokens: 64, dataset: 20newsgroups}
epochs:
  - 3
clip_bound:
  values:
    - 0.10
    - 1.00
batch_size: {values: [32, 64, 256]}
base_learning_rate: {values: [0.01]}
coupling: {reference_batch_size: 64, rule: sqrt}
min_steps: 10
training: {diagnostic_examples: 64, diagnostics: true, compare_auto_s: true, clipping: normalized, optimizer: adam}
sampler: {name: grid}
resources: {cpus: 1.0}
seed: 0
"""


def _start(search_id: str, sigma: float = 1.5, steps: int = 28, epsilon: float = 2.0) -> RunStart:
    return RunStart(
        "t-r0",
        "t",
        0,
        search_id,
        "eps=2|epochs=3",
        "normalized",
        {"batch_size": 32.0},
        sigma,
        0.1,
        steps,
        1e-5,
        epsilon,
    )


def _file(root: Path, kind: str) -> Path:
    (path,) = sorted((root / ledger.LEDGER).glob(f"{kind}-*.json"))
    return path


def _flip(path: Path, field: str, value: str, offset: int = 0) -> None:
    """Flip the lowest bit of character ``offset`` of ``value`` where ``"field": value`` is written: a digit
    stays a digit (0↔1, …, 8↔9), a letter another letter, and the file still parses."""
    data = path.read_bytes()
    at = data.index(f'"{field}": {value}'.encode()) + len(f'"{field}": ') + offset
    flipped = data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]
    json.loads(flipped)  # still valid JSON: only the checksum can tell
    path.write_bytes(flipped)


# --------------------------------------------------------------------------- the checksum


def test_what_is_written_verifies_on_reading_back(tmp_path: Path) -> None:
    """Floats and ints re-serialise as they were written: 1e-05, 0.1, 1/3, 1e+16, -0.0, 2**62."""
    awkward = RunStart(
        "t-r0", "t", 0, "s", "eps=1e-05|epochs=3", "flat", {"lr": 1 / 3, "big": 1e16}, 0.1, -0.0, 2**62, 1e-05, 1e-05
    )
    runs = ledger.record_starts(str(tmp_path), [awkward, _start("s")])
    ledger.record_ends(str(tmp_path), [RunEnd(runs[0], "t-r0", "ok", 2**62, 1e-05)])
    document = json.loads(_file(tmp_path, "start").read_text())
    assert document["version"] == ledger.LEDGER_VERSION == 2 and len(document["checksum"]) == 64
    assert ledger.started_runs(str(tmp_path), "s") == [awkward, _start("s")]
    charged = ledger.charged_runs(str(tmp_path), "s")
    assert list(charged["steps_taken"]) == [2**62, 28] and ledger.unreadable_ends(str(tmp_path)) == []


@pytest.mark.parametrize(
    ("field", "value", "offset"), [("noise_multiplier", "1.5", 0), ("steps", "28", 0), ("search_id", '"s"', 1)]
)
def test_a_bit_flip_in_a_start_entry_is_damage_named_before_anything_trains(
    tmp_path: Path, field: str, value: str, offset: int
) -> None:
    ledger.record_starts(str(tmp_path), [_start("s")])
    start = _file(tmp_path, "start")
    _flip(start, field, value, offset)  # σ 1.5 → 0.5, T 28 → 38, search id "s" → "r"
    for read in (ledger.check_ledger, lambda root: ledger.started_runs(root, "s")):
        with pytest.raises(LedgerError) as refused:
            read(str(tmp_path))
        message = str(refused.value)
        assert message.startswith(f"{start}: damaged privacy ledger entry (checksum mismatch")
        assert "Restore the file from a backup" in message and ledger.CHARGE_UNREADABLE_FLAG in message
    with pytest.raises(LedgerError, match="damaged privacy ledger entry"):
        ledger.charged_runs(str(tmp_path), "s")
    assert ledger.unreadable_ends(str(tmp_path)) == []  # tells end files only
    # --charge-unreadable-ledger's path: listed, then replaced by its stand-in (which verifies) and moved aside
    assert ledger.unreadable_starts(str(tmp_path)) == [str(start)]
    stand_in = _start("s", sigma=0.5, steps=1000)
    ledger.replace_unreadable_start(str(tmp_path), str(start), [stand_in])
    assert ledger.started_runs(str(tmp_path), "s") == [stand_in] and ledger.unreadable_starts(str(tmp_path)) == []
    assert (tmp_path / ledger.LEDGER / ledger.UNREADABLE / start.name).exists()


def test_a_bit_flip_in_an_end_entry_leaves_its_run_charged_its_planned_steps(tmp_path: Path) -> None:
    (run,) = ledger.record_starts(str(tmp_path), [_start("s", steps=631)])
    ledger.record_ends(str(tmp_path), [RunEnd(run, "t-r0", "ok", 631, 2.0)])
    end = _file(tmp_path, "end")
    _flip(end, "steps_taken", "631")  # 631 → 731: parses, so only the checksum can tell
    charged = ledger.charged_runs(str(tmp_path), "s")
    assert list(charged["steps_taken"]) == [631] and list(charged["status"]) == ["unrecorded"]
    assert ledger.unreadable_ends(str(tmp_path)) == [str(end)]
    assert ledger.check_ledger(str(tmp_path)) == {"s": 1}  # a damaged end file never stops a search


def test_a_format_1_file_reads_and_a_format_2_file_needs_its_checksum(tmp_path: Path) -> None:
    entry = {"run": "r1", **{name: getattr(_start("s"), name) for name in RunStart.__dataclass_fields__}}
    old = {"version": 1, "kind": "start", "host": "h", "pid": 1, "written_at": "2025-01-01T00:00:00+00:00"}
    folder = tmp_path / ledger.LEDGER
    folder.mkdir()
    (folder / "start-old.json").write_text(json.dumps({**old, "entries": [entry]}))  # as older dptune wrote it
    assert ledger.started_runs(str(tmp_path), "s") == [_start("s")]
    (folder / "start-new.json").write_text(json.dumps({**old, "version": 2, "entries": [entry]}))
    with pytest.raises(LedgerError, match=r"start-new.json: damaged privacy ledger entry \(no checksum"):
        ledger.check_ledger(str(tmp_path))
    (folder / "start-new.json").write_text(json.dumps({**old, "version": 3, "entries": [entry]}))
    with pytest.raises(LedgerError, match=r"start-new.json: unreadable privacy ledger entry .*format version 3"):
        ledger.check_ledger(str(tmp_path))


# --------------------------------------------------------------------------- the search id


def test_the_spec_hash_is_the_validated_space_not_its_text() -> None:
    loaded = load_space(TINY)
    assert parse_space(TINY_REFORMATTED, "reformatted.yaml").spec_hash == loaded.spec_hash
    changed = parse_space(TINY_REFORMATTED.replace("epsilons: [1.0, 8]", "epsilons: [1.0, 9]"), "changed.yaml")
    assert changed.spec_hash != loaded.spec_hash


def test_a_reformatted_space_and_an_older_dptune_folder_resume_their_own_search(tmp_path: Path) -> None:
    loaded = load_space(TINY)
    root = str(tmp_path / "tiny")
    preflight.write_manifest(root, loaded, "tiny", f"tiny-{loaded.spec_hash}")
    ledger.record_starts(root, [_start(f"tiny-{loaded.spec_hash}")])
    reformatted = parse_space(TINY_REFORMATTED, "reformatted.yaml")
    preflight.check_same_space(root, reformatted)
    assert preflight.folder_search_id(root, reformatted, "tiny", resume=True) == f"tiny-{loaded.spec_hash}"

    # a folder an older dptune started: the id it charged under came from a hash of the space's text
    text_hash = hashlib.sha256(loaded.text.encode()).hexdigest()[:16]
    old = tmp_path / "old"
    old.mkdir()
    (old / preflight.MANIFEST).write_text(
        json.dumps({"name": "tiny", "spec_hash": text_hash, "spec_yaml": loaded.text})
    )
    ledger.record_starts(str(old), [_start(f"tiny-{text_hash}")])
    preflight.check_same_space(str(old), reformatted)
    assert preflight.folder_search_id(str(old), reformatted, "renamed", resume=True) == f"tiny-{text_hash}"


def test_a_changed_space_a_foreign_entry_and_a_damaged_entry_are_told_apart(tmp_path: Path) -> None:
    loaded = load_space(TINY)
    own = f"tiny-{loaded.spec_hash}"
    root = tmp_path / "tiny"
    preflight.write_manifest(str(root), loaded, "tiny", own)
    ledger.record_starts(str(root), [_start(own)])
    messages = []

    changed = load_space(TINY, {"privacy.epsilons": [1, 9]})
    for check in (
        lambda: preflight.folder_search_id(str(root), changed, "tiny", resume=True),
        lambda: preflight.check_same_space(str(root), changed),
    ):
        with pytest.raises(PreflightError) as refused:
            check()
        assert "--resume: the search space differs" in str(refused.value)
        assert "privacy.epsilons: [1, 8] → [1, 9]" in str(refused.value)
    messages.append(str(refused.value))

    ledger.record_starts(str(root), [_start("other-0123456789abcdef")])  # intact, from another folder
    with pytest.raises(PreflightError, match="holds start entries of search.es. other-0123456789abcdef") as refused:
        preflight.folder_search_id(str(root), loaded, "tiny", resume=True)
    messages.append(str(refused.value))

    foreign = next(p for p in (root / ledger.LEDGER).glob("start-*.json") if "other-" in p.read_text())
    foreign.unlink()
    _flip(_file(root, "start"), "search_id", f'"{own}"', 1)  # one bit of the folder's own entry's id
    with pytest.raises(LedgerError, match="damaged privacy ledger entry .checksum mismatch") as damaged:
        preflight.folder_search_id(str(root), loaded, "tiny", resume=True)
    messages.append(str(damaged.value))
    phrases = ("search space differs", "holds start entries", "damaged privacy ledger entry")
    for message, phrase in zip(messages, phrases, strict=True):
        assert [other for other in phrases if other in message] == [phrase]
    # --charge-unreadable-ledger: collected for a conservative charge, not refused
    unreadable: list[str] = []
    assert preflight.folder_search_id(str(root), loaded, "tiny", resume=True, unreadable=unreadable) == own
    assert unreadable == [str(_file(root, "start"))]
