"""The `tracking` section of a run spec: which experiment tracker (TensorBoard, MLflow, Weights & Biases)
receives a run's per-round series and its final figures (eval/tracking.py writes them).

The spec names where the tracker is, never how to log in: a tracker's credentials (WANDB_API_KEY,
MLFLOW_TRACKING_TOKEN, ...) come from the environment of the process that writes, the island's worker
or the control plane, and learner processes never inherit them. A tracker server the spec names must be
the one that process is configured for (eval/tracking.py's `check_endpoint`), so a spec cannot send a
worker's token to a host of its choosing.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from infra.spec.base import SpecModel

# The variables trackers read their credentials from: withheld from learner processes (infra/supervision.py).
TRACKER_CREDENTIALS = ("WANDB_API_KEY", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                       "MLFLOW_TRACKING_TOKEN", "DATABRICKS_TOKEN", "DATABRICKS_CLIENT_SECRET")


class TrackingSpec(SpecModel):
    """The experiment tracker a run is logged to. The default is none: a run's report and artifacts
    need no tracker."""

    backend: Literal["none", "tensorboard", "mlflow", "wandb"] = Field(
        "none", description="Experiment tracker the islands' workers log each learner's rounds to, and the control "
                            "plane the run's final figures: none, tensorboard, mlflow or wandb (each needs its "
                            "package: pip install 'archipelago[<backend>]').")
    uri: str | None = Field(
        None, max_length=1024,
        description="tensorboard: the folder event files go to (a run's are under <uri>/<run id>; a shared "
                    "filesystem when islands run on several machines). mlflow: the tracking URI (http(s)://host, "
                    "sqlite:///path.db, a folder). wandb: a folder for its local files, or the http(s) base URL of "
                    "a W&B server (empty: wandb's defaults). A server must be the one each writing process is "
                    "configured for ($MLFLOW_TRACKING_URI, $WANDB_BASE_URL), which its credentials go to: the spec "
                    "only names it. Never credentials: those come from the writing process's environment "
                    "(WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ...).")
    project: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
        description="MLflow experiment or W&B project the run is logged under (empty: the spec's name). Every "
                    "learner of a run logs to one tracker run named by the run id.")
    flush_every_s: float = Field(
        10.0, gt=0, le=3600, description="A writer sends what it buffered at least this often (seconds), and when "
                                         "it closes: a remote tracker gets batches, not a request per round.")
    flush_every_records: int = Field(500, ge=1, le=100_000,
                                     description="... or as soon as it has buffered this many values.")

    @model_validator(mode="after")
    def _uri_fits_the_backend(self) -> "TrackingSpec":
        if self.backend == "none":
            if self.uri is not None or self.project is not None:
                raise ValueError("uri and project need a backend (tensorboard, mlflow or wandb); backend is none")
            return self
        if self.uri is None:
            if self.backend in ("tensorboard", "mlflow"):
                raise ValueError(f"backend {self.backend} needs uri: "
                                 + ("the folder its event files go to" if self.backend == "tensorboard" else
                                    "the MLflow tracking URI (http(s)://host, sqlite:///path.db or a folder)"))
            return self
        # The messages never repeat the URI: it may hold the credentials they refuse.
        try:
            parts = urlsplit(self.uri)
            parts.port  # a malformed port raises only when read
        except ValueError:
            raise ValueError("uri: not a valid URI or folder") from None
        if parts.username is not None or parts.password is not None:
            raise ValueError("uri must not carry credentials (user:password@host); a tracker's credentials come "
                             "from the environment of the process that logs (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, "
                             "MLFLOW_TRACKING_USERNAME/PASSWORD)")
        if parts.query or parts.fragment:
            raise ValueError("uri must not have a query string or fragment (where tokens would go)")
        if self.backend == "tensorboard" and parts.scheme:
            raise ValueError("backend tensorboard: uri is a folder (local, or a shared filesystem), not a URL")
        if self.backend == "wandb" and parts.scheme and (parts.scheme not in ("http", "https") or not parts.hostname):
            raise ValueError("backend wandb: uri is a folder or the http(s):// base URL of a W&B server")
        return self

    def project_of(self, spec_name: str) -> str:
        return self.project or spec_name
