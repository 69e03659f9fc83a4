"""Starting or joining Ray for a search, and what runs on it outside the Tune run.

:func:`init_ray` joins a cluster (``--address`` or RAY_ADDRESS) or starts an embedded local Ray (its
session recorded and a killed driver's leftovers ended first: :mod:`dptune.search.scheduling.embedded_ray`);
:func:`shutdown_embedded` shuts an embedded one down; :func:`run_as_task` runs one function as a Ray
task with a unit's resources (a subsample tuning's release).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, cast

from dptune.errors import SearchIncomplete
from dptune.search import preflight
from dptune.search.scheduling.embedded_ray import end_orphans, private_session_folder, record_session
from dptune.space import SearchSpace

#: Tries of an embedded Ray start whose processes time out registering (an overloaded machine: Ray
#: waits a fixed 30 s), and the seconds between them.
RAY_START_ATTEMPTS = 3
RAY_START_RETRY_PAUSE_S = 15.0

#: How :func:`init_ray`'s answer begins when it started an embedded Ray.
EMBEDDED_STARTED = "started embedded local Ray"


def init_ray(address: str | None, num_cpus: int | None = None, *, private: bool = False) -> str:
    """Join a cluster (``--address`` or RAY_ADDRESS) or start an embedded local Ray.

    ``private`` (an end-to-end private search): Ray logs critical errors only, so the console (and ``ray
    job logs``) carries none of Ray's or Tune's timestamped lines, also when a unit's process dies; an
    embedded Ray keeps its session folder in the owner-only temporary folder ``private_ray_folder``
    made, removed at the end.

    A plain ``ray.init()`` would silently join whatever cluster a leftover file points to, so
    the embedded case asks for ``address="local"`` explicitly. A cluster that cannot be joined
    raises ``PreflightError`` naming the address and, when no token is set, token authentication
    (``preflight.cluster_join_error``). An embedded start first ends what a killed embedded driver
    left running and records its own session (:mod:`dptune.search.scheduling.embedded_ray`). An embedded start
    that times out (Ray waits 30 s for its processes to register: an overloaded machine) is tried up
    to ``RAY_START_ATTEMPTS`` times, ``RAY_START_RETRY_PAUSE_S`` apart, then raises
    ``SearchIncomplete`` saying the machine is overloaded and what to do.
    """
    import ray

    target = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return "already initialised"
    quiet: dict[str, Any] = {"logging_level": logging.CRITICAL} if private else {}
    if private:  # Tune's own lines (its end line, a dead unit's ERROR lines, with a time) go through the same logger
        logging.getLogger("ray").setLevel(logging.CRITICAL)
    # Every worker process first leaves a deleted working directory (inherited from the
    # `ray start` of its node), which would otherwise kill trials at `import torch`.
    runtime_env = {"worker_process_setup_hook": "dptune.runners.trial.leave_deleted_working_directory"}
    # dptune says what failed in one line; an error object no one fetched would print Ray's traceback above it
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    if target:
        try:
            ray.init(address=target, log_to_driver=False, runtime_env=runtime_env, **quiet)
        except (ConnectionError, RuntimeError) as error:
            raise preflight.cluster_join_error(target, "--address" if address else "RAY_ADDRESS", error) from None
        return f"joined Ray cluster at {target}"
    cpus = num_cpus or os.cpu_count()
    end_orphans()  # what an earlier embedded driver, killed, left running
    _start_embedded_ray(cpus, runtime_env, quiet, private)
    return f"{EMBEDDED_STARTED} ({cpus} CPUs)"


def _start_embedded_ray(cpus: int | None, runtime_env: dict[str, str], quiet: dict[str, Any], private: bool) -> None:
    """Start an embedded Ray and record its session; a start that times out is tried again (:func:`init_ray`)."""
    import ray

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            started = ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env=runtime_env,
                _temp_dir=private_session_folder() if private else None,
                **quiet,
            )
            session = cast(Any, started).address_info["session_dir"]  # a RayContext, typed as its base
            record_session(session, private_session_folder(parent=True))
            return
        except Exception as error:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(error):
                raise
            with contextlib.suppress(Exception):
                ray.shutdown()
            _startup_timed_out(attempt)


def _startup_timed_out(attempt: int) -> None:
    """After start ``attempt`` of an embedded Ray timed out: raise ``SearchIncomplete`` if it was the last,
    else say so and wait ``RAY_START_RETRY_PAUSE_S``."""
    load = os.getloadavg()[0]
    if attempt == RAY_START_ATTEMPTS:
        raise SearchIncomplete(
            f"the embedded Ray did not start: its processes did not register within Ray's startup wait, "
            f"{RAY_START_ATTEMPTS} times (load average {load:.1f} on {os.cpu_count()} cores: this machine is "
            "overloaded). Run again when the load is lower (with --resume), or start Ray once yourself "
            "(`ray start --head --num-cpus N`) and pass its address with --address; nothing was trained"
        ) from None
    print(
        f"warning: the embedded Ray timed out during startup (load average {load:.1f} on "
        f"{os.cpu_count()} cores); attempt {attempt + 1} of {RAY_START_ATTEMPTS} "
        f"in {RAY_START_RETRY_PAUSE_S:g} s",
        file=sys.stderr,
        flush=True,
    )
    time.sleep(RAY_START_RETRY_PAUSE_S)


def check_cluster_resources(space: SearchSpace) -> None:
    """Refuse per-trial resources no node of the joined Ray cluster has (``preflight.PreflightError``),
    disconnecting from it (``ray.shutdown``) first."""
    import ray

    try:
        preflight.check_cluster_resources(space.resources, ray.nodes())
    except preflight.PreflightError:
        ray.shutdown()
        raise


def shutdown_embedded(embedded: str) -> None:
    """Shut down the Ray this search started (``embedded``: what :func:`init_ray` said; a joined cluster or
    a Ray some caller had initialised is left alone), in this thread: no Ray object outlives it."""
    import ray

    if embedded.startswith(EMBEDDED_STARTED):
        ray.shutdown()


def run_as_task(space: SearchSpace, function: Callable[..., None], *args: Any) -> None:
    """Run ``function(*args)`` as one Ray task with a unit's resources (``resources.cpus``/``gpu``) and wait."""
    import ray

    task = ray.remote(num_cpus=space.resources.cpus, num_gpus=space.resources.gpu)(function)
    ray.get(task.remote(*args))
