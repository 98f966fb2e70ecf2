"""The ``diffusion`` rollout engine: its options and the launcher of its servers.

The launcher is the embedded engine's (:class:`miles_engine_embedded.launcher.EmbeddedLauncher`:
one subprocess per engine, ``/health`` polled until it answers) with the diffusion server's
command line and client. Importing this module imports neither torch nor diffusers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from miles_engine_embedded.launcher import EmbeddedLauncher
from pydantic import BaseModel, ConfigDict, Field

from miles_core.hosts import resolve_host

if TYPE_CHECKING:
    from miles_diffusion.client import DiffusionEngineClient


class DiffusionEngineConfig(BaseModel):
    """Options of the diffusion engine (one server process per launched engine, on the CPU)."""

    model_config = ConfigDict(extra="forbid")

    num_engines: int = Field(1, ge=1, le=64, description="engine servers the run launches")
    host: str | None = Field(
        None, description="address the server binds; default: its node's (127.0.0.1 on one machine)"
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="port of engine 0 (engine i uses port + i); default: a free port",
    )
    seed: int = Field(0, ge=0, description="seeds the server draws for requests without one")
    weight_version: str = "0"
    num_threads: int = Field(1, ge=1, description="torch threads per server")
    startup_timeout_s: float = Field(300.0, gt=0)
    log_dir: str | None = Field(
        None,
        description="folder of the server logs (engine-<i>.log), as the embedded engine's "
        "log_dir; default: a temp folder that keeps only the logs of engines that died",
    )
    dist_timeout: float = Field(
        120.0,
        gt=0,
        description="limit of every wait in a weight-update group (SGLang's --dist-timeout)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    max_running_requests: int = Field(
        16, ge=1, le=4096, description="reported in /server_info; batches run one at a time"
    )
    launch_in: Literal["process", "ray_actor"] = Field(
        "process",
        description="process: a subprocess of the caller; ray_actor: each server is started by "
        "a Ray actor on the node Ray places it (needed by run.placement: disaggregated)",
    )
    ray_num_cpus: float = Field(1.0, ge=0, description="CPUs each engine actor reserves")
    ray_num_gpus: float = Field(0.0, ge=0, description="GPUs each engine actor reserves")


class DiffusionLauncher(EmbeddedLauncher):
    """Launches ``python -m miles_diffusion.server`` processes and stops them (the
    :class:`miles_core.contracts.EngineLauncher` contract)."""

    options: DiffusionEngineConfig  # type: ignore[assignment]

    def __init__(self, options: DiffusionEngineConfig) -> None:
        super().__init__(options)  # type: ignore[arg-type]

    server_module = "miles_diffusion.server"

    def forks(self) -> bool:
        """The diffusion server runs on the CPU: forked unless :attr:`fork` is off."""
        return self.fork

    def server_args(self, model_path: str, port: int) -> list[str]:
        """The server's arguments for the model folder ``model_path`` on ``port``."""
        o = self.options
        return [
            "--model-path", model_path,
            "--host", resolve_host(o.host),
            "--port", str(port),
            "--seed", str(o.seed),
            "--weight-version", o.weight_version,
            "--num-threads", str(o.num_threads),
            "--dist-timeout", str(o.dist_timeout),
            "--log-level", o.log_level,
            "--max-running-requests", str(o.max_running_requests),
        ]  # fmt: skip

    def client(self, url: str, *, timeout_s: float | None = None) -> DiffusionEngineClient:  # type: ignore[override]
        """A :class:`miles_diffusion.client.DiffusionEngineClient` for the server at ``url``."""
        from miles_diffusion.client import DiffusionEngineClient

        return DiffusionEngineClient(url, timeout_s=timeout_s)


def process_launcher(options: dict[str, Any]) -> DiffusionLauncher:
    """The process launcher an engine's Ray actor runs, from the options as JSON."""
    return DiffusionLauncher(DiffusionEngineConfig.model_validate(options))


def ray_launcher(options: DiffusionEngineConfig) -> Any:
    """The launcher of ``launch_in: ray_actor``: the embedded engine's Ray launcher, its
    actors running :func:`process_launcher`, and the diffusion client."""
    from miles_engine_embedded.ray_launcher import RayEmbeddedLauncher

    class RayDiffusionLauncher(RayEmbeddedLauncher):
        host = "miles_diffusion.engine:process_launcher"

        def client(self, url: str, *, timeout_s: float | None = None) -> Any:
            from miles_diffusion.client import DiffusionEngineClient

            return DiffusionEngineClient(url, timeout_s=timeout_s)

    return RayDiffusionLauncher(options)


def build(options: DiffusionEngineConfig | None = None, **kw: Any) -> Any:
    """Factory registered with Miles: ``factory(options) -> EngineLauncher``. True on-policy
    mode (``true_on_policy=True``, from ``rollout.true_on_policy``) is refused: its
    batch-invariant kernels cover the text engine's transformer, not a UNet."""
    if kw.pop("true_on_policy", False):
        raise ValueError(
            "the diffusion engine does not support rollout.true_on_policy: its batch-invariant "
            "kernels cover text models only (set rollout.true_on_policy: false)"
        )
    if kw:
        raise TypeError(f"the diffusion engine's factory takes no {sorted(kw)}")
    options = options or DiffusionEngineConfig()
    if options.launch_in == "ray_actor":
        return ray_launcher(options)
    return DiffusionLauncher(options)
