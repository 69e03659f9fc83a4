"""The trial's contract: the plain-data types every part of dptune exchanges, and the names they take.

A :class:`TrialConfig` (a :class:`WorkloadSpec` and the trial's privacy, hyperparameters and
execution) goes in, :class:`EpochMetrics` are reported per epoch, a :class:`TrialResult`
(with :class:`Diagnostics` per diagnosed epoch) comes out. :mod:`dptune.runners.trial` runs one, the
search sends them through Ray Tune, :mod:`dptune.records` writes them to Parquet.

The name registries live here as ``Literal`` types with their tuples (``PEFT_NAMES``,
``OPTIMIZER_NAMES``, ``ENGINE_NAMES``, ``RUNNER_NAMES``, ``CLIPPING_RULES``), or as tuples
(``DATASET_NAMES``, ``BACKBONE_NAMES``): the one list of each that the search space
(:mod:`dptune.space`, :mod:`dptune.search.preflight`), the trial checks and the implementations read.
Each implementation table (``dptune.models.PEFTS``, ``dptune.dp.optimizers.OPTIMIZERS``,
``dptune.data.DATASETS``, ``dptune.models.backbones.BACKBONES``) is keyed by one of them and checked
against it with :func:`check_registry` when it is built; adding a name means adding it here and its
implementation there.

This module imports nothing from dptune, torch or Ray, so any module (and the torch-free
readers: space, records, analysis) can import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, TypeVar, get_args

#: Parameter-efficient fine-tuning methods (implementations: ``dptune.models.PEFTS``).
PeftName = Literal["head", "film", "lora", "full"]
PEFT_NAMES: tuple[str, ...] = get_args(PeftName)
#: Base optimizers a DP gradient steps (implementations: ``dptune.dp.optimizers.OPTIMIZERS``).
OptimizerName = Literal["adam", "sgd"]
OPTIMIZER_NAMES: tuple[str, ...] = get_args(OptimizerName)
#: Per-example gradient engines (``auto`` picks one; see ``dptune.dp.engine_registry.select_engine``).
EngineName = Literal["auto", "opacus", "film"]
ENGINE_NAMES: tuple[str, ...] = get_args(EngineName)
#: How a search trains its runs (``dptune.search.runs.execution``): ``fused`` (many configurations as one
#: vectorised computation, ``dptune.runners.fused``) where it applies under ``auto``, else ``trial``.
RunnerName = Literal["auto", "fused", "trial"]
RUNNER_NAMES: tuple[str, ...] = get_args(RunnerName)
#: A cell's Optuna sampler (``dptune.search.planning.sampler``).
SamplerName = Literal["tpe", "random", "grid"]
SAMPLER_NAMES: tuple[str, ...] = get_args(SamplerName)
#: Clipping rules (the rule table: ``dptune.dp.clipping``).
ClippingRule = Literal["standard", "normalized", "auto_s"]
CLIPPING_RULES: tuple[str, ...] = get_args(ClippingRule)

TrialStatus = Literal["ok", "diverged", "error", "pruned_min_steps", "stopped_early"]

Table = TypeVar("Table", bound=Mapping[str, object])


def check_registry(kind: str, names: tuple[str, ...], table: Table) -> Table:
    """Return ``table`` if its keys are exactly ``names`` (in order), else raise ``TypeError``.

    Run where an implementation table is built, so a name without an implementation (or the
    reverse) fails at import rather than at a trial.
    """
    if tuple(table) != names:
        raise TypeError(f"the {kind} implementations {tuple(table)} do not match the names {names} of dptune.contract")
    return table


#: Registry datasets, ``task.dataset`` by name (implementations: ``dptune.data.sources.DATASETS``).
DATASET_NAMES: tuple[str, ...] = ("20newsgroups", "mnist5k", "cifar100", "sun397", "cassava")
#: Registry backbones, ``task.backbone`` by name (implementations: ``dptune.models.backbones.BACKBONES``).
BACKBONE_NAMES: tuple[str, ...] = (
    "vit_base_patch16_224.augreg_in21k",
    "vit_tiny_patch16_224.augreg_in21k",
    "efficientnet_lite0",
    "wrn16_4",
    "minilm",
    "distilbert",
)
#: ``task.backbone`` of a dataset that holds its rows' own embeddings: the head trains on them as they are.
NO_BACKBONE = "none"
#: Prefixes of the name of a team's own backbone (``task.backbone`` as a mapping, :mod:`dptune.models.own`).
HF_PREFIX, HF_CLS_PREFIX, TIMM_PREFIX = "hf:", "hf-cls:", "timm:"


def is_own_backbone(name: str) -> bool:
    """Whether the backbone ``name`` names a team's own backbone rather than a registry entry."""
    return name.startswith((HF_PREFIX, HF_CLS_PREFIX, TIMM_PREFIX))


