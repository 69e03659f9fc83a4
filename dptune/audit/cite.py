"""A published model's card cites its audit: :func:`cite_audit` adds an ``audit`` field to
``model_card.json`` and a section to ``model_card.md``, each file rewritten whole or not at all.

Publishing an audit's numbers is a release: they are computed from a second DP training of the model's
configuration, by its own (σ, q, T), on the same private rows (plus the canaries): the released
gradients' canary coordinates and the final model's canary losses, with the canaries' secret coins,
which are independent of the data. So the citation states the privacy of the model and its published
audit together, ``epsilon_with_audit``: the two trainings' (σ, q, T) composed by
:func:`dptune.privacy.compose` (PLD, RDP where the PLD cannot represent it) at the card's δ.

A card is cited only where that composition is exact for what its ε states: a search's model, whose ε
is its own training's. An end-to-end private search's card states ε_total of the whole tuning (private
selection: a bound over a secret number of runs the card does not describe), which no composition of
(σ, q, T) can extend: such a card is refused, as is an audit of anything but the card's configuration,
claim and mechanism. The card's ``privacy`` field is never changed.

The ``audit`` field (JSON types): ``configuration`` (the audit's C, B, η₀, η, E, σ, q and T: numbers,
B, E and T integers), ``threat_models`` (one per threat model: ``threat_model`` (string),
``epsilon_lower_bound`` and its ``confidence`` (numbers), ``canaries`` (m), ``guesses`` and ``correct``
(integers), ``claimed_epsilon`` (number), ``claim_refuted`` (boolean)), ``epsilon_with_audit`` and
``delta`` (numbers), ``accountant`` (``PLD`` or ``RDP``), ``release`` and ``covers`` (strings).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dptune.audit.records import SUMMARY_JSON
from dptune.audit.run import AuditError
from dptune.paths import write_file_atomic
from dptune.privacy import TrialMechanism, compose
from dptune.records.weights import CARD_JSON, CARD_MD

#: The section of ``model_card.md`` that cites the audit (last in the file).
AUDIT_HEADING = "## Empirical privacy audit"
#: What an audit must share with the card it is cited on: its configuration's, and the claim's.
CONFIGURATION_KEYS = ("clip_bound", "batch_size", "base_learning_rate", "epochs")
CLAIM_KEYS = ("epsilon", "delta")
#: Relative tolerance of equal numbers between a card and an audit (each a JSON float of one value).
RELATIVE_TOLERANCE = 1e-9
#: The audit's training, as the field states it (audit.json's columns).
AUDIT_CONFIGURATION = (
    "clip_bound",
    "batch_size",
    "base_learning_rate",
    "learning_rate",
    "epochs",
    "noise_multiplier",
    "sample_rate",
    "steps",
)


def cite_audit(model: str | Path, audit: str | Path) -> dict[str, Any]:
    """Cite the audit in folder ``audit`` (``dptune.audit(..., model=model)``'s ``out``) on the card of
    the published model in folder ``model``: its ``model_card.json`` gains the ``audit`` field (module
    docstring), its ``model_card.md`` a last section saying the same; returns the field.

    Raises :class:`~dptune.audit.run.AuditError`, before writing anything, when the audit folder has no
    readable ``audit.json``, the model no readable card, the card already cites an audit, the card's ε
    is an end-to-end private search's (no exact composition), or the audit is of another configuration
    (C, B, η₀, E), claim (ε, δ) or mechanism (σ, q, T: other data), of several runs, or of a run that did not
    end ``ok``.
    """
    card, markdown = _read_card(Path(model))
    rows, summary = _read_audit(Path(audit))
    _check_provenance(card, summary)
    _check_citable(card, rows)
    field = audit_field(card, rows)
    write_file_atomic(str(model), CARD_MD, _cited_markdown(markdown, field).encode())
    write_file_atomic(
        str(model), CARD_JSON, json.dumps({**card, "audit": field}, indent=1, ensure_ascii=False).encode()
    )
    return field


def _read_card(folder: Path) -> tuple[dict[str, Any], str]:
    """The model's ``model_card.json`` (parsed) and ``model_card.md``."""
    try:
        card = json.loads((folder / CARD_JSON).read_text(encoding="utf-8"))
        markdown = (folder / CARD_MD).read_text(encoding="utf-8")
        if not all(isinstance(card[name], dict) for name in ("model", "configuration", "privacy")):
            raise TypeError("its model, configuration and privacy fields are not objects")
        mechanism = ("batch_size", "noise_multiplier", "sample_rate", "steps")
        numbers = [card["configuration"][name] for name in mechanism] + [card["privacy"][name] for name in CLAIM_KEYS]
        if not all(isinstance(value, int | float) and not isinstance(value, bool) for value in numbers):
            raise TypeError(f"its configuration's {', '.join(mechanism)} and its privacy's ε, δ are not all numbers")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise AuditError(f"{folder}: no readable dptune model card ({CARD_JSON} and {CARD_MD}): {error}") from error
    return card, markdown


def _read_audit(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of the audit's ``audit.json``, each value in its JSON type (one row per run and threat
    model), and the whole file."""
    path = folder / SUMMARY_JSON
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        rows = summary["rows"]
        typed = [
            {
                **{name: float(row[name]) for name in ("clip_bound", "base_learning_rate", "learning_rate")},
                **{
                    name: int(row[name]) for name in ("batch_size", "epochs", "steps", "canaries", "guesses", "correct")
                },
                **{name: float(row[name]) for name in ("epsilon", "delta", "noise_multiplier", "sample_rate")},
                **{name: float(row[name]) for name in ("confidence", "epsilon_lower_bound")},
                "threat_model": str(row["threat_model"]),
                "status": str(row["status"]),
                "claim_refuted": bool(row["claim_refuted"]),
            }
            for row in rows
        ]
        if not typed:
            raise ValueError("it has no rows")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise AuditError(
            f"{folder}: no readable audit ({path}: {error}); run dptune.audit(..., out=it) first"
        ) from error
    return typed, summary


def _check_provenance(card: dict[str, Any], summary: dict[str, Any]) -> None:
    """Refuse an audit whose coins were a test's seed (its noise is not secret: its numbers are no DP
    release) or whose data digest is not the card's (where the card states one)."""
    if summary.get("coins") != "fresh":
        raise AuditError(
            f"the audit's coins were {summary.get('coins')!r}, not fresh: a seeded audit's noise is not secret, "
            "so its numbers are not a DP release; audit the model again without a seed"
        )
    stated = card.get("data", {}).get("data_sha256")
    if stated is not None and summary.get("data_sha256") != stated:
        raise AuditError(
            f"the audit trained on other data (digest {summary.get('data_sha256')!r}, the card's {stated!r}): "
            "audit the model with the space it was searched with"
        )


