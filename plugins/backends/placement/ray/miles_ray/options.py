"""Options of the Ray placement: the run config's ``plugins.options.ray`` section, or else the
``MILES_RAY`` environment variable.

```yaml
plugins:
  options:
    ray: {trainer_cpus: 2, strategy: SPREAD}
```

``MILES_RAY`` holds the same mapping as YAML (or JSON), for a cluster-wide default; a run's
own section wins over it. Unset means every default. A bad value is a
:class:`~miles_core.errors.ConfigError` naming ``plugins.options.ray.<field>`` (or
``MILES_RAY.<field>``) and what is allowed, raised before Ray starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles_core.config import format_validation_error
from miles_core.errors import ConfigError

ENV = "MILES_RAY"
SECTION = "plugins.options.ray"


class RayOptions(BaseModel):
    """Where the Ray cluster is and what the trainer's actor reserves.

    What each engine's actor reserves is the engine's own option (the embedded engine's
    ``ray_num_cpus`` / ``ray_num_gpus``): the placement sizes the engines' bundles from it.
    """

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None,
        description="Ray cluster to join ('auto', 'host:port', 'ray://...'); default: "
        "RAY_ADDRESS if set, else a local cluster started for the run and stopped after it",
    )
    node_address: str | None = Field(
        None,
        description="the address of the node this process is on, when it joins a cluster "
        "(Ray's node IP; default: Ray's guess). Needed where the process runs on none of the "
        "cluster's node addresses, e.g. a cluster of loopback addresses on one machine",
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a local cluster (default: Ray counts the machine's)"
    )
    num_gpus: int | None = Field(
        None, ge=0, description="GPUs of a local cluster (default: Ray counts the machine's)"
    )
    object_store_mb: int | None = Field(
        None, ge=75, description="object store of a local cluster, MiB (default: Ray's)"
    )
    log_to_driver: bool = Field(
        False,
        description="print the actors' stdout/stderr in the driver (else they stay in Ray's "
        "session logs); only for a cluster the run starts or joins itself",
    )
    trainer_cpus: float = Field(1.0, ge=0, description="CPUs each trainer rank's actor reserves")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs each trainer rank's actor reserves")
    nodes: int = Field(
        1,
        ge=1,
        description="colocated: the nodes the run spans, each holding world_size / nodes "
        "trainer ranks and num_engines / nodes engines that share their devices (one bundle "
        "a node); disaggregated: unused (a bundle per rank and per engine)",
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None,
        description="placement-group strategy across nodes; default: STRICT_SPREAD for a "
        "colocated run over several nodes, PACK otherwise",
    )
    ready_timeout_s: float = Field(
        60.0,
        gt=0,
        description="how long to wait for the cluster to reserve the placement group before "
        "refusing the run (a request the cluster cannot hold would wait forever)",
    )
    placement_timeout_s: float = Field(
        60.0,
        gt=0,
        description="how long an engine's actor may wait for a node with room (its bundle's "
        "node gone, or a joining engine's) before that engine's start fails",
    )
    actor_timeout_s: float = Field(
        600.0, gt=0, description="limit of the trainer actor's start and of its set-up"
    )
    join_new_nodes: bool = Field(
        False,
        description="a node that joins the cluster while the run goes on gets engines: at each "
        "step's start, as many join the job as the new nodes' resources hold (one engine's "
        "reservation each; a disaggregated run only)",
    )
    max_engines: int | None = Field(
        None,
        ge=1,
        description="with join_new_nodes, the most engines the job grows to (null: no limit)",
    )
    shm_cleanup_timeout_s: float = Field(
        30.0,
        ge=0,
        description="at release, how long to wait for the trainer actors' processes (and the "
        "engines mapping their memory) to end before their shared memory in /dev/shm is "
        "removed",
    )

    @classmethod
    def from_config(cls, config: Any, environ: Mapping[str, str] | None = None) -> RayOptions:
        """The run config's ``plugins.options.ray`` when it has one, else ``MILES_RAY``."""
        raw = config.plugins.options.get("ray")
        if raw is None:
            return cls.from_env(environ)
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, SECTION, cls), source=SECTION) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RayOptions:
        """Validate ``MILES_RAY`` (an unset or empty variable gives the defaults)."""
        env = os.environ if environ is None else environ
        text = env.get(ENV, "").strip()
        raw: Any = {}
        if text:
            try:
                raw = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ConfigError([f"not valid YAML: {exc}"], source=ENV) from None
            if raw is None:
                raw = {}
            if not isinstance(raw, dict):
                raise ConfigError(
                    [f"expected a mapping of options, got {type(raw).__name__}"], source=ENV
                )
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, ENV, cls), source=ENV) from None