def hf_name(folder: str, pooling: str = "mean") -> str:
    """The backbone name of the ``save_pretrained`` folder ``folder`` pooled by ``pooling`` (``mean``, ``cls``)."""
    return (HF_CLS_PREFIX if pooling == "cls" else HF_PREFIX) + folder


def timm_name(architecture: str, weights: str) -> str:
    """The backbone name of the timm ``architecture`` with the weights file ``weights``."""
    return f"{TIMM_PREFIX}{architecture}:{weights}"


#: Formats of a data owner's own dataset (``DatasetFile.format``; ``auto``: a file by its suffix, a
#: folder ``hf_disk`` when it holds a ``save_to_disk`` dataset, else ``imagefolder``).
DatasetFormat = Literal["auto", "csv", "tsv", "jsonl", "parquet", "imagefolder", "hf_disk"]
DATASET_FORMATS: tuple[str, ...] = get_args(DatasetFormat)
#: The formats whose column delimiter ``DatasetFile.sep`` sets.
DELIMITED_FORMATS = ("csv", "tsv")


@dataclass(frozen=True)
class DatasetFile:
    """A data owner's own dataset: a table of rows, one row = one record (the DP adjacency unit).

    ``path`` (and ``test_path``): an absolute local path or an object-store URI (a file, or a folder
    for ``imagefolder`` and ``hf_disk``). ``input_column`` holds a text (a string) or an embedding (a
    list of floats, the rows' own features: backbone ``none``); ``label_column`` an int or a string
    (string labels become class ids in sorted order, their names kept; a ``save_to_disk`` dataset's
    ``ClassLabel`` keeps its names). An image folder (``<path>/<class>/<image>``) has no columns:
    an image is a row, its folder's name its label. Without
    ``test_path`` a test split is carved from the rows. ``test_public``: the test file is outside the
    private data and may be published (otherwise its accuracy is a release about private rows, and a
    private search withholds it). ``sep``: a csv or tsv file's delimiter (None: ``,`` for csv, a tab
    for tsv). Read and checked by :mod:`dptune.data.files`.
    """

    path: str
    input_column: str | None = None
    label_column: str | None = None
    format: DatasetFormat = "auto"
    test_path: str | None = None
    test_public: bool = False
    sep: str | None = None

    @property
    def display_name(self) -> str:
        """The dataset's name in records, reports and the console: ``file:<file or folder name>``."""
        path = self.path.split("?", 1)[0] if "://" in self.path else self.path
        return "file:" + path.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


#: Rows of a sampled person that form their gradient at a step, unless ``privacy.unit.max_rows`` says
#: otherwise (None: all of them). Measured (bench/RESULTS.md, issue 52): 16 trains as well as all rows
#: at ε = 2 and 8 (within the seeds' intervals) and 1 worse; 16 bounds a step's cost when a few people
#: have thousands of rows.
DEFAULT_MAX_ROWS_PER_PERSON: int | None = 16


