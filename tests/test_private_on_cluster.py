"""End-to-end private searches submitted with ``ray job submit`` to the suite's token-authenticated
head: nothing of the hidden runs reaches the job's logs,
Ray's state API, the dashboard or the head's session folders, and the actors and tasks are the same
for K = 1 and K = 20."""

from __future__ import annotations

import collections
import json
import os
import urllib.request
import uuid
from pathlib import Path

import pandas as pd

from conftest import REPO_ROOT, TINY_TRAIN_EXAMPLES, RayHead, ray_job_submit, search_command
from dptune.records import TRUST_BOUNDARY, read_table
from dptune.search import TRIAL_COUNT_FILE
from dptune.search.modes import CLUSTER_TIMING_NOTE, mode_of
from dptune.space import load_space
from hidden_runs import (
    assert_none_in,
    assert_nothing_of_the_hidden_runs_outside,
    card_numbers,
    hidden_needles,
)

PRIVATE = REPO_ROOT / "search_spaces/private.yaml"
SUBSAMPLE_FRACTION = "privacy.private_selection.tuning_subsample.fraction"
#: The head's trial slots (``ray_head``: 2 CPUs, 1 a trial).
HEAD_SLOTS = 2
#: Files of the head's temp folder larger than this are not scanned (none is, in a test session).
_SCAN_MAX_BYTES = 64 * 2**20


def _submit(ray_head: RayHead, cache: Path, space: str, storage: Path, name: str, *flags: str) -> tuple[str, str]:
    """Submit the private search of ``space`` (a path in the repository) as a job and wait for it;
    returns its submission id and what ``ray job submit`` printed."""
    entrypoint = search_command("--space", space, "--storage", str(storage), "--name", name, "--no-report", *flags)
    entrypoint[0] = "python"  # resolved on the head's PATH (the venv it was started from)
    submission = f"dptune-{name}-{uuid.uuid4().hex[:8]}"
    return submission, ray_job_submit(ray_head, cache, storage, entrypoint, submission).stdout


def _dashboard(ray_head: RayHead, path: str) -> bytes:
    """``GET path`` of the head's dashboard (the HTTP API behind ``ray list`` and ``ray job logs``)."""
    request = urllib.request.Request(f"{ray_head.dashboard_url}{path}")
    request.add_header("Authorization", f"Bearer {ray_head.token}")
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def _state_answer(ray_head: RayHead, resource: str, **filters: str) -> dict:
    """``ray list <resource> --detail`` (dead entries included), through the state API's HTTP endpoint:
    its ``result`` and the counts beside it (``total`` counts events the head dropped, too)."""
    query = "&".join(
        ["detail=1", "limit=10000"]
        + [f"filter_keys={key}&filter_predicates=%3D&filter_values={value}" for key, value in filters.items()]
    )
    answer = json.loads(_dashboard(ray_head, f"/api/v0/{resource}?{query}"))
    assert answer["result"], answer
    return dict(answer["data"]["result"])


def _state(ray_head: RayHead, resource: str, **filters: str) -> list[dict]:
    return list(_state_answer(ray_head, resource, **filters)["result"])


def _job_id(ray_head: RayHead, submission: str) -> str:
    (job_id,) = [
        job["job_id"] for job in json.loads(_dashboard(ray_head, "/api/jobs/")) if job["submission_id"] == submission
    ]
    return str(job_id)


def _job_actors(ray_head: RayHead, submission: str) -> collections.Counter[str]:
    """The actors the job ``submission`` started (dead ones included), counted by class (its name without
    the qualifying prefix, which Ray's state API shows for one job and not for another:
    ``wrap_function.<locals>.ImplicitFunc`` and ``ImplicitFunc`` are Ray Tune's one trainable class)."""
    actors = _state(ray_head, "actors", job_id=_job_id(ray_head, submission))
    return collections.Counter(actor["class_name"].rsplit(".", 1)[-1] for actor in actors)


def _job_tasks(ray_head: RayHead, submission: str) -> tuple[collections.Counter[str], int]:
    """The tasks (actor methods included) the job ``submission`` ran, counted by name without the
    qualifying prefix (``wrap_function.<locals>.``, as :func:`_job_actors`), and how many of the job's
    task events the head reports it dropped (a busy worker's last events can be lost at its exit)."""
    answer = _state_answer(ray_head, "tasks", job_id=_job_id(ray_head, submission))
    names = collections.Counter(task["name"].rsplit("<locals>.", 1)[-1] for task in answer["result"])
    return names, int(answer["total"]) - int(answer["num_after_truncation"])


def _head_files(ray_head: RayHead) -> bytes:
    """Every regular file of the head's temp folder (its session folders, logs, Tune staging)."""
    chunks = []
    for folder, _, names in os.walk(ray_head.temp_dir):
        for name in names:
            path = Path(folder, name)
            if path.is_file() and not path.is_symlink() and path.stat().st_size <= _SCAN_MAX_BYTES:
                try:
                    chunks.append(path.read_bytes())
                except OSError:  # rotated away while we looked
                    continue
    return b"".join(chunks)


def _released_to_ray(ray_head: RayHead, submissions: list[str]) -> dict[str, bytes]:
    """What Ray itself shows of the jobs: their logs, the state API (actors, tasks, jobs, placement
    groups, workers), the dashboard's job and actor endpoints, and the head's files."""
    shown = {f"`ray job logs {s}`": _dashboard(ray_head, f"/api/jobs/{s}/logs") for s in submissions}
    for resource in ("actors", "tasks", "jobs", "placement_groups", "workers"):
        shown[f"`ray list {resource}`"] = json.dumps(_state(ray_head, resource)).encode()
    for path in ("/api/jobs/", "/logical/actors"):
        shown[f"the dashboard's {path}"] = _dashboard(ray_head, path)
    shown["the head's temp folder"] = _head_files(ray_head)
    return shown


