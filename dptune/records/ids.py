"""The ids a search gives its configurations and runs, in one place. Plain strings, no I/O.

- :func:`params_key`: a sampled configuration (C, B, η₀, ...) as canonical JSON, its values as floats
  by name (B = 64 and 64.0 are one configuration): what a cell's sampler knows a configuration by;
- :func:`configuration_id`: ``<cell_key>-<first 12 hex digits of sha1(params_key)>``, a configuration
  of one cell under its clipping rule (content-based, so a configuration proposed again after a crash
  or a resume maps onto the same rows);
- :func:`replicate_trial_id`: ``<configuration_id>-r<replicate>``, one run (a row of ``trials``).

Results folders hold these ids: their forms must not change.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def params_key(params: Mapping[str, Any]) -> str:
    """A configuration's identity for a sampler: its values as floats, by name (B = 64 and 64.0 are one)."""
    return json.dumps({name: float(value) for name, value in sorted(params.items())})


def configuration_id(cell_key: str, params: Mapping[str, Any]) -> str:
    """A configuration's id: its cell and a digest of its sampled (C, B, η₀) (:func:`params_key`).

    Content-based, so a configuration proposed again after a crash or a resume (Tune's own state
    may lag the results by a few seconds) maps onto the same rows instead of new ones.
    """
    return f"{cell_key}-{hashlib.sha1(params_key(params).encode()).hexdigest()[:12]}"


def replicate_trial_id(configuration_id: str, replicate: int) -> str:
    """The trial id of replicate ``replicate`` (0-based) of a configuration: ``<configuration_id>-r<replicate>``."""
    return f"{configuration_id}-r{replicate}"
