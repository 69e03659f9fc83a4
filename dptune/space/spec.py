"""A search space as typed objects: the validated spec, its (ε, E) cells, and the loaded file.

A spec names the task, the privacy budgets, the epoch budgets, the ranges of (C, B, η₀), the
learning-rate coupling, the min-step rule, the sampler, the scheduler, resources and the seed.
Validation happens on load, before Ray starts: a wrong key, type or range is reported with the
file, the key and what is allowed (``SpaceError``). See ``search_spaces/default.yaml`` for a
commented example of every key.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dptune.contract import (
    DELIMITED_FORMATS,
    NO_BACKBONE,
    TIMM_PREFIX,
    ClippingRule,
    DatasetFile,
    DatasetFormat,
    EngineName,
    OptimizerName,
    PeftName,
    RunnerName,
    SamplerName,
    hf_name,
    timm_name,
)
from dptune.errors import DptuneError
from dptune.paths import ALLOWED_SCHEMES, MAX_NAME_CHARS, check_name
from dptune.plan import DEFAULT_MIN_STEPS
from dptune.space.base import Strict as _Strict
from dptune.space.privacy import PrivacySpec
from dptune.space.tracking import TrackingSpec

#: Most trials one cell may run (``trials_per_cell``, or the points of a grid): a search is
#: meant to finish, and a count beyond this is a typo far more often than a plan.
MAX_TRIALS_PER_CELL = 10_000
#: The section of a spec left out of its recorded text and its hash (``LoadedSpace``): where a search
#: is logged is not what it is.
UNRECORDED = "tracking"
#: Largest ``seed``: Optuna's samplers take 32-bit seeds (NumPy ``RandomState``) and each cell
#: adds an offset below 2**24 to the space's seed.
MAX_SEED = 2**32 - 2**24 - 1
#: The characters ``task.dataset.sep`` may not be.
SEP_REFUSED = frozenset("\"'\n\r")


class SpaceError(DptuneError, ValueError):
    """A search-space file that cannot be used; the message names the file, the key and the rule."""


PositiveFloat = Annotated[float, Field(gt=0)]


class DatasetFileSpec(_Strict):
    """A data owner's own dataset (``task.dataset`` as a mapping; :class:`dptune.contract.DatasetFile`).

    ``path`` and ``test_path``: local files or folders (``file://`` accepted; a relative path is taken
    from the folder of the space file that writes it, one given by ``--set`` or a Python mapping from
    the working folder: :data:`dptune.space.files.PATH_KEYS`) or object-store URIs (``s3://``,
    ``gs://``, ...: what ``--storage`` accepts); ``format``: by suffix, or a folder by its content,
    under ``auto``. ``input_column`` and ``label_column`` name a table's columns; an image folder has
    none. ``sep``: a CSV or TSV file's delimiter, one character (None: ``,`` for csv, a tab for tsv);
    left out of the dump when None, so the hash of a space without it is what it was before the key."""

    path: str = Field(min_length=1)
    format: DatasetFormat = "auto"
    input_column: str | None = Field(
        None, min_length=1, description="texts (strings) or embeddings (lists of numbers); not for an image folder"
    )
    label_column: str | None = Field(None, min_length=1, description="ints or strings; not for an image folder")
    test_path: str | None = None
    test_public: bool = Field(False, description="the test file may be published (else it is private data)")
    sep: str | None = Field(
        None, exclude_if=lambda value: value is None, description="a csv or tsv file's delimiter, one character"
    )

    @field_validator("path", "test_path")
    @classmethod
    def _location(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if "://" in value.removeprefix("file://"):
            scheme = value.split("://", 1)[0].lower()
            if scheme not in ALLOWED_SCHEMES:
                raise ValueError(
                    f"{value!r}: unknown URI scheme {scheme!r} (a local path, or one of "
                    f"{', '.join(s + '://' for s in ALLOWED_SCHEMES)})"
                )
            return value
        return _local_path(value)

    @model_validator(mode="after")
    def _columns_of_a_table(self) -> Self:
        if self.format == "imagefolder" and (self.input_column or self.label_column):
            raise ValueError("an image folder has no columns: its class folders are the labels (drop the columns)")
        if self.format not in ("auto", "imagefolder") and not (self.input_column and self.label_column):
            raise ValueError(f"a {self.format} dataset needs input_column and label_column")
        return self

    @field_validator("sep")
    @classmethod
    def _one_character(cls, value: str | None) -> str | None:
        if value is not None and (len(value) != 1 or value in SEP_REFUSED):
            raise ValueError(
                "expected one character that separates the columns of a csv or tsv file, e.g. ';', '|' or "
                '"\\t" (a tab), not a quote, a newline or a carriage return'
            )
        return value

    @model_validator(mode="after")
    def _sep_of_a_table_file(self) -> Self:
        """A named format that is not delimited refuses ``sep`` here; under ``auto`` the data check does."""
        if self.sep is not None and self.format not in ("auto", *DELIMITED_FORMATS):
            raise ValueError(f"sep applies to csv and tsv files; this dataset is {self.format}: drop sep")
        return self

    @model_validator(mode="after")
    def _public_needs_file(self) -> Self:
        if self.test_public and self.test_path is None:
            raise ValueError("test_public: true needs test_path (a carved test split is private rows)")
        return self

    def dataset_file(self) -> DatasetFile:
        """The contract's form of this file."""
        return DatasetFile(**self.model_dump())


class HfBackboneSpec(_Strict):
    """A team's own transformers encoder (``task.backbone: {hf: DIR}``): a ``save_pretrained`` folder."""

    hf: str = Field(min_length=1, description="the save_pretrained folder (config, weights, tokenizer)")
    pooling: Literal["mean", "cls"] = Field("mean", description="attention-mask mean, or the first token")


class TimmBackboneSpec(_Strict):
    """A timm architecture with a team's own weights (``task.backbone: {timm: NAME, weights: FILE}``)."""

    timm: str = Field(min_length=1, description="a timm architecture (timm.list_models())")
    weights: str = Field(min_length=1, description="its state dict: a .safetensors, .pth or .bin file")


def _local_path(value: str) -> str:
    """``value`` (a path, ``~`` or ``file://`` allowed) as an absolute path, taken from the working folder
    (a relative path written in a space file arrives here already taken from that file's folder)."""
    return str(Path(value.removeprefix("file://")).expanduser().resolve())


class TaskSpec(_Strict):
    """What is fine-tuned on what: names resolve in the ``dptune.data`` and ``dptune.models``
    registries; ``dataset`` may instead be a data owner's own file (:class:`DatasetFileSpec`), and
    ``backbone`` then ``none`` when its rows are embeddings."""

    dataset: str | DatasetFileSpec
    backbone: str = Field(
        description="a registry name, none, {hf: DIR, pooling: mean|cls} or {timm: NAME, weights: FILE}"
    )
    peft: PeftName
    fraction: float = Field(1.0, gt=0, le=1, description="share of the training set kept (difficulty knob)")
    examples_per_class: int | None = Field(None, ge=1)
    classes: tuple[int, ...] | None = Field(None, min_length=2)
    max_tokens: int | None = Field(None, ge=8, le=512)
    validation_fraction: float = Field(0.1, gt=0, lt=1)

    @property
    def dataset_name(self) -> str:
        """The registry name, or ``file:<file name>`` for a data owner's file (records, console, reports)."""
        if isinstance(self.dataset, DatasetFileSpec):
            return self.dataset.dataset_file().display_name
        return self.dataset

    @property
    def dataset_file(self) -> DatasetFile | None:
        """The data owner's file, or None for a registry dataset."""
        return self.dataset.dataset_file() if isinstance(self.dataset, DatasetFileSpec) else None

    @field_validator("backbone", mode="before")
    @classmethod
    def _own_backbone(cls, value: Any) -> Any:
        """A mapping names an own backbone: it becomes its name (``hf:<folder>``, ``timm:<name>:<file>``,
        :mod:`dptune.models.own`), checked with the data before any compute."""
        if not isinstance(value, dict):
            return value
        if "hf" in value:
            spec = HfBackboneSpec.model_validate(value)
            return hf_name(_local_path(spec.hf), spec.pooling)
        if "timm" in value:
            timm_spec = TimmBackboneSpec.model_validate(value)
            return timm_name(timm_spec.timm, _local_path(timm_spec.weights))
        raise ValueError(
            f"a backbone mapping has the key hf ({{hf: DIR, pooling: mean|cls}}) or timm "
            f"({{timm: NAME, weights: FILE}}), not {sorted(value)}"
        )

    @field_validator("max_tokens")
    @classmethod
    def _tokens_of_texts(cls, value: int | None, info: ValidationInfo) -> int | None:
        backbone = info.data.get("backbone")  # validated before max_tokens, when valid
        if value is not None and isinstance(backbone, str) and reads_no_text(backbone):
            raise ValueError(
                f"applies to a text backbone; backbone {backbone} reads no text: set task.max_tokens: null"
            )
        return value


#: The mapping forms of ``task.backbone`` (its validator turns each into a name).
BACKBONE_FORMS: tuple[type[_Strict], ...] = (HfBackboneSpec, TimmBackboneSpec)


def reads_no_text(backbone: str) -> bool:
    """Whether ``backbone``, told from its name alone (no registry loaded), encodes no text: ``none``
    (the rows are embeddings) and an own timm backbone (images). A registry image backbone is told
    with the data (:func:`dptune.data.workload.check_spec`)."""
    return backbone == NO_BACKBONE or backbone.startswith(TIMM_PREFIX)


class RangeSpec(_Strict):
    """A continuous range sampled on a log (default) or linear scale, or explicit ``values``."""

    low: PositiveFloat | None = None
    high: PositiveFloat | None = None
    log: bool = True
    values: list[PositiveFloat] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _shape(self) -> Self:
        if self.values is not None:
            if self.low is not None or self.high is not None:
                raise ValueError("give either values or low/high, not both")
        elif self.low is None or self.high is None:
            raise ValueError("give low and high (a range) or values (a list)")
        elif self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        return self

    def grid(self) -> list[float] | None:
        return list(self.values) if self.values is not None else None


class PowersOfTwo(_Strict):
    min: int = Field(ge=1)
    max: int = Field(ge=1)
    full_batch: bool = Field(False, description="also try B = N (one step per epoch)")

    @model_validator(mode="after")
    def _powers(self) -> Self:
        for name in ("min", "max"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name} ({value}) must be a power of two")
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class BatchSizeSpec(_Strict):
    """Expected batch sizes B (Poisson sampling): an explicit list or powers of two in a range."""

    values: list[Annotated[int, Field(ge=1)]] | None = Field(None, min_length=1)
    powers_of_two: PowersOfTwo | None = None

    @model_validator(mode="after")
    def _one(self) -> Self:
        if (self.values is None) == (self.powers_of_two is None):
            raise ValueError("give exactly one of values or powers_of_two")
        return self

    def candidates(self, num_examples: int) -> list[int]:
        """The B values for a training set of ``num_examples``; those above N are dropped (see ``oversized``)."""
        return sorted(b for b in self._requested(num_examples) if b <= num_examples)

    def oversized(self, num_examples: int) -> list[int]:
        """The requested B values above ``num_examples`` (N), which a search drops."""
        return sorted(b for b in self._requested(num_examples) if b > num_examples)

    def _requested(self, num_examples: int) -> set[int]:
        if self.values is not None:
            return set(self.values)
        spec = self.powers_of_two
        assert spec is not None
        values = {2**k for k in range(int(math.log2(spec.min)), int(math.log2(spec.max)) + 1)}
        return values | {num_examples} if spec.full_batch else values


class CouplingSpec(_Strict):
    """Learning-rate coupling: ``sqrt`` trains with η = η₀·√(B/B_ref); ``none`` with η = η₀."""

    rule: Literal["sqrt", "none"] = "sqrt"
    reference_batch_size: int = Field(256, ge=1)


class SamplerSpec(_Strict):
    """Optuna sampler per cell: ``tpe``, ``random`` or ``grid`` (the paper's exhaustive grids)."""

    name: SamplerName = "tpe"
    trials_per_cell: int | None = Field(
        None, ge=1, le=MAX_TRIALS_PER_CELL, description="required for tpe/random; grid runs every point"
    )
    random_trial_count: bool = Field(
        False,
        description="draw each cell's number of trials secretly from a geometric distribution with mean "
        "trials_per_cell (sampler random only): one assumption of Papernot & Steinke's private-selection bound; "
        "the bound as a whole holds only with privacy.private_selection",
    )

    @model_validator(mode="after")
    def _random_count(self) -> Self:
        if self.random_trial_count and self.name != "random":
            raise ValueError(
                "random_trial_count needs sampler 'random' (the selection bound assumes "
                "hyperparameters drawn independently of earlier trials)"
            )
        return self


class SchedulerSpec(_Strict):
    """Optional early stopping over epochs (ASHA, Ray Tune's AsyncHyperBandScheduler)."""

    name: Literal["asha"] = "asha"
    grace_period: int = Field(1, ge=1, description="epochs before a trial may be stopped")
    reduction_factor: float = Field(3.0, gt=1)


class ResourcesSpec(_Strict):
    """Resources per trial. A fractional ``gpu`` (e.g. 0.25) lets small trials share a GPU."""

    cpus: float = Field(1.0, gt=0)
    gpu: float = Field(0.0, ge=0)
    max_concurrent_trials: int | None = Field(None, ge=1)
    max_physical_batch_size: int = Field(256, ge=1)
    configurations_per_trial: Literal["auto"] | Annotated[int, Field(ge=1, le=MAX_TRIALS_PER_CELL)] = Field(
        "auto",
        description="configurations one Ray Tune trial carries (× replicates): auto = the cell's budget "
        "spread over the trial slots when the fused runner trains them, else 1",
    )
    max_retries: int = Field(
        2,
        ge=0,
        le=100,
        description="times Ray Tune runs a unit again whose trial process was lost (killed, out of "
        "memory, node gone); each lost attempt stays charged in the privacy ledger. Runs still unfinished after "
        "that make the command exit non-zero, and --resume runs them again",
    )

    @field_validator("gpu")
    @classmethod
    def _gpu_fraction(cls, value: float) -> float:
        if value > 1 and value != int(value):
            raise ValueError("gpu above 1 must be a whole number of GPUs")
        return value


class TrainingSpec(_Strict):
    """The DP optimizer: DP-Adam or DP-SGD, and the clipping rule (see ``dptune.dp.clipping``)."""

    optimizer: OptimizerName = "adam"
    clipping: ClippingRule = "normalized"
    engine: EngineName = Field(
        "auto",
        description="per-example gradients: dptune's FiLM engine for film/head where it supports "
        "every trainable module (auto), or Opacus hooks",
    )
    runner: RunnerName = Field(
        "auto",
        description="how runs are trained: fused (many configurations as one vectorised computation: a "
        "head on cached features) where it applies, else one trial per run (trial)",
    )
    compare_auto_s: bool = Field(False, description="also run AUTO-S trials per cell (paper Fig. 5)")
    diagnostics: bool = True
    diagnostic_examples: int = Field(256, ge=8, le=512)


class RacingSpec(_Strict):
    """Adaptive replication (racing, as in F-Race and irace): after a cell's first pass, rounds add ``step``
    replicates to each configuration within noise of the best, until ``dptune.search.scheduling.racing``
    says the optimum is pinned down or ``budget`` extra runs of the cell are spent."""

    step: int = Field(2, ge=1, le=20, description="replicates a round adds to each configuration it races")
    max_replicates: int = Field(16, ge=2, le=100, description="most replicates of one configuration")
    budget: int = Field(..., ge=1, le=100_000, description="most runs the rounds add per cell, over its first pass")
    patience: int = Field(2, ge=1, le=20, description="rounds in a row that change neither the set nor C, B: the end")


class SearchSpace(_Strict):
    """A whole search-space file."""

    name: str = Field(max_length=MAX_NAME_CHARS)
    description: str = ""
    task: TaskSpec
    privacy: PrivacySpec
    epochs: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)
    clip_bound: RangeSpec
    batch_size: BatchSizeSpec
    base_learning_rate: RangeSpec
    coupling: CouplingSpec = CouplingSpec()
    min_steps: int = Field(
        DEFAULT_MIN_STEPS, ge=1, description="T_min: configurations with E·N/B steps below it never run"
    )
    training: TrainingSpec = TrainingSpec()
    sampler: SamplerSpec = SamplerSpec()
    scheduler: SchedulerSpec | None = None
    resources: ResourcesSpec = ResourcesSpec()
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="public: the data split, subset caps and the sampler's "
        "proposals; never the trials' noise or batches (unless reproducible)",
    )
    replicates: int = Field(
        1,
        ge=1,
        le=100,
        description="runs per configuration, each with fresh coins; "
        "samplers and the analysis rank configurations by their mean validation accuracy",
    )
    racing: RacingSpec | None = Field(
        None,
        exclude_if=lambda value: value is None,  # a space without it keeps its hash (and search id) from before
        description="add replicates, in rounds, to the configurations within noise of each cell's best until "
        "its optimum is pinned down or a run budget is spent (null: every configuration runs `replicates` times)",
    )
    reproducible: bool = Field(
        False,
        description="derive every trial's noise, Poisson batches and initialisation from seed and the "
        "trial's id (research, tests). Off: fresh OS entropy per trial, never stored. On: the DP guarantees "
        "assume secret coins and do not hold for released results",
    )
    tracking: TrackingSpec = Field(
        TrackingSpec(), description="where the finished search is also logged; not part of the recorded space"
    )

    @field_validator("name")
    @classmethod
    def _one_folder(cls, value: str) -> str:
        return check_name(value, "the name")

    @model_validator(mode="after")
    def _sampler_fits(self) -> Self:
        if self.sampler.name == "grid":
            for key in ("clip_bound", "base_learning_rate"):
                if getattr(self, key).values is None:
                    raise ValueError(f"sampler 'grid' needs {key}.values (a list), not a range")
            if self.batch_size.values is None and self.batch_size.powers_of_two is None:
                raise ValueError("sampler 'grid' needs batch_size values")
            points = (
                len(self.clip_bound.values or ())
                * len(self.base_learning_rate.values or ())
                * len(self.batch_size.candidates(2**62))
            )
            if points > MAX_TRIALS_PER_CELL:
                raise ValueError(
                    f"the grid has {points} points per cell, more than the {MAX_TRIALS_PER_CELL} "
                    "trials a cell may run; use fewer values or sampler 'tpe'/'random'"
                )
        elif self.sampler.trials_per_cell is None:
            raise ValueError(f"sampler '{self.sampler.name}' needs sampler.trials_per_cell")
        if len(set(self.epochs)) != len(self.epochs):
            raise ValueError("epochs must be distinct")
        if self.racing is not None and self.racing.max_replicates <= self.replicates:
            raise ValueError(
                f"racing.max_replicates ({self.racing.max_replicates}) must exceed replicates ({self.replicates}), "
                "the first pass's runs per configuration"
            )
        if self.privacy.private_selection is not None:
            self._check_private_selection()
        if self.scheduler is not None:
            self._check_scheduler()
        if self.privacy.person_unit is not None and self.training.diagnostics:
            raise ValueError(
                "training.diagnostics must be false with privacy.unit a person: the diagnostics measure rows' "
                "gradient norms (and suggest C from them), while C clips each person's mean gradient"
            )
        return self

    def _check_scheduler(self) -> None:
        """ASHA stops a Ray Tune trial as a whole, on its per-epoch reports: one run per trial."""
        problems = [
            f"{key} {why}"
            for key, bad, why in (
                ("replicates", self.replicates > 1, "must be 1"),
                ("racing", self.racing is not None, "must be absent"),
                (
                    "resources.configurations_per_trial",
                    self.resources.configurations_per_trial not in ("auto", 1),
                    "must be 1 or auto",
                ),
                (
                    "training.runner",
                    self.training.runner == "fused",
                    "must be auto or trial (fused runs report no epochs)",
                ),
            )
            if bad
        ]
        if problems:
            raise ValueError(
                "scheduler (ASHA stops a whole Ray Tune trial on its per-epoch reports, so each trial "
                "carries one run): " + "; ".join(problems)
            )

    def _check_private_selection(self) -> None:
        """Refuse what voids the private-selection bound (Papernot & Steinke 2022), before any compute."""
        voids = {
            "sampler.name": (
                self.sampler.name != "random",
                f"'{self.sampler.name}' must be 'random': the bound "
                "assumes hyperparameters drawn independently of the data and of earlier trials (TPE "
                "adapts to private scores, a grid fixes the trial count)",
            ),
            "scheduler": (
                self.scheduler is not None,
                "must be absent: ASHA stops trials on other trials' private scores",
            ),
            "training.diagnostics": (
                self.training.diagnostics,
                "must be false: diagnostics release exact gradient norms and labels of training examples",
            ),
            "training.compare_auto_s": (self.training.compare_auto_s, "must be false: one selection per search"),
            "epochs": (len(self.epochs) != 1, "must hold one epoch budget: one selection per search"),
            "sampler.trials_per_cell": (
                (self.sampler.trials_per_cell or 0) < 2,
                "must be ≥ 2: the mean of the random trial count",
            ),
            "replicates": (self.replicates != 1, "must be 1: the bound counts each run as one candidate"),
            "racing": (
                self.racing is not None,
                "must be absent: racing reruns configurations chosen on exact validation accuracies",
            ),
            "reproducible": (
                self.reproducible,
                "must be false: reproducible coins (from the space's public seed) make K, the proposals and "
                "every run's noise computable by anyone who reads the space, so nothing would be private",
            ),
        }
        subsample = self.privacy.private_selection is not None and self.privacy.private_selection.tuning_subsample
        voids |= {
            "task.peft": (
                bool(subsample) and self.task.peft != "head",
                f"'{self.task.peft}' must be 'head' with tuning_subsample: only the fused runner takes a tuning "
                "run's q and T from public numbers (never from the subsample's size), as the analysis assumes",
            ),
            "training.runner": (
                bool(subsample) and self.training.runner == "trial",
                "'trial' cannot run tuning_subsample: only the fused runner takes a tuning run's q and T from "
                "public numbers (use auto or fused)",
            ),
        }
        problems = [f"{key} {why}" for key, (bad, why) in voids.items() if bad]
        if problems:
            raise ValueError("privacy.private_selection: " + "; ".join(problems))

    def cells(self) -> list[Cell]:
        """The (ε, E) cells with a per-trial ε, each its own search, ordered by ε then E (none with
        ``private_selection``: its one cell's ε is found by the planner)."""
        return [Cell(epsilon=e, epochs=n) for e in sorted(self.privacy.epsilons or []) for n in sorted(self.epochs)]


@dataclass(frozen=True)
class Cell:
    """One (ε, E) cell of a search: its own sampler, budget and best configuration."""

    epsilon: float
    epochs: int

    @property
    def cell_id(self) -> str:
        return f"eps={self.epsilon:g}|epochs={self.epochs}"


@dataclass(frozen=True)
class LoadedSpace:
    """A validated space with the text it came from (recorded with the results, hashed into its id).

    ``notes``: what loading changed that the user should hear (each one line), e.g. an inherited key
    that does not apply; printed with the search's other warnings."""

    space: SearchSpace
    path: Path
    text: str
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def spec_hash(self) -> str:
        """16 hex digits of SHA-256 of the validated space, not of its text: every key with its value as
        the model holds it (defaults filled in, ``1``, ``1.0`` and ``1.0e-05``/``1e-5`` as the number
        they are, paths absolute: :data:`dptune.space.files.PATH_KEYS`), keys sorted, without
        ``UNRECORDED``. The same space in another layout (block or flow lists, key order, comments,
        number spelling) has the same hash; a changed value has another."""
        canonical = self.space.model_dump(mode="json", exclude={UNRECORDED})
        text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]