@dataclass(frozen=True)
class PersonUnit:
    """The privacy unit is a person (user-level DP; McMahan et al. 2018, Levy et al. 2021): every row whose
    ``column`` holds the same value belongs to one person, and (ε, δ) protects a person's rows together.

    A step samples *people* (each with probability q = B/N_people: ``batch_size`` counts people); a
    sampled person's gradient is the mean of the per-example gradients of ``max_rows`` of their rows drawn
    with fresh coins (all of them when ``max_rows`` is None), clipped to C as one vector. Splits assign
    whole people (a keyed hash of the id); the selection score counts people. The rows per person stay
    inside the trust boundary; N_people is public as N is.
    """

    column: str
    max_rows: int | None = DEFAULT_MAX_ROWS_PER_PERSON


@dataclass(frozen=True)
class WorkloadSpec:
    """Names one workload: dataset × backbone × PEFT, plus the difficulty knobs and the public split seed.

    :func:`dptune.data.load_workload` resolves it to splits; a :class:`TrialConfig` trains on one.

    Invariants checked by :func:`dptune.data.load_workload` before any heavy work:
    ``0 < fraction <= 1``; ``examples_per_class >= 1``; ``fraction`` and ``examples_per_class``
    are not both set; ``classes`` are distinct label ids of the dataset (kept in the given order
    and relabelled ``0..k-1``); ``0 < validation_fraction < 1``; ``max_tokens >= 8`` (text);
    ``max_train_examples``/``max_eval_examples >= 1``.

    - ``fraction``: stratified share of the training split to keep (the paper's CIFAR-100 10%
      subset is ``fraction=0.1``); the validation split is carved before it and does not shrink.
    - ``examples_per_class``: keep exactly this many training examples per class (few-shot).
    - ``classes``: keep only these classes, in train, validation and test.
    - ``max_tokens``: text truncation/padding length in tokens; ``None`` = the backbone's default.
    - ``validation_fraction``: expected share of the (class-filtered) training split held out
      for hyperparameter selection, row by row (a keyed hash of each row's content:
      ``dptune.data.splits``). Selection uses validation, never test.
    - ``max_train_examples`` / ``max_eval_examples``: stratified caps for tests and smoke runs;
      when set, only the kept examples are encoded (cached under their own key).
    - ``dataset_file``: a data owner's own dataset (:class:`DatasetFile`); ``dataset`` is then its
      display name (``file:<name>``), not a registry name.
    - ``person_unit``: the privacy unit is a person (:class:`PersonUnit`), not a row (``None``).
    - ``tuning_rows``: a file holding a secret tuning subsample X₁ (positions in the training and
      validation splits, ``dptune.data.tuning_subset``): only those rows are kept in both; the test
      split is whole. It lives inside the search's trust boundary and never leaves it.
    """

    dataset: str
    backbone: str
    peft: PeftName
    seed: int = 0
    fraction: float = 1.0
    examples_per_class: int | None = None
    classes: tuple[int, ...] | None = None
    max_tokens: int | None = None
    validation_fraction: float = 0.1
    max_train_examples: int | None = None
    max_eval_examples: int | None = None
    tuning_rows: str | None = None
    dataset_file: DatasetFile | None = None
    person_unit: PersonUnit | None = None


@dataclass(frozen=True)
class PublicSchedule:
    """A run's Poisson schedule fixed from public numbers rather than from its training split's size.

    A tuning run on a secret subsample X₁ (``privacy.private_selection.tuning_subsample``) must not
    take q or T from |X₁|, or its privacy curve as a function of X₁ is not the accountant's
    (Koskela & Kulkarni 2023, and ``dptune.privacy.subsampled_tuning``, assumption 2): it samples
    every row of X₁ with probability ``sample_rate`` (q) at each of ``steps`` (T) steps, cut into
    epochs by ``epoch_steps`` (E entries summing to T), and divides its clipped sum by
    ``expected_batch_size`` = q·q₁·N (examples; q₁·N, X₁'s public nominal size), which also sets
    its √B-coupled learning rate. ``dptune.search.planning.subsample.public_schedule`` builds it.
    """

    sample_rate: float
    steps: int
    epoch_steps: tuple[int, ...]
    expected_batch_size: float


