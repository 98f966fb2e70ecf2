"""The trained policy as a plain Hugging Face checkpoint (``run.export``): the trainer's weights
in Hugging Face naming as safetensors shards, beside the source checkpoint's config, generation
config, tokenizer and chat template, so transformers loads it and an engine serves it. A run
with an adapter exports the merged model there and the adapter alone (PEFT's format) beside
it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from miles_core.config import RunConfig
from miles_core.runtime.policy import Policy

#: Files of the source checkpoint that hold weights (replaced by the trained ones).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def export_checkpoint(
    weights: Iterable[tuple[str, Any]],
    source: Path,
    target: Path,
    *,
    shard_bytes: int = 2 * 1024**3,
) -> Path:
    """Write ``weights`` (name, tensor) to ``target`` as safetensors shards of at most
    ``shard_bytes`` (one tensor may exceed it), with an index when there are several, and copy
    every other file of the source checkpoint folder. A folder already at ``target`` is
    replaced. Returns ``target``."""
    from safetensors.torch import save_file  # the trainer's environment has it (transformers)

    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and not (
            item.name.endswith(_WEIGHT_SUFFIXES) or item.name in _WEIGHT_INDEXES
        ):
            shutil.copy2(item, target / item.name)
    shards: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    size = 0
    for name, tensor in weights:
        # A copy: the stream may hand out views of live or reused buffers, and safetensors
        # refuses two names over one storage (tied embeddings).
        t = tensor.detach().to("cpu", copy=True).contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(target / "model.safetensors"), metadata={"format": "pt"})
        return target
    index: dict[str, Any] = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(target / fname), metadata={"format": "pt"})
        for key, t in shard.items():
            index["weight_map"][key] = fname
            index["metadata"]["total_size"] += t.numel() * t.element_size()
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return target


def export_policy(
    policy: Policy, model_path: str, run_dir: Path, config: RunConfig
) -> dict[str, str]:
    """The policy's weights now as a checkpoint under ``<run_dir>/model``, beside the files of
    the checkpoint it started from (``model_path``). With an ``adapter`` (the run config
    selects one), the adapter is merged into the weights written there, and also written on
    its own in PEFT's format under ``<run_dir>/adapter``; with several (``adapters``), each
    one merged into its own checkpoint under ``<its output folder>/model``. Returns the
    folders written (``model``, ``adapter``, ``model/<name>``) for the run's final line."""
    source = Path(model_path)
    if config.adapters:
        out: dict[str, str] = {}
        for name, folder in config.adapter_dirs().items():
            with policy.model_weights(True, name) as weights:
                out[f"model/{name}"] = str(export_checkpoint(weights, source, folder / "model"))
        return out
    adapter = config.adapter is not None
    with policy.model_weights(adapter) as weights:
        out = {"model": str(export_checkpoint(weights, source, run_dir / "model"))}
    if adapter:
        folder = run_dir / "adapter"
        if folder.exists():
            shutil.rmtree(folder)
        policy.save_adapter(str(folder))
        out["adapter"] = str(folder)
    return out


def save_adapters(policy: Policy, config: RunConfig, sub: str | None = None) -> dict[str, str]:
    """Each adapter of a run that trains several (``adapters``) in PEFT's format in its own
    output folder, or in ``<folder>/<sub>`` (a checkpoint's ``step_<N>``); the files of a
    previous save there are replaced. Returns ``adapter/<name>`` -> folder (nothing for a run
    without ``adapters``)."""
    out: dict[str, str] = {}
    for name, folder in config.adapter_dirs().items():
        target = folder / sub if sub else folder
        for stale in ("adapter_model.safetensors", "adapter_config.json"):
            (target / stale).unlink(missing_ok=True)
        policy.save_adapter(str(target), name)
        out[f"adapter/{name}"] = str(target)
    return out
