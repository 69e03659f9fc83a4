"""A published model as an MLflow pyfunc model (:mod:`dptune.search.finish.mlflow_model`), without a server:
its signature and its predictions, for a model on embeddings (backbone ``none``). The pyfunc of a text
model, registered and loaded from a real server after a real search: ``tests/test_mlflow_tracking.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from test_owner_evaluation import CLASSES as EMBEDDING_CLASSES
from test_owner_evaluation import _model as embeddings_model


def test_an_embeddings_model_s_pyfunc_takes_arrays_of_numbers(tmp_path: Path) -> None:
    import mlflow.pyfunc

    from dptune.model import load_model
    from dptune.search.finish.mlflow_model import save_pyfunc

    folder = embeddings_model(tmp_path / "model", EMBEDDING_CLASSES)
    save_pyfunc(folder, tmp_path / "pyfunc")
    pyfunc = mlflow.pyfunc.load_model(str(tmp_path / "pyfunc"))
    (spec,) = pyfunc.metadata.get_input_schema().inputs
    assert (spec.name, str(spec.type)) == ("embedding", "Array(double)")
    one_hot = np.eye(len(EMBEDDING_CLASSES))
    as_lists = pd.DataFrame({"embedding": [list(one_hot[i]) for i in (2, 0, 3)]})  # float64, as JSON gives them
    as_float32 = pd.DataFrame({"embedding": list(one_hot[[2, 0, 3]].astype(np.float32))})
    expected = load_model(folder).predict_frame(as_lists)
    assert expected["prediction"].tolist() == [EMBEDDING_CLASSES[i] for i in (2, 0, 3)]
    for frame in (as_lists, as_float32):
        pd.testing.assert_frame_equal(pyfunc.predict(frame), expected)


def test_a_folder_that_is_no_model_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from dptune.model import ModelError
    from dptune.search.finish.mlflow_model import save_pyfunc

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="not a dptune model folder"):
        save_pyfunc(tmp_path / "empty", tmp_path / "pyfunc")
    assert not (tmp_path / "pyfunc").exists()