@dataclass(frozen=True)
class Mechanism:
    """One run's DP-SGD mechanism, calibrated once by the planner (``dptune.plan.mechanism``) and read by
    every consumer: the runners step with it, the privacy ledger charges it, an unfinished run's ε is
    accounted at it. Plain data; nothing that holds one calibrates σ again.

    The Poisson-subsampled Gaussian mechanism composed ``steps`` times: each step samples every row
    with probability ``sample_rate`` (q, in (0, 1]), adds N(0, σ²C²I) to the clipped sum
    (``noise_multiplier`` σ > 0, the noise std in units of the clip bound C) and divides it by
    ``expected_batch_size`` (examples; q·N, or a subsample tuning run's public q·q₁·N). ``steps`` (T ≥ 1)
    are cut into epochs by ``epoch_steps`` (E entries, each ≥ 0, summing to T). σ is the one the
    accountant (PRV, add/remove adjacency) certifies for the per-run target (``epsilon``, ``delta``) at
    (q, T): ε of all T steps at σ is ≤ ``epsilon``.

    Invariants (checked on construction, ``ValueError``): σ > 0, 0 < q ≤ 1, T ≥ 1,
    sum(``epoch_steps``) = T, ``expected_batch_size`` > 0, ``epsilon`` > 0, 0 < ``delta`` < 1.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    epoch_steps: tuple[int, ...]
    expected_batch_size: float
    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        if not (
            self.noise_multiplier > 0
            and 0 < self.sample_rate <= 1
            and self.steps >= 1
            and sum(self.epoch_steps) == self.steps
            and self.expected_batch_size > 0
            and self.epsilon > 0
            and 0 < self.delta < 1
        ):
            raise ValueError(f"not a calibrated mechanism: {self}")

    @property
    def schedule(self) -> PublicSchedule:
        """Its Poisson schedule: (q, T, the epoch split, the expected batch)."""
        return PublicSchedule(self.sample_rate, self.steps, self.epoch_steps, self.expected_batch_size)


@dataclass(frozen=True)
class TrialConfig:
    """Everything that defines a trial: the ``workload`` it trains on (built once from the search's
    task, :func:`dptune.search.planning.cells.task_workload`) and the trial's own privacy, hyperparameters
    and execution. Plain data; :meth:`row` is its flat form in a result row.

    Units: ``epsilon`` and ``delta`` of (ε, δ)-DP under add/remove adjacency; ``epochs`` is the
    compute budget E (passes over the training set in expectation); ``clip_bound`` is C in
    gradient-norm units; ``batch_size`` is the *expected* logical batch B = q·N under Poisson
    sampling; ``learning_rate`` is the η the optimizer uses, ``base_learning_rate`` the η₀ it was
    coupled from (η = η₀·√(B/B_ref), or η = η₀ when coupling is off).

    Randomness: ``workload.seed`` (the ``split_seed`` of a result row) is public and fixes the data
    split, subset caps and diagnostics probe.
    ``seed`` roots the trial's *coins* (model initialisation, Poisson sampling, gradient noise,
    score noise): ``None`` (the default) draws them from fresh OS entropy, so
    no two trials share noise or batches and nothing stored regenerates them — what the (ε, δ)
    guarantee and any composition across trials assume. An integer makes the trial reproducible
    (research and tests), and then the guarantee does not hold for its released results.
    ``score_noise_multiplier`` (σ_s, a count's std) asks for a DP selection score: the number of
    correct validation predictions plus N(0, σ_s²) (sensitivity 1 under add/remove of a row).
    ``release_run`` marks the release of a private search tuned on a subsample: it trains all its
    steps and is published whatever its loss (its charge covers it), so nothing it computes on the
    private rows decides whether, or how long, it trains.
    ``mechanism``: the run's σ, q and T, calibrated once by the planner for (``epsilon``, ``delta``) and
    this B and schedule (:class:`Mechanism`); the runners step with it and never calibrate.
    """

    workload: WorkloadSpec
    epsilon: float
    delta: float
    epochs: int
    clip_bound: float
    batch_size: int
    learning_rate: float
    base_learning_rate: float
    optimizer: OptimizerName = "adam"
    clipping: ClippingRule = "normalized"
    seed: int | None = None
    score_noise_multiplier: float | None = None
    release_run: bool = False
    # execution
    device: str = "auto"
    max_physical_batch_size: int = 256
    threads: int | None = None
    engine: EngineName = "auto"
    # diagnostics: a fixed probe of ≤ diagnostic_examples training examples at a few epochs
    diagnostics: bool = True
    diagnostic_examples: int = 256
    # a tuning run on a secret subsample: q, T and the expected batch from public numbers (None: from N)
    schedule: PublicSchedule | None = None
    # σ, q, T the planner calibrated for this run (``dptune.plan.mechanism``); a runner refuses a run
    # without one. Not part of :meth:`row`: a result row carries σ, q and T in its own columns.
    mechanism: Mechanism | None = None

    @property
    def stops_on_exact_loss(self) -> bool:
        """Whether a non-finite exact (non-private) training or validation loss ends the run as
        diverged: not with a DP selection score, and not for a release run."""
        return self.score_noise_multiplier is None and not self.release_run

    def row(self) -> dict[str, Any]:
        """The config as one flat dict, as result rows store it: the workload's fields beside the
        trial's, the workload's ``seed`` named ``split_seed`` (so the Parquet schema and the
        ``config`` JSON stay those of the flat config that preceded the nested one)."""
        flat = {
            "split_seed" if f.name == "seed" else f.name: _plain(getattr(self.workload, f.name))
            for f in fields(WorkloadSpec)
        }
        for f in fields(self):
            if f.name not in ("workload", "mechanism"):
                value = getattr(self, f.name)
                flat[f.name] = _plain(value)
        return flat


@dataclass
class EpochMetrics:
    """Metrics after epoch ``epoch`` (1-based). ``test_accuracy`` is only set after the last one."""

    epoch: int
    steps: int  # optimizer steps done so far (cumulative)
    train_loss: float
    val_loss: float
    val_accuracy: float
    wall_time_s: float  # seconds spent in this epoch (training + evaluation)
    examples_per_s: float  # training examples processed per second in this epoch
    test_accuracy: float | None = None


@dataclass
class ClassDiagnostics:
    """Per-class clipping diagnostics on the probe at one epoch (paper §4–5)."""

    label: int
    examples: int
    grad_norm_quantiles: dict[str, float]  # keys "q05","q25","q50","q75","q95"
    clipped_fraction: float  # share of probe examples of this class with ‖g_i‖ > C
    retention_weight: float  # w_y(C) = mean over class y of min(1, C/‖g_i‖)


@dataclass
class Diagnostics:
    """The paper's diagnostics on the probe subset at one epoch (0 = before training).

    ``optimal_clip_bound`` is C* of Theorem 5.2 for the trial's σ and d; ``mse_bias`` and
    ``mse_variance`` split the per-step MSE of the clipped-noised mean gradient at the trial's C
    for a step of ``expected_batch_size`` examples (normalisation: see ``dptune.dp.diagnostics``).
    ``wall_time_s`` is what computing this record cost.

    Not private: the record is computed from the probe examples' exact gradients and released
    without noise, so it is outside the trial's (ε, δ) guarantee (a research diagnostic, as in the
    paper). A deployment whose results leave the data owner's trust boundary sets
    ``TrialConfig.diagnostics = False``.
    """

    epoch: int
    clip_bound: float
    noise_multiplier: float
    dimension: int  # d, number of trainable parameters
    grad_norms: list[float]  # ‖g_i‖ of each probe example (≤ diagnostic_examples values)
    labels: list[int]  # label of each probe example, aligned with grad_norms
    mse_bias: float
    mse_variance: float
    optimal_clip_bound: float
    classes: list[ClassDiagnostics] = field(default_factory=list)
    expected_batch_size: float = float("nan")  # B = q·N of the step the MSE refers to
    wall_time_s: float = 0.0


#: How a saved model computes its logits, as the runner that trained it did (bit for bit):
#: ``module``: the model's forward pass (``nn.Linear`` on features, or backbone and head);
#: ``augmented``: the fused runner's x̃·[W | b]ᵀ, x̃ = [x, 1] (``dptune.runners.heads``).
LogitsRule = Literal["module", "augmented"]


@dataclass
class TrainedModel:
    """The trained parameters of a run that finished ``ok``, as a saved model holds them.

    ``parameters``: float32 numpy arrays by parameter name, the parameters the run trained and no
    other: a linear head's ``weight`` (classes, feature_dim) and ``bias`` (classes,) on features,
    or a backbone model's PEFT parameters (its ``named_parameters`` that require grad). The frozen
    rest is the public backbone, named with its fingerprint in ``provenance`` (str → str: the
    dataset's content digest, the backbone, its weights' digest, the feature encoding's precision).
    """

    parameters: dict[str, Any]
    provenance: dict[str, str]
    logits: LogitsRule = "module"


@dataclass
class TrialResult:
    """What a trial produced. ``status`` other than ``ok`` carries a human ``reason``."""

    config: TrialConfig
    status: TrialStatus
    reason: str = ""
    noise_multiplier: float = float("nan")  # σ
    sample_rate: float = float("nan")  # q = B/N
    steps: int = 0  # T planned = plan.total_steps(N, B, E), what σ is calibrated for
    steps_taken: int = 0  # steps actually run (< steps when stopped or failed); what ε spent counts
    epsilon_spent: float = float("nan")  # ε charged at (σ, q, δ): of steps_taken, or of steps if diverged; ≤ epsilon
    num_train: int = 0  # privacy units (rows, or people under a person unit) of each split: N of q = B/N
    num_val: int = 0
    num_test: int = 0
    num_classes: int = 0
    trainable_parameters: int = 0
    val_accuracy: float = float("nan")  # after the last epoch (selection metric; exact, not private)
    noisy_val_accuracy: float = float("nan")  # (correct + N_Z(0, σ_s²)) / num_val with score noise; else NaN
    test_accuracy: float = float("nan")  # after the last epoch (never used for selection)
    train_loss: float = float("nan")
    wall_time_s: float = 0.0  # training + evaluation + diagnostics (data loading and σ excluded)
    examples_per_s: float = 0.0
    diagnostics_wall_time_s: float = 0.0  # part of wall_time_s spent on diagnostics
    device: str = "cpu"
    engine: str = ""
    epochs: list[EpochMetrics] = field(default_factory=list)
    class_accuracy: dict[int, float] = field(default_factory=dict)  # test accuracy per class
    class_val_accuracy: dict[int, float] = field(default_factory=dict)  # validation accuracy per class
    class_names: dict[int, str] = field(default_factory=dict)
    diagnostics: list[Diagnostics] = field(default_factory=list)
    trained: TrainedModel | None = field(default=None, repr=False, compare=False)  # ok runs only; never a record


Reporter = Callable[[EpochMetrics], None]


def _plain(value: Any) -> Any:
    """A field's value as plain data: a dataclass as its dict, anything else as it is."""
    return asdict(value) if isinstance(value, (PublicSchedule, DatasetFile, PersonUnit)) else value