def _seed_trial_count(space: Path, storage: Path, name: str, overrides: dict, trials: int) -> None:
    """Fix the cell's K before the search starts, as a resume finds it kept inside the trust boundary."""
    search_space = load_space(space, overrides).space
    (plan,) = mode_of(search_space).plan(search_space, TINY_TRAIN_EXAMPLES, progress=False)
    inside = storage / name / TRUST_BOUNDARY
    inside.mkdir(parents=True)
    (inside / TRIAL_COUNT_FILE).write_text(json.dumps({plan.cell_key: trials}))


def test_private_searches_on_a_cluster_show_ray_nothing_of_their_runs_and_the_same_actors_and_tasks_for_k_1_and_20(
    ray_head: RayHead, test_cache_dir: Path, tmp_path: Path
) -> None:
    flags = ("--set", "epochs=[5]")
    submissions = {}
    for name, trials in (("k1", 1), ("k20", 20)):
        _seed_trial_count(PRIVATE, tmp_path, name, {"epochs": [5]}, trials)
        submissions[name], _ = _submit(ray_head, test_cache_dir, "search_spaces/private.yaml", tmp_path, name, *flags)
    # search_spaces/private_subsample.yaml as a user submits it: the tuning runs as Ray Tune units and the
    # release as one Ray task
    subsample_flags = ("--set", "sampler.trials_per_cell=2", "--set", f"{SUBSAMPLE_FRACTION}=0.5", *flags)
    submissions["subsample"], printed = _submit(
        ray_head, test_cache_dir, "search_spaces/private_subsample.yaml", tmp_path, "subsample", *subsample_flags
    )
    assert "training the release on every training row" in printed
    (release,) = read_table(str(tmp_path / "subsample"), "release").itertuples()
    assert (release.tuning_fraction, release.transfer) == (0.5, "sample_rate") and 0 < release.test_accuracy <= 1
    tuned = pd.read_parquet(tmp_path / "subsample" / TRUST_BOUNDARY / "trials")
    (trained,) = tuned[tuned["cell_id"].str.endswith("|release")].itertuples()
    assert (trained.num_train, trained.status, trained.test_accuracy) == (
        TINY_TRAIN_EXAMPLES,
        "ok",
        release.test_accuracy,
    )
    # K as seeded: every proposal ran (beside one record per B the min-step rule prunes, a public number)
    for name, trials in (("k1", 1), ("k20", 20)):
        recorded = pd.read_parquet(tmp_path / name / TRUST_BOUNDARY / "trials")
        ran = recorded[recorded["status"] != "pruned_min_steps"]
        assert len(ran) == trials and set(ran["status"]) == {"ok"}, ran["reason"]
    # the same actors, one per trial slot, whatever K
    k1, k20 = (_job_actors(ray_head, submissions[name]) for name in ("k1", "k20"))
    assert k1 == k20 and 0 < sum(k1.values()) <= HEAD_SLOTS, (k1, k20)
    # and the same tasks: every unit loads the workload and runs in an actor of its own, whatever its runs
    (k1_tasks, k1_dropped), (k20_tasks, k20_dropped) = (_job_tasks(ray_head, submissions[n]) for n in ("k1", "k20"))
    assert k1_tasks["ImplicitFunc.__init__"] == sum(k1.values()), k1_tasks
    if k1_dropped or k20_dropped:  # the head lost some events: what it shows is compared, not their counts
        assert set(k1_tasks) == set(k20_tasks), (k1_tasks, k20_tasks, k1_dropped, k20_dropped)
    else:
        assert k1_tasks == k20_tasks, (k1_tasks, k20_tasks)
    shown = _released_to_ray(ray_head, list(submissions.values()))
    # what any of the three searches released is public: Ray's views hold all three (a released number
    # of one, k/150 on its model card, can equal a hidden noisy score of another and tells nothing of it)
    released = pd.concat([pd.read_parquet(tmp_path / name / "release") for name in submissions])
    public = card_numbers(*(tmp_path / name for name in submissions))
    for name, submission in submissions.items():
        root = tmp_path / name
        logs = json.loads(shown[f"`ray job logs {submission}`"])["logs"]
        assert "joined Ray cluster" in logs and "the release of this end-to-end private search" in logs
        assert " ".join(CLUSTER_TIMING_NOTE.split()) in " ".join(logs.split())  # what of K the cluster still shows
        # Ray's job manager stamps the job's start before the search runs (its start and end times are
        # in Ray's job table too: the wall time is seen by whoever watches the cluster, docs/PRIVACY.md)
        ray_lines, search_output = logs.split(f"Running entrypoint for job {submission}", 1)
        assert ray_lines.count("\n") == 1 and "Runtime env is setting up." in ray_lines
        assert_nothing_of_the_hidden_runs_outside(root, search_output, None, HEAD_SLOTS, public)
        hidden = pd.read_parquet(root / TRUST_BOUNDARY / "trials")
        needles = hidden_needles(hidden, released, public)
        # the head's files hold every job of the suite's shared head, the public accuracies of non-private
        # searches included: a noisy score k/150 there cannot be told from another job's accuracy k/150,
        # so that folder is searched for the runs' ids, C and η₀ (which a leaked record would hold too)
        shared = hidden_needles(hidden, released, public, scores=False)
        for where, blob in shown.items():
            assert_none_in(blob, shared if where == "the head's temp folder" else needles, where)
