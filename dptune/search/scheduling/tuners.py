"""The two Ray Tune ``Tuner`` shapes of a search (Ray appears here, in :mod:`dptune.search.driver` and
in :mod:`dptune.search.scheduling.tune_adapters`): a search's units carry sampled configurations; an end-to-end
private search's carry public unit numbers only (:mod:`dptune.search.runs.private_units`); and a restored
Tuner of either, bound to this driver (:func:`restore_tuner`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dptune.search.planning.cells import CellPlan, cell_spec, record_pruned_grid, unit_size
from dptune.search.planning.sampler import CellSampler
from dptune.search.runs.execution import TrialContext
from dptune.space import SearchSpace

if TYPE_CHECKING:
    from dptune.search.scheduling.tune_adapters import TuneRunState


def trial_slots(space: SearchSpace) -> int:
    """Tune trials that can run at once: the cluster's CPUs over a trial's, within ``max_concurrent_trials``."""
    import ray

    slots = int(ray.cluster_resources().get("CPU", 1) // space.resources.cpus) or 1
    if space.resources.gpu:
        slots = min(slots, int(ray.cluster_resources().get("GPU", 0) // space.resources.gpu) or 1)
    return min(slots, space.resources.max_concurrent_trials or slots)


def search_tuner(
    space: SearchSpace,
    plans: list[CellPlan],
    contexts: dict[str, TrialContext],
    trainable: Any,
    run_config: Any,
    state: TuneRunState,
) -> Any:
    """The Tuner of a search: each cell keeps its own sampler and budget and, with ASHA, its own
    scheduler; a Tune trial carries a unit of configurations of one cell (:func:`unit_size`), and the
    driver's callback prints each cell's progress (and records into ``state``, the driver's)."""
    from ray import tune

    from dptune.search.scheduling.searcher import METRIC, CellMultiplexer
    from dptune.search.scheduling.tune_adapters import CellRun, RecordAndReport

    slots = trial_slots(space)
    units = {plan.cell_key: unit_size(space, plan, slots, contexts[plan.cell_key].fused) for plan in plans}
    if space.sampler.name == "grid":
        for plan in plans:
            record_pruned_grid(space, plan, contexts[plan.cell_key])
    searcher = CellMultiplexer(
        samplers={plan.cell_key: CellSampler(cell_spec(space, plan)) for plan in plans},
        budgets={plan.cell_key: plan.configurations for plan in plans},
        unit_sizes=units,
        contexts=contexts,
        num_train=plans[0].num_train,
        min_steps=space.min_steps,
        racing=None if space.racing is None else space.racing.model_dump(),
    )
    callback = RecordAndReport(
        {
            plan.cell_key: CellRun(contexts[plan.cell_key], f"{plan.cell.cell_id} {plan.clipping}", plan.configurations)
            for plan in plans
        },
        state,
    )
    run_config.callbacks = [callback]
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=searcher,
            scheduler=_per_cell_asha(space, plans),
            metric=METRIC,
            mode="max",
            num_samples=-1,  # until the searcher says it is finished: a resume may add units (search.reconcile)
            max_concurrent_trials=space.resources.max_concurrent_trials,
            reuse_actors=True,  # a trial process keeps torch, the model code and the data loaded
        ),
        run_config=run_config,
    )


def _per_cell_asha(space: SearchSpace, plans: list[CellPlan]) -> Any:
    """With ``scheduler`` set in the space, each cell's own ASHA (``tune_adapters.PerCellASHA``); else None."""
    from ray.tune.schedulers import ASHAScheduler

    from dptune.search.scheduling.tune_adapters import PerCellASHA

    spec = space.scheduler
    if spec is None:
        return None
    return PerCellASHA(
        {
            plan.cell_key: ASHAScheduler(
                time_attr="epoch",
                max_t=plan.cell.epochs,
                grace_period=min(spec.grace_period, plan.cell.epochs),
                reduction_factor=spec.reduction_factor,
            )
            for plan in plans
        }
    )


