"""``build_command`` / ``build_env``: every option reaches SGLang as the right flag, each engine
gets its own port and GPUs, and layouts that cannot work are refused with a clear message.
Pure functions: no process is started and SGLang is not needed."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from miles_engine_sglang.command import (
    LIST_FLAGS,
    SWITCH_FLAGS,
    VALUE_FLAGS,
    LayoutError,
    base_url,
    build_command,
    build_env,
    engine_gpus,
)
from miles_engine_sglang.options import SGLangEngineConfig
from pydantic import ValidationError

#: Options that are Miles' own (process management, placement) rather than one SGLang flag.
MILES_OWN = {
    "host", "port", "port_stride", "nccl_port", "gpus_per_engine", "base_gpu_id", "gpu_id_step",
    "cuda_visible_devices", "visible_devices", "random_seed", "extra_args", "python",
    "server_module", "env", "log_dir", "startup_timeout_s", "wait_health_generate",
    "shutdown_grace_s", "request_timeout_s", "num_engines",
    "enable_dp_attention",  # changes dp_size's flag to --attn-dp-size, see test below
}  # fmt: skip


def _contains(cmd: list[str], part: list[str]) -> bool:
    return any(cmd[i : i + len(part)] == part for i in range(len(cmd) - len(part) + 1))


def test_defaults_give_exactly_this_command() -> None:
    assert build_command("/models/qwen", 0, SGLangEngineConfig()) == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "/models/qwen",
        "--host", "127.0.0.1",
        "--port", "30000",
        "--base-gpu-id", "0",
        "--gpu-id-step", "1",
        "--tp-size", "1",
        "--dp-size", "1",
        "--pp-size", "1",
        "--dtype", "auto",
        "--weight-version", "0",
        "--log-level", "info",
        "--log-level-http", "warning",
        "--skip-tokenizer-init",
    ]  # fmt: skip


def test_every_option_is_mapped_or_miles_own() -> None:
    fields = set(SGLangEngineConfig.model_fields)
    mapped = set(VALUE_FLAGS) | set(SWITCH_FLAGS) | set(LIST_FLAGS)
    assert mapped <= fields
    assert fields - mapped == MILES_OWN


VALUE_CASES: list[tuple[dict[str, Any], list[str]]] = [
    ({"tp_size": 4}, ["--tp-size", "4"]),
    ({"dp_size": 2}, ["--dp-size", "2"]),
    ({"pp_size": 2}, ["--pp-size", "2"]),
    ({"dtype": "bfloat16"}, ["--dtype", "bfloat16"]),
    ({"kv_cache_dtype": "fp8_e4m3"}, ["--kv-cache-dtype", "fp8_e4m3"]),
    ({"context_length": 32768}, ["--context-length", "32768"]),
    ({"mem_fraction_static": 0.7}, ["--mem-fraction-static", "0.7"]),
    ({"max_running_requests": 256}, ["--max-running-requests", "256"]),
    ({"max_total_tokens": 100000}, ["--max-total-tokens", "100000"]),
    ({"chunked_prefill_size": 8192}, ["--chunked-prefill-size", "8192"]),
    ({"chunked_prefill_size": -1}, ["--chunked-prefill-size", "-1"]),
    ({"attention_backend": "fa3"}, ["--attention-backend", "fa3"]),
    ({"load_format": "safetensors"}, ["--load-format", "safetensors"]),
    ({"tokenizer_path": "/tok"}, ["--tokenizer-path", "/tok"]),
    ({"rl_on_policy_target": "fsdp"}, ["--rl-on-policy-target", "fsdp"]),
    ({"weight_version": "17"}, ["--weight-version", "17"]),
    ({"served_model_name": "policy"}, ["--served-model-name", "policy"]),
    ({"log_level": "debug"}, ["--log-level", "debug"]),
    ({"log_level_http": "info"}, ["--log-level-http", "info"]),
    ({"watchdog_timeout": 600.0}, ["--watchdog-timeout", "600.0"]),
    ({"dist_timeout": 1800}, ["--dist-timeout", "1800"]),
    ({"max_lora_rank": 16}, ["--max-lora-rank", "16"]),
    ({"max_loras_per_batch": 4}, ["--max-loras-per-batch", "4"]),
    ({"max_loaded_loras": 12}, ["--max-loaded-loras", "12"]),
    ({"host": "127.0.0.2"}, ["--host", "127.0.0.2"]),
    ({"random_seed": 7}, ["--random-seed", "7"]),
    ({"nccl_port": 29501}, ["--nccl-port", "29501"]),
    ({"server_module": "my.launch"}, ["-m", "my.launch"]),
]


@pytest.mark.parametrize(("options", "flags"), VALUE_CASES, ids=lambda v: str(v))
def test_value_option_maps_to_flag(options: dict[str, Any], flags: list[str]) -> None:
    cmd = build_command("/m", 0, SGLangEngineConfig(**options))
    assert _contains(cmd, flags), cmd


def test_every_value_flag_has_a_case() -> None:
    covered = {k for opts, _ in VALUE_CASES for k in opts}
    assert set(VALUE_FLAGS) <= covered


@pytest.mark.parametrize(("name", "flag"), sorted(SWITCH_FLAGS.items()))
def test_switch_option_maps_to_flag(name: str, flag: str) -> None:
    extra: dict[str, Any] = {}
    if name == "enable_weights_cpu_backup":
        extra["enable_memory_saver"] = True
    on = build_command("/m", 0, SGLangEngineConfig(**{name: True, **extra}))
    off = build_command("/m", 0, SGLangEngineConfig(**{name: False, **extra}))
    assert on.count(flag) == 1
    assert flag not in off


def test_list_options_give_the_flag_then_each_value() -> None:
    opts = SGLangEngineConfig(
        enable_lora=True,
        lora_paths=["policy=/ckpt/adapter", "/other"],
        lora_target_modules=["q_proj", "v_proj"],
    )
    cmd = build_command("/m", 0, opts)
    assert _contains(cmd, ["--lora-paths", "policy=/ckpt/adapter", "/other"])
    assert _contains(cmd, ["--lora-target-modules", "q_proj", "v_proj"])
    assert "--lora-paths" not in build_command("/m", 0, SGLangEngineConfig())


def test_dp_attention_is_sglang_attn_dp_size() -> None:
    on = build_command("/m", 0, SGLangEngineConfig(tp_size=4, dp_size=2, enable_dp_attention=True))
    off = build_command("/m", 0, SGLangEngineConfig(tp_size=4, dp_size=2))
    assert _contains(on, ["--attn-dp-size", "2"]) and "--dp-size" not in on
    assert "--enable-dp-attention" not in on
    assert _contains(off, ["--dp-size", "2"]) and "--attn-dp-size" not in off


def test_unset_options_leave_sglang_defaults() -> None:
    cmd = build_command("/m", 0, SGLangEngineConfig(log_level_http=None))
    for flag in (
        "--mem-fraction-static", "--context-length", "--attention-backend", "--random-seed",
        "--nccl-port", "--chunked-prefill-size", "--log-level-http", "--served-model-name",
    ):  # fmt: skip
        assert flag not in cmd


def test_python_option_and_extra_args_pass_through_last() -> None:
    opts = SGLangEngineConfig(
        python="/opt/sglang/bin/python",
        extra_args=["--enable-torch-compile", "--cuda-graph-max-bs-decode", "64"],
    )
    cmd = build_command("/m", 0, opts)
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert cmd[-3:] == ["--enable-torch-compile", "--cuda-graph-max-bs-decode", "64"]


# index -> (port, nccl port, --base-gpu-id, random seed) for 2 GPUs per engine, stride 10
PER_ENGINE = [(0, 30000, 30005, 0, 100), (1, 30010, 30015, 2, 101), (3, 30030, 30035, 6, 103)]


@pytest.mark.parametrize(("index", "port", "nccl", "base_gpu", "seed"), PER_ENGINE)
def test_each_engine_gets_its_own_port_gpus_and_seed(
    index: int, port: int, nccl: int, base_gpu: int, seed: int
) -> None:
    opts = SGLangEngineConfig(tp_size=2, nccl_port=30005, random_seed=100)
    cmd = build_command("/m", index, opts)
    assert _contains(cmd, ["--port", str(port)])
    assert _contains(cmd, ["--nccl-port", str(nccl)])
    assert _contains(cmd, ["--base-gpu-id", str(base_gpu), "--gpu-id-step", "1"])
    assert _contains(cmd, ["--random-seed", str(seed)])
    assert base_url(index, opts) == f"http://127.0.0.1:{port}"


GPU_CASES: list[tuple[dict[str, Any], dict[str, str], int, list[str], str, str | None]] = [
    # options, launching env, index -> engine devices, --base-gpu-id, CUDA_VISIBLE_DEVICES
    ({"tp_size": 2}, {}, 1, ["2", "3"], "2", None),
    ({"tp_size": 2}, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 1, ["6", "7"], "2", "4,5,6,7"),
    ({"tp_size": 2, "base_gpu_id": 4}, {}, 0, ["4", "5"], "4", None),
    ({"tp_size": 2, "gpu_id_step": 2}, {}, 1, ["4", "6"], "4", None),
    ({"tp_size": 2, "dp_size": 2}, {}, 1, ["4", "5", "6", "7"], "4", None),
    ({"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}, {}, 1, ["4", "5", "6", "7"], "4", None),  # noqa: E501
    ({"tp_size": 2, "visible_devices": ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]},
     {"CUDA_VISIBLE_DEVICES": "0"}, 1, ["GPU-c", "GPU-d"], "2", "GPU-a,GPU-b,GPU-c,GPU-d"),
    ({"tp_size": 2, "cuda_visible_devices": "per_engine"}, {}, 1, ["2", "3"], "0", "2,3"),
    ({"tp_size": 2, "cuda_visible_devices": "per_engine"},
     {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 1, ["6", "7"], "0", "6,7"),
    ({"tp_size": 1, "cuda_visible_devices": "per_engine", "base_gpu_id": 1},
     {"CUDA_VISIBLE_DEVICES": "3,1,2"}, 1, ["2"], "0", "2"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "env", "index", "gpus", "base_gpu", "visible"), GPU_CASES)
def test_gpu_placement(
    options: dict[str, Any],
    env: dict[str, str],
    index: int,
    gpus: list[str],
    base_gpu: str,
    visible: str | None,
) -> None:
    opts = SGLangEngineConfig(**options)
    assert engine_gpus(index, opts, env) == gpus
    assert _contains(build_command("/m", index, opts), ["--base-gpu-id", base_gpu])
    out = build_env(index, opts, env)
    assert out.get("CUDA_VISIBLE_DEVICES") == visible
    assert out["PYTHONUNBUFFERED"] == "1"


def test_env_option_is_added_and_base_env_kept() -> None:
    opts = SGLangEngineConfig(env={"NCCL_DEBUG": "INFO", "HOME": "/h2"})
    out = build_env(0, opts, {"HOME": "/h", "PATH": "/bin"})
    assert out["NCCL_DEBUG"] == "INFO" and out["HOME"] == "/h2" and out["PATH"] == "/bin"


def test_build_env_defaults_to_this_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("MILES_SGLANG_PROBE", "x")
    out = build_env(1, SGLangEngineConfig(cuda_visible_devices="per_engine"))
    assert out["CUDA_VISIBLE_DEVICES"] == "3" and out["MILES_SGLANG_PROBE"] == "x"


LAYOUT_ERRORS: list[tuple[dict[str, Any], dict[str, str], int, str]] = [
    ({"tp_size": 2}, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2,
     r"engine 2 needs device slots \[4, 5\] but the device pool has 4 devices"),
    ({"visible_devices": ["0"]}, {}, 1, r"device pool has 1 devices \(0\)"),
    ({"port": 65530, "port_stride": 10}, {}, 1, r"port 65540 .* above 65535"),
    ({"nccl_port": 65531, "port": 30000}, {}, 1, r"nccl port 65541, above 65535"),
    ({}, {}, -1, "engine index must be a non-negative integer"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "env", "index", "message"), LAYOUT_ERRORS)
def test_impossible_placement_is_refused(
    options: dict[str, Any], env: dict[str, str], index: int, message: str
) -> None:
    opts = SGLangEngineConfig(**options)
    with pytest.raises(LayoutError, match=message):
        build_command("/m", index, opts)
        build_env(index, opts, env)


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"tp_size": 4, "gpus_per_engine": 6}, "tp_size 4 does not divide gpus_per_engine 6"),
    ({"tp_size": 2, "gpus_per_engine": 4}, r"gpus_per_engine 4 does not match the layout: "
     r"tp_size 2 x pp_size 1 x dp_size 1 = 2 GPUs"),
    ({"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "gpus_per_engine": 4},
     r"tp_size 2 x pp_size 1 = 2 GPUs"),
    ({"enable_dp_attention": True}, "enable_dp_attention needs dp_size > 1"),
    ({"enable_dp_attention": True, "tp_size": 3, "dp_size": 2}, "dp_size 2 must divide tp_size 3"),
    ({"enable_weights_cpu_backup": True}, "needs enable_memory_saver: true"),
    ({"nccl_port": 30020, "port": 30000}, "congruent modulo port_stride 10"),
    ({"extra_args": ["--port", "1"]}, "extra_args must not set --port"),
    ({"extra_args": ["--tp-size=2"]}, "extra_args must not set --tp-size"),
    ({"extra_args": ["--tp", "2"]}, r"must not set --tp \(an abbreviation of --tp-size\)"),
    ({"extra_args": ["--attn-dp-size", "2"]}, "must not set --attn-dp-size"),
    ({"extra_args": ["--enable-dp-attention"]}, "must not set --enable-dp-attention"),
    ({"extra_args": ["--skip-tokenizer-init"]}, "must not set --skip-tokenizer-init"),
    ({"tp_size": 0}, "tp_size"),
    ({"mem_fraction_static": 1.0}, "mem_fraction_static"),
    ({"chunked_prefill_size": -2}, "chunked_prefill_size"),
    ({"dtype": "fp8"}, "dtype"),
    ({"cuda_visible_devices": "all"}, "cuda_visible_devices"),
    ({"attention_backend": "fa3 --evil"}, "attention_backend"),
    ({"rl_on_policy_target": "megatron"}, "rl_on_policy_target"),
    ({"port": 0}, "port"),
    ({"visible_devices": []}, "visible_devices"),
    ({"startup_timeout_s": 0}, "startup_timeout_s"),
    ({"server_module": "sglang launch"}, "server_module"),
    ({"tensor_parallel": 2}, "tensor_parallel"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "message"), INVALID, ids=lambda v: str(v))
def test_invalid_options_are_refused_with_the_reason(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        SGLangEngineConfig(**options)
