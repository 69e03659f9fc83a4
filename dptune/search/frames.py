"""Tables in memory as dataset files: a pandas or polars DataFrame, a pyarrow Table or a Hugging Face
``Dataset`` handed to :func:`dptune.tune` becomes one Parquet file, read and checked as any data
owner's file is (:mod:`dptune.data.files`: the same column keys, the same refusals).

The file is written once into the user's cache (``<cache>/frames/<name>/dataframe.parquet``, the folders
mode 0700 and the file 0600: the rows are private and stay on this machine), its folder named by a keyed
hash of its content (:func:`dptune.privacy.cache.keyed_digest`): the same table gets the same file, so a
search given it again resumes as the same search, and the name, which a search records in its space, says
nothing of the rows to anyone without this user's cache secret. A search on a Ray cluster takes a path
its nodes can read instead.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

from dptune.paths import cache_dir, write_file_atomic
from dptune.space import SpaceError

#: The cache sub-folder of tables written from memory.
FRAMES_FOLDER = "frames"
#: The file's name in its folder (a dataset's name in records is its file's: ``file:dataframe.parquet``).
FRAME_FILE = "dataframe.parquet"
#: What :func:`frame_file` takes, as its refusal names them.
TABLE_KINDS = "a pandas or polars DataFrame, a pyarrow Table or a Hugging Face Dataset"


def frame_file(data: Any, where: str = "data") -> Path:
    """The Parquet file holding the table ``data`` (:data:`TABLE_KINDS`), written to the user's cache
    unless there already, named by a keyed hash of its content (:func:`_content_digest`). A Hugging Face
    ``ClassLabel`` column is written as its class names. :class:`SpaceError` naming ``where`` for anything
    else, or for a table without rows."""
    import pyarrow.parquet as pq

    table = _arrow(data, where).replace_schema_metadata(None)  # pandas' metadata names its version
    if table.num_rows == 0:
        raise SpaceError(f"{where}: the table has no rows")
    sink = io.BytesIO()
    pq.write_table(table, sink)
    from dptune.privacy.cache import keyed_digest

    frames = cache_dir(FRAMES_FOLDER)
    os.chmod(frames, 0o700)
    folder = frames / keyed_digest(frames, _content_digest(table))[:32]
    path = folder / FRAME_FILE
    if not path.is_file():
        folder.mkdir(mode=0o700, exist_ok=True)
        write_file_atomic(str(folder), FRAME_FILE, sink.getvalue())
        os.chmod(path, 0o600)
    return path


def _content_digest(table: Any) -> bytes:
    """SHA-256 of ``table``'s schema and values in Arrow's IPC stream format (no writer's name or version,
    unlike a Parquet file's bytes): the same rows, the same digest, from one release of a library to the next."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).digest()


def _kind(data: Any) -> str | None:
    module = type(data).__module__.split(".", 1)[0]
    name = type(data).__name__
    return {
        ("pandas", "DataFrame"): "pandas",
        ("polars", "DataFrame"): "polars",
        ("pyarrow", "Table"): "arrow",
        ("datasets", "Dataset"): "datasets",
    }.get((module, name))


def _arrow(data: Any, where: str) -> Any:
    """``data`` as a pyarrow Table (the index of a pandas DataFrame dropped, ClassLabels as names)."""
    import pyarrow as pa

    kind = _kind(data)
    if kind == "arrow":
        return data
    if kind == "pandas":
        return pa.Table.from_pandas(data, preserve_index=False)
    if kind == "polars":
        return data.to_arrow()
    if kind == "datasets":
        return _named_labels(data)
    raise SpaceError(f"{where}: expected a file path or {TABLE_KINDS}, got {type(data).__name__}")


def _named_labels(dataset: Any) -> Any:
    """A Hugging Face ``Dataset``'s rows as a pyarrow Table, each ``ClassLabel`` column as its names."""
    import datasets
    import pyarrow as pa

    table = dataset.flatten_indices().data.table
    for column, feature in dataset.features.items():
        if isinstance(feature, datasets.ClassLabel):
            names = pa.array([None if i is None else feature.names[i] for i in table.column(column).to_pylist()])
            table = table.set_column(table.column_names.index(column), column, names)
    return table


def table_path(data: str | Path | Any, where: str, cluster: str | None = None) -> str:
    """A dataset argument as the path a space names: a path as given (``~`` expanded, made absolute), a table
    in memory as its :func:`frame_file`. A table is refused for a search on a Ray ``cluster``: its file
    would be on this machine only."""
    if isinstance(data, (str, Path)):
        return str(data) if "://" in str(data) else str(Path(data).expanduser().resolve())
    if cluster and _kind(data) is not None:
        raise SpaceError(
            f"{where}: a table in memory is written to this machine's cache, which the nodes of the Ray cluster "
            f"{cluster} cannot read; write it where every node can (s3://..., gs://..., a shared folder) and pass "
            "that path"
        )
    return str(frame_file(data, where))
