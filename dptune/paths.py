"""Where dptune keeps caches on disk (σ calibrations, encoded features).

``DPTUNE_CACHE_DIR`` overrides the default ``~/.cache/dptune``; tests point it at a temporary
folder. Nothing here is results: results go where ``--storage`` says.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "DPTUNE_CACHE_DIR"


def cache_dir(*parts: str) -> Path:
    """Return (and create) the cache folder, or a sub-folder of it."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dptune").expanduser()
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
