"""A published model's card cites its audit (:func:`dptune.audit.cite.cite_audit`): a real search of 20
Newsgroups texts (a data owner's CSV, so that the audit loads exactly the rows the search trained on) publishes
a model, a real audit of it runs in-process, and the card gains the audit's numbers and the privacy of the
model and its published audit together; every refusal leaves the model's files as they were."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

import dptune
from conftest import run_search
from dptune.audit import AuditError
from dptune.audit.cite import AUDIT_HEADING, cite_audit
from dptune.data.sources import load_20newsgroups
from dptune.privacy import TrialMechanism, compose, epsilon_spent

pytestmark = pytest.mark.xdist_group("audit_cite")

GROUPS = ("rec.autos", "sci.space", "talk.politics.guns")
#: The model's space: tests/spaces/tiny.yaml cut to one cell (ε = 8, E = 3) of four configurations, on a CSV.
SPACE = """
name: cited
task: {{dataset: {{path: {train}, input_column: text, label_column: label, test_path: {test}, test_public: true}},
        backbone: minilm, peft: head, max_tokens: 64}}
privacy: {{epsilons: [8], delta: 1.0e-5}}
epochs: [3]
clip_bound: {{values: [0.1, 1.0]}}
batch_size: {{values: [16, 32]}}
base_learning_rate: {{values: [0.01]}}
coupling: {{rule: sqrt, reference_batch_size: 64}}
min_steps: 5
training: {{optimizer: adam, clipping: normalized, compare_auto_s: false, diagnostics: false}}
sampler: {{name: grid}}
resources: {{cpus: 1}}
seed: 0
"""


@dataclass(frozen=True)
class Audited:
    """A published model's folder, the folder of its audit, and some texts to label."""

    model: Path
    audit: Path
    texts: list[str]


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory, search_env: dict[str, str], dptune_cache_dir: Path) -> Audited:
    """40 training rows of each of three groups (fewer than the test caps, so the search's rows are the
    audit's), searched and published once, then audited with 200 canaries. Tests work on copies."""
    folder = tmp_path_factory.mktemp("cited")
    raw = load_20newsgroups()
    frame = pd.DataFrame({"text": raw.inputs, "label": [raw.class_names[c] for c in raw.labels]})
    official = raw.num_official_train

    def pick(part: pd.DataFrame, n: int) -> pd.DataFrame:
        return pd.concat([part[part["label"] == g].head(n) for g in GROUPS], ignore_index=True)

    pick(frame.iloc[:official], 40).to_csv(folder / "train.csv", index=False)
    test = pick(frame.iloc[official:], 15)
    test.to_csv(folder / "test.csv", index=False)
    space = folder / "space.yaml"
    space.write_text(SPACE.format(train=folder / "train.csv", test=folder / "test.csv"))
    completed = run_search(search_env, "--space", str(space), "--storage", str(folder / "results"), "--no-report")
    assert completed.returncode == 0, completed.stderr[-3000:]
    (model,) = (folder / "results" / "cited" / "models").iterdir()
    dptune.audit(space, out=folder / "audit", model=model, canaries=200, progress=False)
    return Audited(model=model, audit=folder / "audit", texts=test["text"].head(6).tolist())


def _copy(source: Path, target: Path) -> Path:
    return Path(shutil.copytree(source, target))


def _bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_the_card_cites_the_audits_numbers_and_their_privacy_together(audited: Audited, tmp_path: Path) -> None:
    model = _copy(audited.model, tmp_path / "model")
    before = json.loads((model / "model_card.json").read_text())
    rows = json.loads((audited.audit / "audit.json").read_text())["rows"]
    field = cite_audit(model, audited.audit)
    card = json.loads((model / "model_card.json").read_text())
    assert card == {**before, "audit": field}  # the privacy field, and every other, as published
    assert {row["threat_model"] for row in field["threat_models"]} == {"white-box", "black-box"}
    for cited, row in zip(field["threat_models"], rows, strict=True):
        names = ("threat_model", "epsilon_lower_bound", "confidence", "canaries", "guesses", "correct")
        assert {name: cited[name] for name in names} == {name: row[name] for name in names}
        assert cited["claimed_epsilon"] == before["privacy"]["epsilon"] == 8.0
        assert cited["claim_refuted"] is row["claim_refuted"] is False
        assert cited["canaries"] == 200 and 0 <= cited["epsilon_lower_bound"] < 8.0
    for name, value in field["configuration"].items():
        assert value == rows[0][name], name
    config, privacy = before["configuration"], before["privacy"]
    for key in ("noise_multiplier", "sample_rate", "steps"):  # the model's own mechanism, planned before the coins
        assert field["configuration"][key] == pytest.approx(config[key], rel=1e-12), key
    loaded = dptune.load_model(model)
    assert loaded.card["audit"] == field and loaded.privacy == privacy
    assert set(loaded.predict(audited.texts)) <= set(GROUPS)
    markdown = (model / "model_card.md").read_text()
    assert markdown.startswith((audited.model / "model_card.md").read_text().rstrip("\n"))
    assert markdown.count(AUDIT_HEADING) == 1 and f"{field['epsilon_with_audit']:.4g}" in markdown
    assert "second DP training" in field["release"] and "on the same private rows" in field["covers"]


