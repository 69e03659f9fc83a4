"""The report of an end-to-end private search: what may be released, and the owner-only report of its runs.

One real private search (search_spaces/private.yaml, K with mean 3, five epochs) is run once for the
module; its public report must show the release, its guarantee, the planner's numbers and the model's
test interval and nothing from inside the trust boundary; the report of ``inside_trust_boundary`` must
say at its top that it is not for release.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

import dptune
from conftest import REPO_ROOT, SHORT_PRIVATE, TINY_EVAL_EXAMPLES, TINY_TRAIN_EXAMPLES
from dptune import analysis as an
from dptune.records import TRUST_BOUNDARY, read_table
from dptune.records.weights import CARD_JSON
from dptune.report import build_report, main
from dptune.search.planning.cells import TRIAL_COUNT_FILE
from hidden_runs import assert_none_in, card_numbers, hidden_needles, private_search

PRIVATE = REPO_ROOT / "search_spaces/private.yaml"


@pytest.fixture(scope="module")
def private_root(tmp_path_factory: pytest.TempPathFactory, search_env: dict[str, str]) -> Path:
    """The results folder of one real private search (tests only read it)."""
    storage = tmp_path_factory.mktemp("private-report")
    private_search(search_env, storage, PRIVATE, "private", *SHORT_PRIVATE)
    return storage / "private"


def _text(page: str) -> str:
    """The page's visible text: tags and embedded images dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<style>.*?</style>", "", page, flags=re.S)))


def test_public_report_shows_the_release_its_guarantee_and_plan_and_nothing_from_inside(
    private_root: Path, tmp_path: Path, search_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPTUNE_CACHE_DIR", search_env["DPTUNE_CACHE_DIR"])
    out = tmp_path / "public"
    page = build_report([str(private_root)], out).read_text(encoding="utf-8")
    text = _text(page)
    (release,) = read_table(str(private_root), "release").to_dict("records")
    (search,) = read_table(str(private_root), "search").to_dict("records")
    (model,) = (private_root / "models").iterdir()
    card = json.loads((model / CARD_JSON).read_text())
    # the release, its model and the guarantee the search recorded, word for word
    assert "The release: what may be published" in text and f"{model}/model.safetensors" in text
    assert search["guarantee"] == release["guarantee"] and search["guarantee"] in text
    # the public test accuracy with the model's own interval on its test rows, as the card's
    low, high = an.accuracy_interval(release["test_accuracy"], card["accuracy"]["num_test"])
    shown = f"{100 * release['test_accuracy']:.1f} [{100 * low:.1f}, {100 * high:.1f}] on 150 rows"
    assert shown in text and [round(v, 3) for v in card["accuracy"]["test_interval"]] == [round(low, 3), round(high, 3)]
    # the planner's numbers: the released B's σ is the one its model trained with; K by its distribution only
    configuration = card["configuration"]
    assert (
        f"{configuration['noise_multiplier']:.4f}" in text and f"ε = {release['epsilon_per_trial']:.4g} per run" in text
    )
    released_row = re.search(rf"<tr>\s*<td>{int(release['batch_size'])}</td>(.*?)</tr>", page, flags=re.S)
    assert (
        released_row and "◀ released" in released_row.group(1) and f"{configuration['steps']}" in released_row.group(1)
    )
    assert "geometric on {1, 2, …} with shape η = 1 and mean 3" in text and "σ_s = 5 predictions" in text
    assert f"python -m dptune.report {private_root}/{TRUST_BOUNDARY} --out FOLDER" in text
    # no list of what a private search can never have, no advice it refuses, no build time
    for absent in ("Left out for lack of data", "no finished trials", "diagnostics: true", " built "):
        assert absent not in text, absent
    assert sorted(path.name for path in out.iterdir()) == ["index.html"]
    # nothing from inside the trust boundary: no run's id, unreleased configuration or score, no K
    inside = private_root / TRUST_BOUNDARY
    trials = read_table(str(inside), "trials")
    public_numbers = card_numbers(private_root) | {float(v) for v in release.values() if isinstance(v, float)}
    assert_none_in(
        page.encode(), hidden_needles(trials, read_table(str(private_root), "release"), public_numbers), "page"
    )
    shown_numbers = set(re.findall(r"(?<![0-9.])\d+\.\d(?![0-9])", text))
    public_percents = {f"{100 * v:.1f}" for v in (release["noisy_val_accuracy"], release["test_accuracy"], low, high)}
    exact = {f"{100 * v:.1f}" for v in trials["val_accuracy"].dropna()} - public_percents
    assert not exact & shown_numbers, f"exact validation accuracies in the public report: {exact & shown_numbers}"
    (count,) = json.loads((inside / TRIAL_COUNT_FILE).read_text()).values()
    assert not re.search(rf"\b(K|runs?|trials?) (=|of) {count}\b", text) and f"{count} trial" not in text


def test_owner_report_of_the_trust_boundary_says_first_it_is_not_for_release(
    private_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture, search_env: dict[str, str], monkeypatch
) -> None:
    monkeypatch.setenv("DPTUNE_CACHE_DIR", search_env["DPTUNE_CACHE_DIR"])
    inside = private_root / TRUST_BOUNDARY
    main([str(inside), "--out", str(tmp_path / "owner")])
    printed = capsys.readouterr().out
    assert (
        f"owner-only report (NOT for release: the runs inside the trust boundary) written to {tmp_path / 'owner'}"
        in printed
    )
    page = (tmp_path / "owner" / "index.html").read_text(encoding="utf-8")
    # the notice is the first thing under the title, and the title says it too
    title, after = page.split("</h1>", 1)
    assert "NOT FOR RELEASE" in title and after.startswith('<div class="owner-only"><p><strong>OWNER-ONLY')
    notice = _text(after.split("</div>", 1)[0])
    assert "voids the guarantee" in notice and f"python -m dptune.report {private_root} --out FOLDER" in notice
    # it is the per-run report (the runs' ids are in it), with the search's release and guarantee from above
    text = _text(page)
    trials = read_table(str(inside), "trials")
    assert any(trial_id in text for trial_id in trials["trial_id"])
    (search,) = read_table(str(private_root), "search").to_dict("records")
    assert "Release of the private search" in text and search["guarantee"] in text
    assert "only the private search's release (below)" in text and "none published" not in text
    # no list of sections a private search cannot have, and no advice it refuses
    assert "Left out for lack of data" not in text and "diagnostics: true" not in notice
    assert "Not shown: sections a private search cannot fill" in notice


def test_an_audit_is_refused_in_the_public_report(
    private_root: Path, tmp_path: Path, search_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit's numbers come from a second training on the private rows, outside ε_total: the public
    report of a private search refuses ``--audit`` before writing anything."""
    monkeypatch.setenv("DPTUNE_CACHE_DIR", search_env["DPTUNE_CACHE_DIR"])
    audit = tmp_path / "audit"
    caps = {"max_train_examples": TINY_TRAIN_EXAMPLES, "max_eval_examples": TINY_EVAL_EXAMPLES}
    dptune.audit(REPO_ROOT / "tests/spaces/tiny.yaml", out=audit, canaries=100, progress=False, **caps)
    out = tmp_path / "public"
    with pytest.raises(an.AnalysisError, match="not part of its public report"):
        build_report([str(private_root)], out, audit=str(audit))
    assert not out.exists()
