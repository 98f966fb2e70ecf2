"""Registers the ``embedded`` rollout engine with Miles."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_core import RolloutEngine, hookimpl

if TYPE_CHECKING:
    from miles_core.config import RunConfig


class EmbeddedEngineConfig(BaseModel):
    """Options of the embedded engine (one server process per launched engine)."""

    model_config = ConfigDict(extra="forbid")

    num_engines: int = Field(1, ge=1, le=64, description="engine servers the run launches")
    device: str = Field("cpu", description="torch device of the model, e.g. 'cpu' or 'cuda:0'")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_running_requests: int = Field(16, ge=1, le=4096)
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="KV budget in tokens over all running requests (default: "
        "max_running_requests x context_length)",
    )
    context_length: int | None = Field(
        None, ge=2, description="longest prompt + completion (default: the model's maximum)"
    )
    host: str | None = Field(
        None,
        description="address each server binds and advertises (default: this node's address, "
        "MILES_NODE_ADDRESS, else 127.0.0.1); beyond loopback the server requires the run's "
        "API key, MILES_API_KEY",
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="port of engine 0 (engine i uses port + i); default: a free port",
    )
    seed: int = Field(0, ge=0)
    weight_version: str = "0"
    num_threads: int | None = Field(None, ge=1, description="torch threads per server")
    startup_timeout_s: float = Field(300.0, gt=0)
    log_dir: str | None = Field(
        None,
        description="folder of the server logs (engine-<i>.log; a restarted engine appends to "
        "its own); default: a temp folder, where the log of an engine stopped when asked is "
        "removed with it and that of an engine that died or failed to start is kept",
    )
    dist_timeout: float = Field(
        120.0,
        gt=0,
        description="limit of every wait in a weight-update group (SGLang's --dist-timeout): "
        "how long a receive blocks when the sender or another engine of the group died",
    )
    max_weights_body_mb: float = Field(
        256.0,
        gt=0,
        description="largest body (MiB) the weight-update and LoRA adapter endpoints accept; "
        "one declared larger is refused (413) before it is read",
    )
    lean_forward: bool = Field(
        True,
        description="use the lean forward for Llama/Mistral/Qwen2/Qwen3 and Qwen3-MoE/Mixtral "
        "(same operations as transformers, less Python overhead); False always uses the "
        "model's own forward",
    )
    matmul: Literal["auto", "linear", "transposed"] = Field(
        "auto",
        description="layout of the lean forward's dense products: x @ W^T (linear) or "
        "(W @ x^T)^T (transposed), the same product through different BLAS kernels; auto "
        "measures once per server which is faster on this machine at each batch size, and "
        "pads a batch size on a slow path to a faster one (models under 32 MiB of weights: "
        "linear, unpadded)",
    )
    attention: Literal["auto", "native", "sdpa"] = Field(
        "auto",
        description="the lean forward's decode attention: native (C kernels built at start "
        "with the machine's compiler, float32 on the CPU: each row reads only its own "
        "positions of the KV cache; the same library then also runs the dense layers' "
        "element-wise steps and the plain draw), sdpa (torch's scaled_dot_product_attention "
        "over the batch under a mask, torch's operations elsewhere); auto: native where it "
        "applies and builds, else sdpa",
    )
    true_on_policy: bool = Field(
        False,
        description="batch-invariant kernels (miles_core.invariant; float32, the model's own "
        "forward): every log-prob is bitwise what a trainer in the same mode computes. Set by "
        "the run config's rollout.true_on_policy",
    )
    allow_nonfinite_weights: bool = Field(
        False,
        description="accept weight updates holding NaN or infinite values (refused by "
        "default: the update answers 400 and the engine keeps its weights and version)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    # SGLang's LoRA options (same names, same defaults)
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (SGLang's LoRA API; implied by lora_paths)"
    )
    max_lora_rank: int = Field(64, ge=1, description="largest adapter rank a load accepts")
    max_loras_per_batch: int = Field(
        8, ge=1, description="distinct adapters (the base model counting as one) in one batch"
    )
    max_loaded_loras: int | None = Field(
        None, ge=1, description="adapters held at once (default: no limit)"
    )
    lora_paths: list[str] | None = Field(
        None, description="adapters loaded at start: 'name=path' (or 'path', named by it)"
    )
    lora_target_modules: list[str] | None = Field(
        None,
        description="projections adapters may target (q_proj k_proj v_proj o_proj gate_proj "
        "up_proj down_proj, or 'all'; default all)",
    )
    launch_in: Literal["process", "ray_actor"] = Field(
        "process",
        description="process: a subprocess of the caller; ray_actor: each server is started by "
        "a Ray actor on the node Ray places it (the actor owns the server process)",
    )
    ray_num_cpus: float = Field(1.0, ge=0, description="CPUs each engine actor reserves")
    ray_num_gpus: float = Field(0.0, ge=0, description="GPUs each engine actor reserves")


def check(config: RunConfig) -> str | None:
    """Refuse a run that trains an adapter on engines started without LoRA."""
    options = getattr(config.engine, "options", None)
    if (
        config.adapter is not None
        and isinstance(options, EmbeddedEngineConfig)
        and not (options.enable_lora or options.lora_paths)
    ):
        return (
            f"adapter {config.adapter.name!r}: the engines serve the trained adapter, which "
            "needs engine option enable_lora: true (and max_lora_rank at least the adapter's "
            "rank)"
        )
    return None


@hookimpl
def miles_register_rollout_engines(register):  # type: ignore[no-untyped-def]
    """Register the embedded engine."""
    register(
        RolloutEngine(
            name="embedded",
            factory="miles_engine_embedded.launcher:build",
            config=EmbeddedEngineConfig,
            description="torch-native engine serving SGLang's native HTTP API (continuous "
            "batching, KV cache); runs anywhere, CPU included",
            devices=("cpu",),  # the device option accepts cuda, but no GPU run was made
            # SGLang's three weight-update/memory capabilities, its prompt log-probs and its LoRA
            # API; Miles's own NIXL receiver at /miles/p2p_weights, adapters committed by
            # broadcast and p2p updates, and weights copied from a peer engine (/miles/weights)
            capabilities=frozenset(
                {
                    "input_logprobs",
                    "lora",
                    "lora_weight_updates",
                    "routed_experts",
                    "true_on_policy",
                    "update_weights_from_tensor",
                    "update_weights_from_distributed",
                    "p2p_weights",
                    "memory_occupation",
                    "weights_from_peer",
                }
            ),
            check=check,
            requires={"modality": ("text",)},  # token ids in, token ids out
        )
    )