def test_epsilon_with_audit_is_the_two_trainings_composed(audited: Audited, tmp_path: Path) -> None:
    """The field's ε is the PLD composition of the model's (σ, q, T) and the audit's at the card's δ, equal to
    dp_accounting's own PLD accountant's, below its RDP accountant's, above each training's ε alone."""
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    field = cite_audit(_copy(audited.model, tmp_path / "model"), audited.audit)
    card = json.loads((audited.model / "model_card.json").read_text())
    config, delta = card["configuration"], card["privacy"]["delta"]
    run = json.loads((audited.audit / "audit.json").read_text())["rows"][0]
    trainings = [
        (config["noise_multiplier"], config["sample_rate"], config["steps"]),
        (run["noise_multiplier"], run["sample_rate"], run["steps"]),
    ]
    assert field["epsilon_with_audit"] == compose([TrialMechanism(*t) for t in trainings], delta).epsilon
    assert field["accountant"] == "PLD" and field["delta"] == delta

    def independent(accountant: PLDAccountant | RdpAccountant) -> float:
        for sigma, rate, steps in trainings:
            accountant.compose(dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(sigma)), steps)
        return float(accountant.get_epsilon(delta))

    pld = independent(PLDAccountant(value_discretization_interval=1e-3))
    assert field["epsilon_with_audit"] == pytest.approx(pld, rel=1e-3)
    assert field["epsilon_with_audit"] <= independent(RdpAccountant())
    alone = max(epsilon_spent(*t, delta) for t in trainings)
    assert card["privacy"]["epsilon"] == 8.0 and alone <= 8.0 * (1 + 1e-6)
    assert field["epsilon_with_audit"] > 8.0 and field["epsilon_with_audit"] > alone * 1.2


def _edit_audit(key: str, value: Callable[[dict], object]) -> Callable[[Audited, Path], tuple[Path, Path]]:
    """A copy of the audit whose every row's ``key`` is ``value(row)``."""

    def prepare(audited: Audited, tmp_path: Path) -> tuple[Path, Path]:
        audit = _copy(audited.audit, tmp_path / "audit")
        summary = json.loads((audit / "audit.json").read_text())
        for row in summary["rows"]:
            row[key] = value(row)
        (audit / "audit.json").write_text(json.dumps(summary))
        return _copy(audited.model, tmp_path / "model"), audit

    return prepare


def _edit_card(section: str, key: str, value: object) -> Callable[[Audited, Path], tuple[Path, Path]]:
    """A copy of the model whose card's ``section.key`` is ``value``."""

    def prepare(audited: Audited, tmp_path: Path) -> tuple[Path, Path]:
        model = _copy(audited.model, tmp_path / "model")
        card = json.loads((model / "model_card.json").read_text())
        card[section][key] = value
        (model / "model_card.json").write_text(json.dumps(card))
        return model, audited.audit

    return prepare


def _edit_summary(key: str, value: object) -> Callable[[Audited, Path], tuple[Path, Path]]:
    """A copy of the audit whose ``audit.json`` has ``key`` = ``value``."""

    def prepare(audited: Audited, tmp_path: Path) -> tuple[Path, Path]:
        audit = _copy(audited.audit, tmp_path / "audit")
        summary = json.loads((audit / "audit.json").read_text())
        summary[key] = value
        (audit / "audit.json").write_text(json.dumps(summary))
        return _copy(audited.model, tmp_path / "model"), audit

    return prepare


def _without_audit_json(audited: Audited, tmp_path: Path) -> tuple[Path, Path]:
    audit = _copy(audited.audit, tmp_path / "audit")
    (audit / "audit.json").unlink()
    return _copy(audited.model, tmp_path / "model"), audit


def _cited_once(audited: Audited, tmp_path: Path) -> tuple[Path, Path]:
    model = _copy(audited.model, tmp_path / "model")
    cite_audit(model, audited.audit)
    return model, audited.audit


REFUSALS = {
    "clip bound": (_edit_audit("clip_bound", lambda row: row["clip_bound"] * 2), "its clip_bound is"),
    "learning rate": (
        _edit_audit("base_learning_rate", lambda row: row["base_learning_rate"] * (1 + 1e-6)),
        "its base_learning_rate is",
    ),
    "epochs": (_edit_audit("epochs", lambda row: row["epochs"] + 1), "its epochs is"),
    "claimed epsilon": (_edit_audit("epsilon", lambda row: 1.0), "its epsilon is"),
    "claimed delta": (_edit_audit("delta", lambda row: 1e-6), "its delta is"),
    "other data": (_edit_audit("sample_rate", lambda row: row["batch_size"] / 5000), "another mechanism"),
    "diverged": (_edit_audit("status", lambda row: "diverged"), "ended 'diverged'"),
    "seeded coins": (_edit_summary("coins", "seeded (a test's: not secret)"), "not fresh"),
    "other data digest": (_edit_summary("data_sha256", "0" * 64), "trained on other data"),
    "no audit.json": (_without_audit_json, "no readable audit"),
    "cited twice": (_cited_once, "already cites an audit"),
    "private release": (_edit_card("model", "trial_id", None), "end-to-end private search"),
    "no card": (_edit_card("privacy", "epsilon", None), "no readable dptune model card"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_citation_changes_no_file(audited: Audited, tmp_path: Path, case: str) -> None:
    prepare, message = REFUSALS[case]
    model, audit = prepare(audited, tmp_path)
    before = _bytes(model)
    with pytest.raises(AuditError, match=message) as refused:
        cite_audit(model, audit)
    assert "\n" not in str(refused.value)
    assert _bytes(model) == before
