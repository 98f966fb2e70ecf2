"""The options of the ``sglang`` rollout engine: what each SGLang server is started with.

Fields that are SGLang server arguments keep SGLang's own names (``tp_size``,
``mem_fraction_static``, ``skip_tokenizer_init``...) so a reader can look them up in SGLang's
``server_args.py``; the mapping to command-line flags is the table in :mod:`command`.
Everything else (ports per engine, GPU layout, process management) is Miles' own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LogLevel = Literal["debug", "info", "warning", "error", "critical"]

#: Flags (with their SGLang aliases) whose value Miles sets per engine or from a typed
#: option; passing them again in ``extra_args`` would give SGLang two values, so they are
#: refused there, and so is any abbreviation of them (SGLang's argparse accepts unambiguous
#: prefixes, e.g. ``--tp`` for ``--tp-size``).
RESERVED_FLAGS = frozenset(
    {
        "--model-path",
        "--model",
        "--host",
        "--port",
        "--base-gpu-id",
        "--gpu-id-step",
        "--nccl-port",
        "--tp-size",
        "--tensor-parallel-size",
        "--dp-size",
        "--data-parallel-size",
        "--attn-dp-size",
        "--attention-data-parallel-size",
        "--enable-dp-attention",
        "--pp-size",
        "--pipeline-parallel-size",
        "--skip-tokenizer-init",
        "--weight-version",
        "--random-seed",
        "--api-key",
    }
)


def reserved_flag(arg: str) -> str | None:
    """The reserved flag ``arg`` sets (itself or an abbreviation of it), or ``None``."""
    flag = arg.split("=", 1)[0]
    if flag in RESERVED_FLAGS:
        return flag
    if flag.startswith("--") and len(flag) > 2:
        return next((r for r in sorted(RESERVED_FLAGS) if r.startswith(flag)), None)
    return None


class SGLangEngineConfig(BaseModel):
    """Options of the ``sglang`` rollout engine (one SGLang server process per engine).

    Engine ``i`` listens on ``port + i * port_stride`` and uses ``gpus_per_engine`` GPUs starting
    at ``base_gpu_id + i * gpus_per_engine * gpu_id_step`` of the device pool.
    """

    model_config = ConfigDict(extra="forbid")

    # --- where the servers listen ------------------------------------------------------------
    host: str | None = Field(
        None,
        description="SGLang `host`; the address the server binds (default: this node's "
        "address, MILES_NODE_ADDRESS, else 127.0.0.1); beyond loopback it requires the run's "
        "API key, MILES_API_KEY, passed as SGLang's --api-key",
    )
    port: int = Field(30000, ge=1, le=65535, description="SGLang `port` of engine 0")
    port_stride: int = Field(
        10,
        ge=1,
        description="engine i listens on port + i * port_stride; the gap leaves room for the "
        "per-engine nccl_port",
    )
    nccl_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="SGLang `nccl_port` of engine 0 (engine i: nccl_port + i * port_stride); "
        "default: SGLang picks a free one",
    )

    # --- parallelism and devices -------------------------------------------------------------
    num_engines: int = Field(
        1, ge=1, le=256, description="SGLang servers the run launches (Miles's; not a flag)"
    )
    tp_size: int = Field(1, ge=1, description="SGLang `tp_size`: tensor parallel size")
    dp_size: int = Field(1, ge=1, description="SGLang `dp_size`: data parallel replicas")
    pp_size: int = Field(1, ge=1, description="SGLang `pp_size`: pipeline parallel size")
    enable_dp_attention: bool = Field(
        False,
        description="data-parallel attention inside the TP group: the dp_size replicas "
        "become SGLang `attn_dp_size` (`--attn-dp-size`; SGLang's `--enable-dp-attention` "
        "is its deprecated spelling)",
    )
    gpus_per_engine: int | None = Field(
        None,
        ge=1,
        description="GPUs of one engine; default tp_size * pp_size (* dp_size without "
        "enable_dp_attention); must equal that when given",
    )
    base_gpu_id: int = Field(
        0, ge=0, description="SGLang `base_gpu_id` of engine 0, as an index into the device pool"
    )
    gpu_id_step: int = Field(1, ge=1, description="SGLang `gpu_id_step`")
    cuda_visible_devices: Literal["inherit", "per_engine"] = Field(
        "inherit",
        description="'inherit': every engine sees the whole pool and is given its own "
        "`base_gpu_id` (device numbers agree with the trainer's, which CUDA IPC hand-offs "
        "need); 'per_engine': CUDA_VISIBLE_DEVICES lists only the engine's own GPUs",
    )
    visible_devices: list[str] | None = Field(
        None,
        min_length=1,
        description="the device pool (CUDA ids or UUIDs); default: the launching process's "
        "CUDA_VISIBLE_DEVICES, or every device when that is unset",
    )

    # --- model and memory --------------------------------------------------------------------
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        "auto", description="SGLang `dtype`"
    )
    kv_cache_dtype: str | None = Field(
        None, pattern=r"^[a-z0-9_]+$", description="SGLang `kv_cache_dtype` (e.g. fp8_e4m3)"
    )
    context_length: int | None = Field(None, ge=1, description="SGLang `context_length`")
    mem_fraction_static: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="SGLang `mem_fraction_static`: weights + KV pool share of GPU memory; "
        "lower it when a trainer shares the GPUs",
    )
    max_running_requests: int | None = Field(
        None, ge=1, description="SGLang `max_running_requests`"
    )
    max_total_tokens: int | None = Field(None, ge=1, description="SGLang `max_total_tokens`")
    chunked_prefill_size: int | None = Field(
        None, ge=-1, description="SGLang `chunked_prefill_size`; -1 disables chunked prefill"
    )
    # SGLang's accepted backends change between releases, so the name is passed through and
    # SGLang refuses an unknown one at startup (the launcher then reports its log tail).
    attention_backend: str | None = Field(
        None,
        pattern=r"^[a-z0-9_]+$",
        description="SGLang `attention_backend` (e.g. fa3, flashinfer, triton)",
    )
    load_format: str | None = Field(
        None, pattern=r"^[a-z0-9_]+$", description="SGLang `load_format`"
    )
    tokenizer_path: str | None = Field(None, description="SGLang `tokenizer_path`")
    trust_remote_code: bool = Field(False, description="SGLang `trust_remote_code`")
    disable_radix_cache: bool = Field(False, description="SGLang `disable_radix_cache`")

    # --- what Miles relies on ----------------------------------------------------------------
    skip_tokenizer_init: bool = Field(
        True,
        description="SGLang `skip_tokenizer_init`: token ids in and out; Miles owns "
        "tokenization (token-in-token-out)",
    )
    enable_memory_saver: bool = Field(
        False,
        description="SGLang `enable_memory_saver`: makes release/resume_memory_occupation "
        "work; required for colocated placement",
    )
    enable_weights_cpu_backup: bool = Field(
        False,
        description="SGLang `enable_weights_cpu_backup`: keep a CPU copy of the weights while "
        "memory is released (needs enable_memory_saver)",
    )
    enable_deterministic_inference: bool = Field(
        False, description="SGLang `enable_deterministic_inference` (batch-invariant kernels)"
    )
    rl_on_policy_target: Literal["fsdp"] | None = Field(
        None,
        description="SGLang `rl_on_policy_target`: the trainer whose numerics the engine "
        "matches for true on-policy log-probs",
    )
    enable_return_routed_experts: bool = Field(
        False, description="SGLang `enable_return_routed_experts`: MoE routing replay"
    )
    weight_version: str = Field(
        "0", min_length=1, description="SGLang `weight_version` the servers start with"
    )
    served_model_name: str | None = Field(None, description="SGLang `served_model_name`")
    random_seed: int | None = Field(
        None,
        ge=0,
        description="SGLang `random_seed` of engine 0; engine i gets random_seed + i so the "
        "engines do not draw the same random streams",
    )

    # --- LoRA (SGLang's multi-adapter serving) -----------------------------------------------
    enable_lora: bool = Field(
        False, description="SGLang `enable_lora`: serve LoRA adapters (lora_path on /generate)"
    )
    max_lora_rank: int | None = Field(None, ge=1, description="SGLang `max_lora_rank`")
    max_loras_per_batch: int | None = Field(
        None, ge=1, description="SGLang `max_loras_per_batch`: distinct adapters in one batch"
    )
    max_loaded_loras: int | None = Field(
        None, ge=1, description="SGLang `max_loaded_loras`: adapters held at once"
    )
    lora_paths: list[str] | None = Field(
        None, description="SGLang `lora_paths`: adapters loaded at start, 'name=path' or 'path'"
    )
    lora_target_modules: list[str] | None = Field(
        None,
        description="SGLang `lora_target_modules`: the projections adapters may target "
        "(e.g. ['q_proj', 'v_proj'] or ['all'])",
    )

    # --- logs and timeouts -------------------------------------------------------------------
    log_level: LogLevel = Field("info", description="SGLang `log_level`")
    # Miles polls /health and sends many /generate requests: HTTP access lines at info level
    # would bury the server's own messages in the log file.
    log_level_http: LogLevel | None = Field("warning", description="SGLang `log_level_http`")
    skip_server_warmup: bool = Field(False, description="SGLang `skip_server_warmup`")
    watchdog_timeout: float | None = Field(
        None, gt=0, description="SGLang `watchdog_timeout` in seconds"
    )
    dist_timeout: int | None = Field(None, ge=1, description="SGLang `dist_timeout` in seconds")
    extra_args: list[str] = Field(
        default_factory=list,
        description="further launch_server arguments, appended as given (e.g. "
        "['--enable-torch-compile'])",
    )

    # --- process management (Miles) -----------------------------------------------------------
    python: str | None = Field(
        None, description="Python interpreter that runs SGLang; default: this interpreter"
    )
    server_module: str = Field(
        "sglang.launch_server",
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$",
        description="module run as `python -m <server_module>`",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="environment variables set for every server"
    )
    log_dir: str | None = Field(
        None, description="folder of the server logs (engine-<i>.log); default: a temp folder"
    )
    startup_timeout_s: float = Field(
        900.0, gt=0, description="time for /health to answer before launch fails"
    )
    wait_health_generate: bool = Field(
        False, description="after /health, also wait for /health_generate (one real generation)"
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="SIGTERM to SIGKILL delay when stopping a server"
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="total timeout of one client request; default: none"
    )

    @property
    def gpus_needed(self) -> int:
        """GPUs one SGLang server of this layout occupies."""
        replicas = 1 if self.enable_dp_attention else self.dp_size
        return self.tp_size * self.pp_size * replicas

    @property
    def engine_gpus(self) -> int:
        """``gpus_per_engine``, or what the layout needs when it is not given."""
        return self.gpus_per_engine if self.gpus_per_engine is not None else self.gpus_needed

    @model_validator(mode="after")
    def _check_combinations(self) -> SGLangEngineConfig:
        if self.gpus_per_engine is not None:
            if self.gpus_per_engine % self.tp_size:
                raise ValueError(
                    f"tp_size {self.tp_size} does not divide gpus_per_engine "
                    f"{self.gpus_per_engine}: each tensor-parallel group needs tp_size GPUs"
                )
            if self.gpus_per_engine != self.gpus_needed:
                raise ValueError(
                    f"gpus_per_engine {self.gpus_per_engine} does not match the layout: "
                    f"tp_size {self.tp_size} x pp_size {self.pp_size}"
                    + ("" if self.enable_dp_attention else f" x dp_size {self.dp_size}")
                    + f" = {self.gpus_needed} GPUs"
                )
        if self.enable_dp_attention:
            if self.dp_size < 2:
                raise ValueError("enable_dp_attention needs dp_size > 1")
            if self.tp_size % self.dp_size:
                raise ValueError(
                    f"enable_dp_attention splits the tensor-parallel group: dp_size "
                    f"{self.dp_size} must divide tp_size {self.tp_size}"
                )
        if self.enable_weights_cpu_backup and not self.enable_memory_saver:
            raise ValueError(
                "enable_weights_cpu_backup backs the weights up when memory is released, "
                "which needs enable_memory_saver: true"
            )
        if self.nccl_port is not None and self.nccl_port % self.port_stride == (
            self.port % self.port_stride
        ):
            # Engine i's nccl port would land on engine j's HTTP port.
            raise ValueError(
                f"nccl_port {self.nccl_port} and port {self.port} are congruent modulo "
                f"port_stride {self.port_stride}: an engine's nccl port would be another "
                "engine's HTTP port"
            )
        for arg in self.extra_args:
            reserved = reserved_flag(arg)
            if reserved is not None:
                flag = arg.split("=", 1)[0]
                shown = flag if flag == reserved else f"{flag} (an abbreviation of {reserved})"
                raise ValueError(
                    f"extra_args must not set {shown}: Miles sets it per engine or from its "
                    "own option; use that option instead"
                )
        return self
