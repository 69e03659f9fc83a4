"""The machine a benchmark ran on, for its JSON: the CPU model (``lscpu``), the vector extensions the
matmuls may use (AVX2, AVX-512, AMX), torch's version and threads, and the date."""

from __future__ import annotations

import datetime
import platform
import subprocess
from typing import Any


def machine() -> dict[str, Any]:
    """The CPU model and its avx2/avx512/amx flags, torch's version and thread count, and the date (UTC)."""
    import torch

    model, flags = platform.processor() or platform.machine(), []
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            model = value.strip()
        elif key.strip() == "Flags":
            flags = sorted(f for f in value.split() if f.startswith(("avx2", "avx512", "amx")))
    return {
        "cpu": model,
        "flags": flags,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
