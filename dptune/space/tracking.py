"""The ``tracking`` section of a search space: where a search is also logged (an MLflow tracking server).

Where results are reported, like ``--storage``, not what the search is: the section is left out of
the recorded space (``LoadedSpace.text``, its hash, the search's id; ``dptune.space.files``), so
``--set tracking.mlflow=URL`` on ``--resume`` continues, or logs, the same search.
"""

from __future__ import annotations

from typing import Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dptune.paths import check_name

#: The URL schemes ``tracking.mlflow`` accepts: a tracking server's REST API.
TRACKING_SCHEMES = ("http", "https")
#: The longest experiment name MLflow accepts.
MAX_EXPERIMENT_CHARS = 500


class TrackingSpec(BaseModel):
    """Where a search is also logged (:mod:`dptune.search.finish.tracking`); nothing by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mlflow: str | None = Field(
        None, description="the http(s):// URL of an MLflow tracking server (None: no tracking); needs dptune[mlflow]"
    )
    experiment: str | None = Field(
        None,
        description="the MLflow experiment the search is logged to, which several searches may share "
        "(None: one per search id)",
    )
    registered_model: str | None = Field(
        None,
        description="register each published model as a version of the MLflow registered model "
        "<registered_model>-<its model folder's name>: one per cell, a version per search",
    )

    @field_validator("mlflow")
    @classmethod
    def _server_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        allowed = (
            "expected the http:// or https:// URL of an MLflow tracking server, e.g. http://127.0.0.1:5000; "
            "credentials go in MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN, "
            "not in the URL"
        )
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:  # an unclosed [ of an IPv6 host, a port that is not a number in 0..65535
            raise ValueError(allowed) from None
        if parts.scheme.lower() not in TRACKING_SCHEMES or not parts.hostname or "@" in parts.netloc or port == 0:
            raise ValueError(allowed)
        return value.rstrip("/")

    @field_validator("experiment")
    @classmethod
    def _experiment_name(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip() or not value.isprintable() or len(value) > MAX_EXPERIMENT_CHARS:
            raise ValueError(
                f"expected an MLflow experiment name: printable characters, not only spaces, at most "
                f"{MAX_EXPERIMENT_CHARS} of them"
            )
        return value

    @field_validator("registered_model")
    @classmethod
    def _model_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, "the registered model's name")

    @model_validator(mode="after")
    def _needs_server(self) -> Self:
        if self.registered_model is not None and self.mlflow is None:
            raise ValueError("registered_model needs mlflow (the tracking server whose registry holds the model)")
        if self.experiment is not None and self.mlflow is None:
            raise ValueError("experiment needs mlflow (the tracking server that holds the experiment)")
        return self