def _same(left: Any, right: Any) -> bool:
    """Equal numbers (to ``RELATIVE_TOLERANCE``), or both missing."""
    if left is None or right is None:
        return left is None and right is None
    return math.isclose(float(left), float(right), rel_tol=RELATIVE_TOLERANCE)


def _check_citable(card: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Refuse (``AuditError``) a card the audit cannot be cited on, or an audit of something else."""
    if "audit" in card:
        raise AuditError(
            "the card already cites an audit: a card cites one (a second one's training is a third release "
            "of the private rows, which neither citation covers); keep it, or start from the card as the "
            "search published it if the cited one was never shared"
        )
    if card["model"].get("trial_id") is None or "noisy_val_accuracy" in card.get("accuracy", {}):
        raise AuditError(
            "the card is an end-to-end private search's: its ε is ε_total of the whole tuning (private "
            "selection over a secret number of runs), which the card does not describe as mechanisms, so "
            "no exact composition with the audit's training exists; citing an audit is built for a search's model"
        )
    threats = [row["threat_model"] for row in rows]
    if len(set(threats)) != len(threats):
        raise AuditError("the audit trained several configurations: cite an audit of this model alone (model=)")
    config, privacy = card["configuration"], card["privacy"]
    for row in rows:
        for key, ours in [
            *((k, config.get(k)) for k in CONFIGURATION_KEYS),
            *((k, privacy.get(k)) for k in CLAIM_KEYS),
        ]:
            if not _same(ours, row[key]):
                raise AuditError(f"the audit is of another model: its {key} is {row[key]!r}, the card's {ours!r}")
        if row["status"] != "ok":
            raise AuditError(f"the audit's training ended {row['status']!r}, not 'ok': audit the model again")
    _check_mechanism(config, rows[0])


def _check_mechanism(config: dict[str, Any], row: dict[str, Any]) -> None:
    """Refuse an audit that ran another mechanism than the model's: an audit trains by the model's public
    schedule on its N rows (q = B/N, T) with its σ, so a different (σ, q, T) means other data or another
    plan (an audit of a capped search must be given the same caps)."""
    for key in ("noise_multiplier", "sample_rate", "steps"):
        if not _same(config[key], row[key]):
            raise AuditError(
                f"the audit ran another mechanism than the model's: its {key} is {row[key]!r}, the card's "
                f"{config[key]!r} (other data, or caps the search did not have)"
            )


def audit_field(card: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``audit`` field (module docstring) of a card and the rows of an audit checked to be of it."""
    config, delta = card["configuration"], float(card["privacy"]["delta"])
    run = rows[0]
    model = TrialMechanism(float(config["noise_multiplier"]), float(config["sample_rate"]), int(config["steps"]))
    audited = TrialMechanism(run["noise_multiplier"], run["sample_rate"], run["steps"])
    composed = compose([model, audited], delta)
    threats = ("threat_model", "epsilon_lower_bound", "confidence", "canaries", "guesses", "correct")
    return {
        "configuration": {name: run[name] for name in AUDIT_CONFIGURATION},
        "threat_models": [
            {
                **{name: row[name] for name in threats},
                "claimed_epsilon": row["epsilon"],
                "claim_refuted": row["claim_refuted"],
            }
            for row in rows
        ],
        "epsilon_with_audit": composed.epsilon,
        "delta": delta,
        "accountant": composed.accountant,
        "release": (
            "The audit's numbers are a release: they are computed from a second DP training of this configuration "
            f"on the same private rows plus {run['canaries']} synthetic canaries at the same claimed (ε, δ) (the "
            "released gradients' canary coordinates and the final model's losses on the canaries, with the "
            "canaries' secret coins); the audit's model is never published."
        ),
        "covers": (
            f"this model's training (σ = {model.noise_multiplier:.4g}, q = {model.sample_rate:.4g}, T = "
            f"{model.steps}) and the audit's training (σ = {audited.noise_multiplier:.4g}, q = "
            f"{audited.sample_rate:.4g}, T = {audited.steps}) on the same private rows, composed by the "
            f"{composed.accountant} accountant at δ = {delta:.3g}. Besides the audit it covers nothing the card's ε "
            "does not: what the card's privacy.covers says that ε leaves out stays out."
        ),
    }


def _cited_markdown(markdown: str, field: dict[str, Any]) -> str:
    """``model_card.md`` with the audit's section last (replacing one a failed citation left there)."""
    config = field["configuration"]
    lines = [markdown.split(f"\n{AUDIT_HEADING}\n")[0].rstrip("\n"), "", AUDIT_HEADING, ""]
    lines += [
        f"- {row['threat_model']}: empirical ε lower bound {row['epsilon_lower_bound']:.3f} "
        f"({row['confidence']:.0%} confidence) vs the claimed ε = {row['claimed_epsilon']:g}: "
        f"{'REFUTED: the mechanism is broken' if row['claim_refuted'] else 'not refuted'} "
        f"(m = {row['canaries']} canaries, {row['correct']} of {row['guesses']} guesses right)"
        for row in field["threat_models"]
    ]
    lines += [
        "",
        f"Audited: C = {config['clip_bound']:.4g}, B = {config['batch_size']}, "
        f"η₀ = {config['base_learning_rate']:.3g}, E = {config['epochs']}.",
        "",
        field["release"],
        "",
        f"This model and its published audit together: (ε, δ) = ({field['epsilon_with_audit']:.4g}, "
        f"{field['delta']:.3g}), covering {field['covers']} The privacy section above states the model alone.",
        "",
    ]
    return "\n".join(lines)
