"""The command line and environment of SGLang server ``i``: pure functions of the options.

Flag names are SGLang's own (``python -m sglang.launch_server --help``; the fields of
``ServerArgs`` in ``sglang/srt/server_args.py``, ``tp_size`` -> ``--tp-size``), checked by the
engine client's tests against the flags SGLang 0.5.23 defines. Nothing here starts a
process, so every mapping is unit-tested without SGLang.

A server binds ``host``, by default its node's address (:func:`miles_core.hosts.resolve_host`).
With the run's API key (``MILES_API_KEY``) it is started with SGLang's ``--api-key``; without
one, a host beyond loopback is refused (:class:`~miles_engine_client.binding.BindRefused`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from miles_core.hosts import api_key, resolve_host
from miles_engine_sglang.options import SGLangEngineConfig

#: what a logged command line shows in place of the API key
HIDDEN = "<MILES_API_KEY>"

#: Option -> flag for options that take a value (``None`` leaves SGLang's default).
VALUE_FLAGS: dict[str, str] = {
    "tp_size": "--tp-size",
    "dp_size": "--dp-size",
    "pp_size": "--pp-size",
    "dtype": "--dtype",
    "kv_cache_dtype": "--kv-cache-dtype",
    "context_length": "--context-length",
    "mem_fraction_static": "--mem-fraction-static",
    "max_running_requests": "--max-running-requests",
    "max_total_tokens": "--max-total-tokens",
    "chunked_prefill_size": "--chunked-prefill-size",
    "attention_backend": "--attention-backend",
    "load_format": "--load-format",
    "tokenizer_path": "--tokenizer-path",
    "rl_on_policy_target": "--rl-on-policy-target",
    "weight_version": "--weight-version",
    "served_model_name": "--served-model-name",
    "log_level": "--log-level",
    "log_level_http": "--log-level-http",
    "watchdog_timeout": "--watchdog-timeout",
    "dist_timeout": "--dist-timeout",
    "max_lora_rank": "--max-lora-rank",
    "max_loras_per_batch": "--max-loras-per-batch",
    "max_loaded_loras": "--max-loaded-loras",
}

#: Option -> flag for list options (SGLang's ``nargs="*"`` flags; the flag, then each value).
LIST_FLAGS: dict[str, str] = {
    "lora_paths": "--lora-paths",
    "lora_target_modules": "--lora-target-modules",
}

#: Option -> flag for on/off options (SGLang's ``store_true`` flags; given only when true).
SWITCH_FLAGS: dict[str, str] = {
    "trust_remote_code": "--trust-remote-code",
    "disable_radix_cache": "--disable-radix-cache",
    "skip_tokenizer_init": "--skip-tokenizer-init",
    "enable_memory_saver": "--enable-memory-saver",
    "enable_weights_cpu_backup": "--enable-weights-cpu-backup",
    "enable_deterministic_inference": "--enable-deterministic-inference",
    "enable_return_routed_experts": "--enable-return-routed-experts",
    "skip_server_warmup": "--skip-server-warmup",
    "enable_lora": "--enable-lora",
}


#: With ``enable_dp_attention`` the ``dp_size`` replicas are data-parallel attention groups
#: inside the tensor-parallel group. SGLang 0.5.23 spells that ``--attn-dp-size N`` (its
#: ``--dp-size N --enable-dp-attention`` is a deprecated alias, removed after 2026).
ATTN_DP_FLAG = "--attn-dp-size"


class LayoutError(ValueError):
    """Engine ``i`` cannot be placed: its port or its GPUs fall outside what exists."""


def engine_port(index: int, options: SGLangEngineConfig) -> int:
    """HTTP port of engine ``index``."""
    _check_index(index)
    port = options.port + index * options.port_stride
    if port > 65535:
        raise LayoutError(
            f"engine {index} would listen on port {port} (port {options.port} + {index} x "
            f"port_stride {options.port_stride}), above 65535"
        )
    return port


def engine_nccl_port(index: int, options: SGLangEngineConfig) -> int | None:
    """``nccl_port`` of engine ``index`` (``None``: SGLang chooses)."""
    _check_index(index)
    if options.nccl_port is None:
        return None
    port = options.nccl_port + index * options.port_stride
    if port > 65535:
        raise LayoutError(f"engine {index} would use nccl port {port}, above 65535")
    return port


def engine_pool_slots(index: int, options: SGLangEngineConfig) -> list[int]:
    """Positions in the device pool of engine ``index``'s GPUs."""
    _check_index(index)
    first = options.base_gpu_id + index * options.engine_gpus * options.gpu_id_step
    return [first + k * options.gpu_id_step for k in range(options.engine_gpus)]


