"""A published model as an MLflow pyfunc model (``MLmodel``): what :mod:`dptune.search.finish.tracking` logs,
so that ``mlflow.pyfunc.load_model("models:/<name>/<version>")`` and ``mlflow models serve`` take it.

The pyfunc (:func:`save_pyfunc`) holds the model folder (``model.safetensors``, ``model_card.json``,
``model_card.md``) as its artifact ``ARTIFACT_KEY``; its :class:`DptunePyfunc` loads it with
:func:`dptune.model.load_model` and its ``predict`` takes a pandas DataFrame holding the model's input
column (``Model.input_column``: texts, image file paths, or embeddings for backbone ``none``) and returns
what ``python -m dptune.predict`` appends per row (``Model.predict_frame``: the predicted class name and
its softmax score), indexed as the input. Its signature names that column (a string, or an array of
floats for embeddings) and the two outputs; its environment is ``dptune==<this version>``. No input
example is stored: it would be a row of the (private) training data.

:func:`log_pyfunc` logs it in a run; :func:`register_version` makes it a version of the registered model
of its cell (:func:`registered_name`). Needs MLflow's client (``dptune[mlflow]``): import this module
only where it is used.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models.signature import ModelSignature
from mlflow.pyfunc import save_model
from mlflow.pyfunc.model import PythonModel, PythonModelContext
from mlflow.tracking import MlflowClient
from mlflow.types.schema import Array, ColSpec, DataType, Schema

from dptune import __version__
from dptune.contract import NO_BACKBONE
from dptune.model import load_model
from dptune.search.finish.publish import model_name

#: The pyfunc's artifact that holds the model folder (``context.artifacts[ARTIFACT_KEY]`` when loaded).
ARTIFACT_KEY = "dptune_model"
#: The columns ``predict`` returns (``Model.predict_frame``'s): the class name, its softmax score (float32).
OUTPUT_SCHEMA = Schema([ColSpec(DataType.string, "prediction"), ColSpec(DataType.float, "softmax_score")])
#: The key of ``MLmodel``'s metadata under which dptune states its version and the model's folder name.
METADATA_KEY = "dptune"


class DptunePyfunc(PythonModel):
    """A dptune model as MLflow loads it: the folder in artifact ``ARTIFACT_KEY``, read by ``load_model``."""

    def load_context(self, context: PythonModelContext) -> None:
        self.model = load_model(context.artifacts[ARTIFACT_KEY])

    def predict(
        self, context: PythonModelContext, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        """``prediction`` (class name) and ``softmax_score`` per row of ``model_input`` (a DataFrame holding
        the model's input column), indexed as ``model_input``."""
        return self.model.predict_frame(model_input)


def signature(card: dict[str, Any], column: str) -> ModelSignature:
    """The pyfunc's signature: ``column`` holds strings (texts, image file paths) or, for a model on
    embeddings (backbone ``none``), arrays of floats; the outputs are ``OUTPUT_SCHEMA``."""
    kind = Array(DataType.double) if card["data"]["backbone"] == NO_BACKBONE else DataType.string
    return ModelSignature(inputs=Schema([ColSpec(kind, column)]), outputs=OUTPUT_SCHEMA)


def save_pyfunc(folder: Path, destination: Path) -> None:
    """Write the pyfunc model of the published model ``folder`` to the new folder ``destination``."""
    model = load_model(folder)  # a folder that is no dptune model is refused here, not when it is served
    with warnings.catch_warnings():  # no input example, by design (above); cloudpickle keeps a reference
        warnings.simplefilter("ignore", UserWarning)
        save_model(
            str(destination),
            python_model=DptunePyfunc(),
            artifacts={ARTIFACT_KEY: str(folder)},
            signature=signature(model.card, model.input_column),
            pip_requirements=[f"dptune=={__version__}"],
            metadata={METADATA_KEY: {"version": __version__, "model": model_name(**_cell(model.card))}},
        )


def log_pyfunc(client: MlflowClient, run_id: str, folder: Path, artifact_path: str) -> None:
    """The pyfunc model of the published model ``folder`` as the run's artifacts ``artifact_path``."""
    with tempfile.TemporaryDirectory(prefix="dptune-mlflow-") as temporary:
        pyfunc = Path(temporary, artifact_path)
        save_pyfunc(folder, pyfunc)
        client.log_artifacts(run_id, str(pyfunc), artifact_path)


def register_version(
    client: MlflowClient, base: str, card: dict[str, Any], source: str, run_id: str, search_id: str
) -> None:
    """The model of ``card`` logged at ``source`` (``runs:/<run_id>/<path>``) as a version of its cell's
    registered model (:func:`registered_name`, created if missing), unless its run has one there already."""
    name = registered_name(base, card)
    cell = {"dptune.cell_id": card["model"]["cell_id"], "dptune.clipping": card["model"]["clipping"]}
    try:
        client.get_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        client.create_registered_model(name, tags=cell)
    if client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        return
    privacy = card["privacy"]
    client.create_model_version(
        name,
        source,
        run_id=run_id,
        tags={**cell, "dptune.search_id": search_id},
        description=f"dptune model of {cell['dptune.cell_id']} [{cell['dptune.clipping']}] from search {search_id}, "
        f"(ε, δ) = ({privacy['epsilon']:.4g}, {privacy['delta']:.3g}) covering {privacy['covers']}",
        await_creation_for=0,
    )


def registered_name(base: str, card: dict[str, Any]) -> str:
    """The registered model of a published model's cell: ``<base>-<its model folder's name>``
    (``publish.model_name``: the cell id and clipping rule in file-name-safe characters, which MLflow
    accepts), e.g. ``news-eps=8_delta=1e-05_epochs=5-normalized``."""
    return f"{base}-{model_name(**_cell(card))}"


def _cell(card: dict[str, Any]) -> dict[str, str]:
    return {"cell_id": card["model"]["cell_id"], "clipping": card["model"]["clipping"]}
