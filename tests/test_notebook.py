"""``docs/quickstart.ipynb`` runs headless, every cell, in a kernel of this interpreter (nbclient), so the
quickstart cannot rot: a DataFrame in, a search, the best model, its predictions and the report inline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from conftest import REPO_ROOT

NOTEBOOK = REPO_ROOT / "docs" / "quickstart.ipynb"
#: Seconds the whole notebook may take (a search, encoding included, on 2 busy cores).
NOTEBOOK_TIMEOUT_S = 1200


def _result(outputs: list) -> dict:
    """A cell's result (its ``execute_result``'s data by MIME type; empty without one)."""
    return next((output["data"] for output in outputs if output.output_type == "execute_result"), {})


def test_the_quickstart_notebook_runs_and_shows_a_model_and_its_report(
    tmp_path: Path, search_env: dict[str, str]
) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, timeout=NOTEBOOK_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute(env=search_env)  # raises CellExecutionError, with the cell and its traceback, on any error
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert not [output for cell in code for output in cell.outputs if output.output_type == "error"]
    results = {cell.source: _result(cell.outputs) for cell in code}
    searched = next(result for source, result in results.items() if source.startswith("space = {"))
    assert searched["text/plain"].startswith("SearchResult(search at ") and "1 model(s)" in searched["text/plain"]
    predicted = next(result for source, result in results.items() if source.startswith("model.predict(["))
    assert re.fullmatch(
        r"array\(\['(cars|firearms|hardware|space)', '(cars|firearms|hardware|space)'\], dtype=object\)",
        predicted["text/plain"],
    )
    printed = "".join(
        output.get("text", "") for cell in code if cell.source == "print(result.epsilon)" for output in cell.outputs
    )
    assert printed.startswith("(ε, δ) = (") and "NOT covered" in printed
    report = results["result.report()"]
    assert report["text/html"].count("data:image/png;base64,") >= 3
    assert (tmp_path / "results" / "tickets" / "report" / "index.html").is_file()
    assert (
        json.loads(
            (tmp_path / "results" / "tickets" / "models" / "eps=8_epochs=5-normalized" / "model_card.json").read_text()
        )["data"]["input_column"]
        == "text"
    )


def test_the_notebook_is_committed_valid_and_without_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    assert all(
        not cell.get("outputs") and cell.get("execution_count") is None
        for cell in notebook.cells
        if cell.cell_type == "code"
    )
