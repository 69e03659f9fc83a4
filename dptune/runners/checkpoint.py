"""A run's training state kept between epochs, so that a lost process continues the same run.

Used by the release of a private search tuned on a subsample (``dptune.search.planning.subsample.
release_context``): the release is charged once in the privacy ledger, and a kill during its
training must neither leave the search stuck nor make a resume train a second, uncharged model.
So after every epoch but the last (and before its first step) the trainer writes the run's whole
state: its trainable parameters, the optimizer's state, the steps taken and what was measured so
far, and the *whole* state of every generator the mechanism draws from (the Poisson sampler's
MT19937, the noise generator's, the score generator's PCG64 and torch's global one). A resumed
process loads it and takes the remaining steps with the same coins the lost one would have used:
the released model is the output of one run of the mechanism, and the steps the lost process
took after its last checkpoint, never released, are taken again with the same noise.

The file holds the generators' states, from which that run's noise can be regenerated, so it lives
inside the data owner's trust boundary only (the private search's ``runs`` folder), is written
atomically and durably, and is removed once the run is recorded (:meth:`RunCheckpoint.remove`).
It is read with ``torch.load(weights_only=True)``: tensors and plain Python values only.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from dptune.paths import filesystem, read_file, write_file_atomic

#: The folder, inside a private search's trust boundary, that holds its runs' checkpoints.
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class RunCheckpoint:
    """The checkpoint file ``<folder>/<file_name>`` of one run (``folder`` may be a URI)."""

    folder: str
    file_name: str

    def save(self, state: dict[str, Any]) -> None:
        """Write ``state`` (tensors and plain values) whole or not at all, durably."""
        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_file_atomic(self.folder, self.file_name, buffer.getvalue(), durable=True)

    def load(self) -> dict[str, Any] | None:
        """The state last saved, or None when there is none."""
        data = read_file(self.folder, self.file_name)
        if data is None:
            return None
        import torch

        state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
        return state

    def remove(self) -> None:
        """Delete the file (its generator states must not outlive the run's record); none is fine."""
        import pyarrow.fs as pafs

        fs, root = filesystem(self.folder)
        path = f"{root}/{self.file_name}"
        if fs.get_file_info(path).type == pafs.FileType.File:
            fs.delete_file(path)
