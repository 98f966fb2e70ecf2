"""Adapter-only weight sync: the bytes and the time of publishing a LoRA adapter against
publishing the whole model, through the same transport into the same engine, in one run.

The engine is a live embedded server with ``enable_lora`` serving SmolLM2-135M-Instruct. The
adapter is r=``--rank`` (default 8), ``lora_alpha`` 2r, on every attention and MLP projection
(q, k, v, o, gate, up, down) — what ``adapter: {name: lora}`` trains by default — built by
``peft`` on the same checkpoint, its tensors in PEFT's names. For each transport in
``--transports`` (default colocated and broadcast) the whole model (its state dict, fp32, the
tied head once) and the adapter alone are each published ``--repeats`` times in turn, after
one unmeasured update of each; ``sync/bytes`` and ``sync/seconds`` are what the transport
reports, and the best time of each side is kept.

The last line is JSON: per transport ``<t>_full_over_adapter_bytes`` (goal >= 50 on
colocated) and ``<t>_full_over_adapter_seconds``, and the headline
``full_over_adapter_bytes`` / ``full_over_adapter_seconds`` of the colocated transport.

    .venv/bin/python benchmarks/lora_sync.py [--rank 8] [--repeats 3] [--transports colocated]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from _machine import describe

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter(path: Any, rank: int) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """The adapter's config dict and PEFT-named tensors (random B: a real update's size)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
    peft_model = get_peft_model(model, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1e-3)
    named = [(n, t.detach().clone()) for n, t in get_peft_model_state_dict(peft_model).items()]
    cfg = peft_model.peft_config["default"].to_dict()
    cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg = json.loads(json.dumps(cfg, default=str))
    return cfg, named


def full_model(path: Any) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return [
        (n, t.detach().clone())
        for n, t in model.state_dict().items()
        if not (tied and n == "lm_head.weight")
    ]


def build_transport(name: str) -> Any:
    from miles_core import Kind
    from miles_core.plugins import load_plugins

    record = load_plugins().registry.get(Kind.TRANSPORT, name)
    options: dict[str, Any] = {"timeout_s": 300}
    if name == "broadcast":
        options["backend"] = "gloo"
    return record.build(record.config.model_validate(options))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="colocated,broadcast")
    args = p.parse_args()
    transports = [t for t in args.transports.split(",") if t]
    describe({"rank": args.rank, "repeats": args.repeats, "transports": transports})

    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig
    from miles_modelfamilies.smollm2_model import smollm2_model_folder

    from miles_core.contracts import AdapterSync

    path = smollm2_model_folder()
    cfg, lora = adapter(path, args.rank)
    full = full_model(path)
    spec = AdapterSync(name="policy", config=cfg)
    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=4, context_length=256, enable_lora=True, max_lora_rank=args.rank
        )
    )
    url = launcher.launch(str(path), index=0)
    out: dict[str, Any] = {"rank": args.rank}
    version = 0
    try:
        for name in transports:
            sender = build_transport(name)
            best: dict[str, float] = {}
            nbytes: dict[str, float] = {}
            try:
                for i in range(args.repeats + 1):
                    for side, weights, extra in (
                        ("full", full, {}),
                        ("adapter", lora, {"adapter": spec}),
                    ):
                        version += 1
                        t0 = time.perf_counter()
                        m = sender.send(iter(weights), version=version, engines=[url], **extra)
                        dt = time.perf_counter() - t0
                        print(
                            f"{name} {side} #{i}: {m['sync/bytes'] / 1e6:.1f} MB in {dt:.3f} s"
                            + (" (warm-up)" if i == 0 else ""),
                            flush=True,
                        )
                        if i:
                            best[side] = min(best.get(side, dt), dt)
                            nbytes[side] = m["sync/bytes"]
            finally:
                sender.close()
            out[f"{name}_full_bytes"] = nbytes["full"]
            out[f"{name}_adapter_bytes"] = nbytes["adapter"]
            out[f"{name}_full_s"] = round(best["full"], 4)
            out[f"{name}_adapter_s"] = round(best["adapter"], 4)
            out[f"{name}_full_over_adapter_bytes"] = round(nbytes["full"] / nbytes["adapter"], 1)
            out[f"{name}_full_over_adapter_seconds"] = round(best["full"] / best["adapter"], 2)
    finally:
        launcher.shutdown()
    head = transports[0]
    out["full_over_adapter_bytes"] = out[f"{head}_full_over_adapter_bytes"]
    out["full_over_adapter_seconds"] = out[f"{head}_full_over_adapter_seconds"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
