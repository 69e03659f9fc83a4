"""What an end-to-end private search creates on the machine it runs on is the owner's alone, and what
it computes about its hidden runs stays inside its trust boundary: Ray's folder while Ray runs, Tune's
lock files, the σ/ε cache; every unit does the same work whatever its share of the secret runs; and
the subsample release's score depends on public numbers only."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pandas as pd

from dptune.privacy import cache
from dptune.privacy.prv import epsilon_spent
from dptune.records import owner_only
from dptune.runners.common import cached_workload
from dptune.search.finish.outcome import _subsample_release
from dptune.search.planning.subsample import RELEASE_PARAMETERS, RELEASE_SUFFIX
from dptune.search.runs.execution import TrialContext
from dptune.search.runs.private_units import PrivateUnit, kept_proposals, run_private_unit
from dptune.search.scheduling.embedded_ray import (
    PRIVATE_RAY_FOLDER_ENV,
    RAY_SESSION_SUBFOLDER,
    RECORDS,
    private_ray_folder,
)
from dptune.search.scheduling.ray_session import init_ray
from trial_configs import HEAD_TRIAL


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_private_searchs_ray_folder_is_owner_only_while_ray_runs_and_gone_after(dptune_cache_dir: Path) -> None:
    import ray
    from ray.air._internal.filelock import TempFileLock

    before = os.environ.get("RAY_TMPDIR")
    with owner_only(), private_ray_folder() as folder:
        assert os.environ[PRIVATE_RAY_FOLDER_ENV] == os.environ["RAY_TMPDIR"] == folder
        assert init_ray(None, 1, private=True).startswith("started embedded local Ray")
        record = dptune_cache_dir / RECORDS / f"{os.getpid()}.json"  # where the embedded Ray keeps its session
        session = Path(json.loads(record.read_text())["session_dir"])
        # Ray opens the folder it is given to everyone; the owner-only parent still closes it
        assert session.parent.parent == Path(folder) and session.parent.name == RAY_SESSION_SUBFOLDER
        assert _mode(folder) == 0o700 and _mode(session.parent) == 0o777
        # Tune's lock files go below it too, and what the search writes meanwhile is the owner's
        lock = TempFileLock(str(Path(folder, "experiment_state.json")))
        with lock:
            assert Path(lock._lock_path).is_relative_to(folder) and _mode(lock._lock_path) & 0o077 == 0
        written = Path(folder, "written")
        written.write_text("x")
        assert _mode(written) == 0o600
    assert not ray.is_initialized() and not Path(folder).exists()
    assert os.environ.get("RAY_TMPDIR") == before and PRIVATE_RAY_FOLDER_ENV not in os.environ


def test_the_epsilon_of_a_hidden_run_is_cached_inside_the_boundary_or_not_at_all(
    dptune_cache_dir: Path, tmp_path: Path
) -> None:
    mechanisms = [(1.7311, 0.0421, 317), (1.7312, 0.0421, 318)]  # σ, q, T no other test computes
    user = dptune_cache_dir / "accounting"

    def entries(folder: Path) -> set[tuple[float, float, int]]:
        keys = [json.loads(path.read_text())["key"] for path in folder.glob("epsilon-*.json")]
        return {(key["noise_multiplier"], key["sample_rate"], key["steps"]) for key in keys}

    cache.forget()
    with cache.kept_inside(str(tmp_path)):
        inside = epsilon_spent(*mechanisms[0], 1e-5)
    assert mechanisms[0] in entries(tmp_path / "accounting") and mechanisms[0] not in entries(user)
    assert _mode(tmp_path / "accounting") == 0o700
    cache.forget()
    with cache.kept_inside("s3://bucket/results/inside_trust_boundary"):  # an object store: memory only
        epsilon_spent(*mechanisms[1], 1e-5)
    assert mechanisms[1] not in entries(user) and not Path("s3:").exists()
    cache.forget()
    assert epsilon_spent(*mechanisms[0], 1e-5) == inside  # outside the block: the user's cache, as before
    assert mechanisms[0] in entries(user)
    # the user's entries (the public plan's) are read inside the block, and the read leaves no access time
    (planned,) = [path for path in user.glob("epsilon-*.json") if json.loads(path.read_text())["key"]["steps"] == 317]
    os.utime(planned, (1_000_000_000, planned.stat().st_mtime))
    cache.forget()
    with cache.kept_inside(str(tmp_path / "again")):
        assert epsilon_spent(*mechanisms[0], 1e-5) == inside
    assert planned.stat().st_atime == 1_000_000_000 and mechanisms[0] in entries(tmp_path / "again" / "accounting")


def test_the_subsample_release_score_is_the_integer_count_over_a_public_number_whatever_the_tuning_split() -> None:
    fraction, n_val = 0.5, 1217
    nominal = fraction * n_val
    configuration = dict.fromkeys(RELEASE_PARAMETERS, 1.0)
    release_run = {**configuration, "cell_id": "c" + RELEASE_SUFFIX, "status": "ok", "num_val": n_val}
    rng = np.random.default_rng(5)
    for k, n1 in zip(rng.integers(-20, 700, 400), rng.integers(560, 660, 400), strict=True):
        tuned = {**configuration, "cell_id": "c", "status": "ok", "num_val": int(n1), "noisy_val_accuracy": k / n1}
        chosen = _subsample_release(pd.DataFrame([tuned, {**release_run, "noisy_val_accuracy": np.nan}]), "c", fraction)
        assert chosen is not None
        # the same bits for every size of X₁ ∩ val (which stays inside): k / (q₁·N_val), one division
        assert chosen["noisy_val_accuracy"] == int(k) / nominal, (k, n1)


def test_a_private_unit_loads_the_workload_even_when_the_secret_draw_gave_it_no_run(
    tmp_path: Path, dptune_cache_dir: Path
) -> None:
    inside = str(tmp_path / "inside_trust_boundary")
    context = TrialContext(
        base=HEAD_TRIAL,
        results_root=inside,
        search_id="s",
        cell_id="eps=8|epochs=2",
        cell_key="eps8-E2",
        coupling="sqrt",
        reference_batch_size=64,
    )
    kept_proposals(inside, [context.cell_key], lambda key: [{"clip_bound": 1.0, "batch_size": 50.0}])  # K = 1
    cached_workload.cache_clear()
    umask = os.umask(0o022)
    try:
        run_private_unit(context, PrivateUnit(context.cell_key, unit=1, units=2), chunk=4)  # n ≡ 1 (mod 2): none
        assert os.umask(0o022) == 0o022  # the unit's owner-only umask is its own
    finally:
        os.umask(umask)
    assert cached_workload.cache_info().currsize == 1  # what a unit with runs holds too
    assert not Path(inside, "trials").exists()