def private_tuner(
    space: SearchSpace,
    plans: list[CellPlan],
    contexts: dict[str, TrialContext],
    trainable: Any,
    run_config: Any,
    state: TuneRunState,
) -> Any:
    """The Tuner of an end-to-end private search: per cell a public number of units
    (``private_units.unit_count`` of the trial slots), each running its share of the cell's proposals
    kept inside the trust boundary; Tune's searcher, trial names, results and callbacks hold nothing
    that depends on K or on the runs (its callbacks end the search on a storage error, and say in one
    line that a unit failed)."""
    from ray import tune

    from dptune.search.runs.private_units import CELL_KEY, UNIT_KEY, UNITS_KEY, unit_count
    from dptune.search.scheduling.searcher import METRIC
    from dptune.search.scheduling.tune_adapters import StopOnStorageFailure, UnitFailureNotice

    units = unit_count(trial_slots(space))
    runs = next(iter(contexts.values())).results_root
    run_config.callbacks = [StopOnStorageFailure(state), UnitFailureNotice(runs, space.resources.max_retries)]
    return tune.Tuner(
        trainable,
        param_space={
            CELL_KEY: tune.grid_search([plan.cell_key for plan in plans]),
            UNIT_KEY: tune.grid_search(list(range(units))),
            UNITS_KEY: units,
        },
        tune_config=tune.TuneConfig(
            metric=METRIC,
            mode="max",
            max_concurrent_trials=space.resources.max_concurrent_trials,
            # one actor per unit: a reused actor gets calls (reset) that a fresh one does not, and which
            # units finish first, and so are reused, depends on K
            reuse_actors=False,
        ),
        run_config=run_config,
    )


def restore_tuner(experiment: str, trainable: Any, contexts: Mapping[str, TrialContext], state: TuneRunState) -> Any:
    """The Tuner of the search whose Tune state is at ``experiment``, restored to run its unfinished units and
    restart its errored ones, with ``trainable`` (this driver's contexts). Its searcher and callbacks come
    unpickled from the state the search's first driver wrote (another process, another lease, perhaps
    another folder: a copy), without contexts or run state; they are given this driver's ``contexts`` and
    ``state`` here (``_thirdparty.restored_configs``: ``Tuner.restore`` takes neither), so a resume
    writes only to its own folder under its own lease and reports into its own driver."""
    from ray import tune

    from dptune._thirdparty import restored_configs
    from dptune.search.scheduling.searcher import CellMultiplexer
    from dptune.search.scheduling.tune_adapters import StopOnStorageFailure

    tuner = tune.Tuner.restore(
        experiment, trainable=trainable, resume_unfinished=True, resume_errored=False, restart_errored=True
    )
    configs = restored_configs(tuner)
    if configs is not None:
        tune_config, run_config = configs
        if isinstance(tune_config.search_alg, CellMultiplexer):
            tune_config.search_alg.bind(contexts)
        for callback in run_config.callbacks or []:
            if isinstance(callback, StopOnStorageFailure):  # RecordAndReport is one too
                callback.bind(contexts, state)
    return tuner


def cell_trainable(contexts: dict[str, TrialContext]) -> Any:
    """The Tune function trainable of a search (``tune_adapters.tune_trainable``) with the cells' contexts."""
    from ray import tune

    from dptune.search.scheduling.tune_adapters import tune_trainable

    return tune.with_parameters(tune_trainable, contexts=contexts)


def private_trainable(contexts: dict[str, TrialContext], chunk: int) -> Any:
    """The Tune function trainable of an end-to-end private search (``tune_adapters.private_unit_trainable``):
    the cells' contexts and ``chunk``, the configurations a unit runs at once."""
    from ray import tune

    from dptune.search.scheduling.tune_adapters import private_unit_trainable

    return tune.with_parameters(private_unit_trainable, contexts=contexts, chunk=chunk)
