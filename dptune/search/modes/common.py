"""What the search modes share: the proposals a private search draws before any run, and the shape of a
cell's release choice. Ray-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from dptune.search.planning.cells import CellPlan

#: Each cell's proposals, drawn once before any run (a private search's; a search draws as it goes: None).
Proposals = Mapping[str, list[dict[str, Any]]] | None

#: What an end-to-end private search releases of a cell: (its plan, its ``search`` row, the run it releases).
ReleaseChoice = tuple["CellPlan", dict[str, Any], "pd.Series"]
