"""SGLang's ``return_routed_experts``: the engine records, for every position it forwarded, the
top-k experts each MoE layer's router chose, and they are the experts a teacher-forced
transformers forward of the same sequence chooses; both forward paths, requests joining and
leaving the batch, the samples of one prompt sharing its prefill. Over HTTP the record is
SGLang's base64 int32 ``[prompt + output - 1, num_hidden_layers, k]``, ``-1`` in dense layers;
a dense model refuses the request."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest


def reference_routing(model: Any, ids: list[int]) -> dict[int, Any]:
    """Top-k expert ids ``[len(ids), k]`` of every MoE layer, by layer, in one forward."""
    import torch
    from miles_engine_embedded.weights import moe_gates

    got: dict[int, Any] = {}
    handles = [
        gate.register_forward_hook(lambda _m, _a, out, i=i: got.__setitem__(i, out[2]))
        for i, gate in moe_gates(model).items()
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return got


def assert_same_routing(model: Any, ids: list[int], routed: Any, moe_layers: list[int]) -> None:
    """``routed`` ``[len(ids) - 1, layers, k]`` holds, in every MoE layer, the set of experts
    the reference forward chose at each position, and -1 in the other layers."""
    ref = reference_routing(model, ids[:-1])
    assert tuple(routed.shape[:1]) == (len(ids) - 1,)
    for layer in range(routed.shape[1]):
        if layer not in moe_layers:
            assert (routed[:, layer] == -1).all()
            continue
        mine = routed[:, layer].sort(dim=-1).values
        theirs = ref[layer].sort(dim=-1).values.to(mine.dtype)
        assert (mine == theirs).all(), (layer, (mine != theirs).any(-1).nonzero().flatten())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("lean", [True, False])
def test_routed_experts_match_a_teacher_forced_forward(
    tmp_path: Path, make_model: Any, family: str, lean: bool
) -> None:
    import torch
    from miles_engine_embedded.engine import Engine, Request
    from miles_engine_embedded.protocol import SamplingParams
    from miles_engine_embedded.sampling import UniformStream
    from miles_engine_embedded.weights import ModelHolder
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = make_model(tmp_path / family, family=family)
    holder = ModelHolder(
        str(path), device="cpu", dtype="float32", weight_version="0", lean_forward=lean
    )
    assert (holder.lean is not None) == lean
    engine = Engine(
        holder, max_running_requests=3, max_total_tokens=600, context_length=200, seed=0
    )
    # Eight requests on three slots: two share one prompt (one prefill, copied), two share
    # their first ten tokens (the second starts from the first's keys, values and routing),
    # one records nothing; they join and leave the batch at different steps.
    shared = list(range(50, 60))
    prompts = [[3, 4, 5, 6], [3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [20], [30, 31], [40, 41],
               [*shared, 1], [*shared, 2, 3]]  # fmt: skip
    lengths = [9, 14, 6, 11, 20, 7, 30, 8]
    record = [True, True, True, True, True, False, True, True]
    done: list[Any] = []
    finished = threading.Event()

    def on_done(r: Any) -> None:
        done.append(r)
        if len(done) == len(prompts):
            finished.set()

    engine.start()
    for i, (p, n, rec) in enumerate(zip(prompts, lengths, record, strict=True)):
        sp = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=1.0)
        engine.submit(Request(rid=str(i), input_ids=p, params=sp, return_logprob=True,
                              return_routed_experts=rec, on_done=on_done,
                              uniforms=UniformStream(i)))  # fmt: skip
    assert finished.wait(120)
    engine.stop()
    # the lean forward starts a sequence from a shared prefix (the copy: 4, the prefix: 10)
    assert engine.prefill_shared == (4 + 10 if lean else 4)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert holder.moe_layers == ([0] if family == "qwen3_moe" else [0, 1])
    for r in done:
        assert len(r.output_ids) == lengths[int(r.rid)]
        if not r.return_routed_experts:
            assert r.routed == []
            continue
        routed = engine.routed_experts(r)
        assert routed.dtype == torch.int32 and tuple(routed.shape[1:]) == (2, 2)
        assert_same_routing(reference, r.input_ids + r.output_ids, routed, holder.moe_layers)


def test_routed_experts_over_http_in_sglangs_format(
    tmp_path: Path, make_model: Any, server: str
) -> None:
    """A live server: the base64 int32 record decodes to SGLang's shape with the routing of a
    teacher-forced forward; without the flag there is none; a dense model refuses it."""
    import base64

    import numpy as np
    import torch
    from miles_engine_client import EngineClient, EngineHTTPError
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig
    from transformers import AutoModelForCausalLM

    path = make_model(tmp_path / "moe", family="qwen3_moe")
    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=2, context_length=64, num_threads=1, startup_timeout_s=120
        )
    )
    url = launcher.launch(str(path), index=0)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]

    async def go() -> tuple[list[Any], Any, str]:
        async with EngineClient(url, timeout_s=120) as c:
            asked = await asyncio.gather(
                *[
                    c.generate(
                        p, {"max_new_tokens": 5 + i, "ignore_eos": True}, return_routed_experts=True
                    )
                    for i, p in enumerate(prompts)
                ]
            )
            plain = await c.generate(prompts[0], {"max_new_tokens": 3})
        async with EngineClient(server, timeout_s=120) as dense:
            with pytest.raises(EngineHTTPError) as refused:
                await dense.generate([5, 6], {"max_new_tokens": 2}, return_routed_experts=True)
        return asked, plain, str(refused.value)

    try:
        asked, plain, refusal = asyncio.run(go())
    finally:
        launcher.shutdown()
    assert "return_routed_experts: the served model has no mixture-of-experts layer" in refusal
    assert plain.routed_experts is None and "routed_experts" not in plain.raw["meta_info"]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, r in zip(prompts, asked, strict=True):
        rows = len(p) + len(r.output_ids) - 1
        raw = np.frombuffer(base64.b64decode(r.raw["meta_info"]["routed_experts"]), "<i4")
        ids = torch.from_numpy(raw.reshape(rows, 2, 2).copy())  # [positions, layers, top-k]
        assert r.routed_experts is not None and r.routed_experts.itemsize == 1
        assert r.routed_experts.rows() == ids.reshape(rows, 4).tolist()
        assert_same_routing(reference, p + r.output_ids, ids, [0])