def device_pool(options: SGLangEngineConfig, base_env: Mapping[str, str]) -> list[str] | None:
    """The devices the engines are placed on: ``visible_devices``, else the launching
    environment's ``CUDA_VISIBLE_DEVICES``; ``None`` when neither says (every device)."""
    if options.visible_devices is not None:
        return list(options.visible_devices)
    raw = base_env.get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]


def engine_gpus(
    index: int, options: SGLangEngineConfig, base_env: Mapping[str, str] | None = None
) -> list[str]:
    """Device ids (as CUDA_VISIBLE_DEVICES spells them) engine ``index`` runs on. Raises
    :class:`LayoutError` when the pool is known and too small."""
    env = os.environ if base_env is None else base_env
    slots = engine_pool_slots(index, options)
    pool = device_pool(options, env)
    if pool is None:
        return [str(s) for s in slots]
    if slots[-1] >= len(pool):
        raise LayoutError(
            f"engine {index} needs device slots {slots} but the device pool has "
            f"{len(pool)} devices ({','.join(pool)}); lower the engine count, gpus_per_engine "
            "or base_gpu_id"
        )
    return [pool[s] for s in slots]


def engine_host(options: SGLangEngineConfig) -> str:
    """The address the servers bind: ``host``, else this node's address."""
    return resolve_host(options.host)


def build_command(model_path: str, index: int, options: SGLangEngineConfig) -> list[str]:
    """The argv that starts engine ``index`` serving ``model_path``:
    ``python -m sglang.launch_server --model-path ... --port ... [options] [extra_args]``,
    with ``--api-key`` when ``MILES_API_KEY`` is set. Raises
    :class:`~miles_engine_client.binding.BindRefused` for a host beyond loopback without it."""
    # imported here: importing the plugin imports no HTTP library (the client package's does)
    from miles_engine_client.binding import check_bind

    host = engine_host(options)
    check_bind(host, f"SGLang engine {index}")
    port = engine_port(index, options)
    if options.cuda_visible_devices == "per_engine":
        # The engine sees only its own GPUs (see build_env), numbered from 0.
        base_gpu_id, step = 0, 1
    else:
        base_gpu_id, step = engine_pool_slots(index, options)[0], options.gpu_id_step
    cmd = [
        options.python or sys.executable, "-m", options.server_module,
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--base-gpu-id", str(base_gpu_id),
        "--gpu-id-step", str(step),
    ]  # fmt: skip
    nccl_port = engine_nccl_port(index, options)
    if nccl_port is not None:
        cmd += ["--nccl-port", str(nccl_port)]
    if options.random_seed is not None:
        cmd += ["--random-seed", str(options.random_seed + index)]
    for name, flag in VALUE_FLAGS.items():
        value = getattr(options, name)
        if name == "dp_size" and options.enable_dp_attention:
            flag = ATTN_DP_FLAG
        if value is not None:
            cmd += [flag, str(value)]
    for name, flag in SWITCH_FLAGS.items():
        if getattr(options, name):
            cmd.append(flag)
    for name, flag in LIST_FLAGS.items():
        values = getattr(options, name)
        if values:
            cmd += [flag, *values]
    key = api_key()
    if key is not None:
        cmd += ["--api-key", key]
    return cmd + list(options.extra_args)


def loggable(cmd: list[str]) -> list[str]:
    """``cmd`` with the value of ``--api-key`` replaced by :data:`HIDDEN` (the key is kept out
    of logs)."""
    return [HIDDEN if i and cmd[i - 1] == "--api-key" else arg for i, arg in enumerate(cmd)]


def build_env(
    index: int, options: SGLangEngineConfig, base_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of engine ``index``: ``base_env`` (default: this process's), then
    ``options.env``, then the device visibility of the chosen ``cuda_visible_devices`` mode."""
    env = dict(os.environ if base_env is None else base_env)
    env.update(options.env)
    # Python buffers a redirected stdout; unbuffered output puts the last lines before a
    # crash into the log file, where the launcher's error message reads them.
    env.setdefault("PYTHONUNBUFFERED", "1")
    gpus = engine_gpus(index, options, env)
    if options.cuda_visible_devices == "per_engine":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    else:
        pool = device_pool(options, env)
        if pool is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(pool)
    return env


def base_url(index: int, options: SGLangEngineConfig) -> str:
    """Base URL of engine ``index`` (``http://host:port``), as it advertises itself: a
    wildcard bind is reached at the node's address."""
    from miles_engine_client.binding import url_host

    return f"http://{url_host(engine_host(options))}:{engine_port(index, options)}"


def _check_index(index: int) -> None:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise LayoutError(f"engine index must be a non-negative integer, got {index!r}")
