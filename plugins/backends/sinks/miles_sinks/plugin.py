"""Registration with Miles: the ``wandb`` and ``mlflow`` metric sinks.

Both log every step's metrics at that step, and on ``open`` the run's config (read from the
``run.json`` the run writes in its folder before it opens the sinks) as the W&B run config or
as MLflow params. ``wandb`` and ``mlflow`` are imported in ``open`` only, so listing the plugins
or validating a config that does not select these sinks never imports them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_core import hookimpl
from miles_core.components import MetricSink

#: MLflow's limits: params and metrics per ``log_batch`` call, and a param value's length.
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_METRICS_PER_BATCH = 1000
_MLFLOW_PARAM_CHARS = 6000


def _run_config(run_dir: str) -> dict[str, Any]:
    """The run's config as ``run.json`` in the run folder records it (empty without one: a sink
    opened outside a run, as the contract checks do)."""
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text()).get("config")
    return config if isinstance(config, dict) else {}


def _flat(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted.key, value)`` for every leaf of a nested config; a list is one JSON value."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _flat(value, name + ".")
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            yield name, text[:_MLFLOW_PARAM_CHARS]


class WandbSinkOptions(BaseModel):
    """Options of the ``wandb`` metric sink."""

    model_config = ConfigDict(extra="forbid")
    project: str = Field("miles", description="W&B project")
    entity: str | None = Field(None, description="W&B team or user (None = the default one)")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline",
        description="offline (default) writes the run under `dir` with no network, to upload "
        "later with `wandb sync`; online sends it to the W&B server as it runs",
    )
    dir: str | None = Field(None, description="where W&B writes (None = the run folder)")
    name: str | None = Field(None, description="the W&B run's name (None = run.name)")
    tags: list[str] = Field(default_factory=list, description="tags of the W&B run")


class WandbSink:
    """One W&B run per Miles run: the config on ``open``, every step's metrics at their step,
    finished on ``close``. A resumed Miles run is a new W&B run."""

    def __init__(self, options: WandbSinkOptions) -> None:
        self.options = options
        self._run: Any = None

    def open(self, run_dir: str) -> None:
        """Start the W&B run (offline unless the options ask otherwise)."""
        import wandb

        config = _run_config(run_dir)
        opts = self.options
        self._run = wandb.init(
            project=opts.project,
            entity=opts.entity,
            mode=opts.mode,
            dir=opts.dir or run_dir,
            name=opts.name or config.get("run", {}).get("name") or Path(run_dir).name,
            tags=opts.tags or None,
            config=config,
            # stdout stays the run's own: its last line is the summary a caller parses.
            settings=wandb.Settings(console="off", silent=True),
            reinit="create_new",
        )

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one step."""
        if self._run is None:
            raise RuntimeError("WandbSink.write before open")
        self._run.log({k: float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        """Finish the W&B run (writes its last history row)."""
        if self._run is not None:
            self._run.finish()
            self._run = None


class MlflowSinkOptions(BaseModel):
    """Options of the ``mlflow`` metric sink."""

    model_config = ConfigDict(extra="forbid")
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI (None = file:<run folder>/mlruns, a local file store)",
    )
    experiment: str = Field("miles", description="experiment name, created if missing")
    run_name: str | None = Field(None, description="the MLflow run's name (None = run.name)")


class MlflowSink:
    """One MLflow run per Miles run: the config as params on ``open`` (dotted keys), every
    step's metrics at their step, the run ended on ``close``.

    In a ``file:`` store each metric is a file named by its key, so ``train/clip_fraction`` and
    ``train/clip_fraction/low`` cannot both exist: there a metric's ``/`` is written as ``.``
    (``train.clip_fraction.low``); other stores get the keys as they are."""

    def __init__(self, options: MlflowSinkOptions) -> None:
        self.options = options
        self._client: Any = None
        self._run_id: str | None = None
        self._separator = "/"

    def open(self, run_dir: str) -> None:
        """Create (or find) the experiment and start the MLflow run."""
        uri = self.options.tracking_uri or (Path(run_dir).resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store unless allowed; a local store needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self._separator = "."
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(self.options.experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(self.options.experiment)
        )
        config = _run_config(run_dir)
        name = self.options.run_name or config.get("run", {}).get("name") or Path(run_dir).name
        self._run_id = run_id = client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, v) for k, v in _flat(config)]
        for i in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[i : i + _MLFLOW_PARAMS_PER_BATCH])

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one step."""
        if self._client is None or self._run_id is None:
            raise RuntimeError("MlflowSink.write before open")
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        sep = self._separator
        batch = [Metric(k.replace("/", sep), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), _MLFLOW_METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=batch[i : i + _MLFLOW_METRICS_PER_BATCH])

    def close(self) -> None:
        """End the MLflow run."""
        if self._client is not None and self._run_id is not None:
            self._client.set_terminated(self._run_id)
        self._client = self._run_id = None


@hookimpl
def miles_register_metric_sinks(register):  # type: ignore[no-untyped-def]
    register(
        MetricSink(
            name="wandb",
            factory=WandbSink,
            config=WandbSinkOptions,
            description="Weights & Biases run (offline by default: no network)",
        )
    )
    register(
        MetricSink(
            name="mlflow",
            factory=MlflowSink,
            config=MlflowSinkOptions,
            description="MLflow run (default: a local file store in the run folder)",
        )
    )
