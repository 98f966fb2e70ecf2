"""Weight updates on a live server: from disk, from tensors, over a gloo group; versions."""

from __future__ import annotations

import asyncio
import base64
import pickle
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from miles_engine_client import EngineClient, EngineHTTPError

T = TypeVar("T")
PROMPT = [10, 20, 30, 40]
SP = {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 3}


def run(url: str, fn: Callable[[EngineClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with EngineClient(url, timeout_s=120) as c:
            return await fn(c)

    return asyncio.run(main())


def load(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < tol


def test_update_weights_from_disk_and_versions(
    server: str, tiny_model: Path, tiny_model_v2: Path, teacher_forced: Any
) -> None:
    v1, v2 = load(tiny_model), load(tiny_model_v2)

    async def go(c: EngineClient) -> Any:
        start = await c.get_weight_version()
        await c.update_weights_from_disk(str(tiny_model_v2))
        bumped = await c.get_weight_version()
        r2 = await c.generate(PROMPT, SP)
        with pytest.raises(EngineHTTPError):
            await c.update_weights_from_disk("/nonexistent/checkpoint")
        after_bad = await c.get_weight_version()
        await c.update_weights_from_disk(str(tiny_model), weight_version="named-v")
        r1 = await c.generate(PROMPT, SP)
        await c.update_weight_version(start)
        return start, bumped, r2, after_bad, r1, await c.get_weight_version()

    start, bumped, r2, after_bad, r1, final = run(server, go)
    assert start.isdigit() and bumped == str(int(start) + 1)
    assert r2.weight_version == bumped and after_bad == bumped
    assert close(r2.logprobs, teacher_forced(v2, PROMPT, r2.output_ids))
    assert not close(r2.logprobs, teacher_forced(v1, PROMPT, r2.output_ids))
    assert r1.weight_version == "named-v"
    assert close(r1.logprobs, teacher_forced(v1, PROMPT, r1.output_ids))
    assert final == start


def test_update_weights_from_tensor(
    server: str, tiny_model: Path, tiny_model_v2: Path, teacher_forced: Any
) -> None:
    v1, v2 = load(tiny_model), load(tiny_model_v2)

    def blob(model: Any) -> str:
        named = [(n, t.detach().clone()) for n, t in model.state_dict().items()]
        return base64.b64encode(pickle.dumps(named)).decode()

    async def go(c: EngineClient) -> Any:
        start = await c.get_weight_version()
        await c.update_weights_from_tensor([blob(v2)], weight_version="t2")
        r2 = await c.generate(PROMPT, SP)
        bad = [("model.norm.weight", __import__("torch").zeros(3))]
        with pytest.raises(EngineHTTPError) as err:
            await c.update_weights_from_tensor([base64.b64encode(pickle.dumps(bad)).decode()])
        still = await c.get_weight_version()
        await c.update_weights_from_tensor([blob(v1)], weight_version=start)
        return r2, err.value, still

    r2, err, still = run(server, go)
    assert r2.weight_version == "t2"
    assert close(r2.logprobs, teacher_forced(v2, PROMPT, r2.output_ids))
    assert "shape" in err.message and still == "t2"


@pytest.mark.slow
def test_update_weights_from_distributed_gloo(
    server: str, tiny_model: Path, tiny_model_v2: Path, teacher_forced: Any
) -> None:
    """This process is rank 0 of a real gloo group; the engine is rank 1."""
    import torch.distributed as dist
    from miles_engine_embedded.launcher import free_port

    v1, v2 = load(tiny_model), load(tiny_model_v2)
    port = free_port()
    state: dict[str, Any] = {}

    def trainer_side_group() -> None:
        # rank 0 forms the group as an SGLang trainer does (tcp:// rendezvous it hosts,
        # PrefixStore(group_name), torch's process-group helper)
        from miles_transport_common.groups import join_update_group

        state["pg"] = join_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name="miles-test",
            backend="gloo",
            timeout_s=60,
        )

    def send(model: Any) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for t in model.state_dict().values():
            state["pg"].broadcast([t.contiguous()], opts).wait()

    async def go(c: EngineClient) -> Any:
        th = threading.Thread(target=trainer_side_group)
        th.start()
        await c.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name="miles-test",
        )
        th.join()
        start = await c.get_weight_version()
        sd = v2.state_dict()
        names = list(sd)
        args = (names, ["float32"] * len(names), [list(sd[n].shape) for n in names])
        sender = threading.Thread(target=send, args=(v2,))
        sender.start()
        await c.update_weights_from_distributed(*args, group_name="miles-test")
        sender.join()
        r2 = await c.generate(PROMPT, SP)
        sender = threading.Thread(target=send, args=(v1,))
        sender.start()
        await c.update_weights_from_distributed(
            *args, group_name="miles-test", weight_version=start
        )
        sender.join()
        return start, r2

    start, r2 = run(server, go)
    assert r2.weight_version == str(int(start) + 1)
    assert close(r2.logprobs, teacher_forced(v2, PROMPT, r2.output_ids))


def named_of(model: Any) -> list[tuple[str, Any]]:
    return [(n, t.detach().clone()) for n, t in model.state_dict().items()]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["colocated", "broadcast", "p2p"])
def test_transports_publish_into_the_live_engine(
    server: str, tiny_model: Path, tiny_model_v2: Path, teacher_forced: Any, transport: str
) -> None:
    """Each registered transport, built from its record as a run builds it, publishes through
    the engine's own endpoints; the engine serves the new weights with the new version, and a
    second update (the other staging set) brings the first weights back."""
    from miles_core import Kind
    from miles_core.plugins import load_plugins

    if transport == "p2p":
        pytest.importorskip("nixl")
    v1, v2 = load(tiny_model), load(tiny_model_v2)
    record = load_plugins().registry.get(Kind.TRANSPORT, transport)
    assert (
        record.engine_capabilities
        <= load_plugins().registry.get(Kind.ROLLOUT_ENGINE, "embedded").capabilities
    )
    sender = record.build(record.config(bucket_size_mb=0.05, timeout_s=60))
    try:
        sender.send(named_of(v2), version=41, engines=[server])
        r2 = run(server, lambda c: c.generate(PROMPT, SP))
        sender.send(named_of(v1), version=42, engines=[server])
        r1 = run(server, lambda c: c.generate(PROMPT, SP))
    finally:
        sender.close()
    assert r2.weight_version == "41" and r1.weight_version == "42"
    assert close(r2.logprobs, teacher_forced(v2, PROMPT, r2.output_ids))
    assert close(r1.logprobs, teacher_forced(v1, PROMPT, r1.output_ids))


def test_corrupted_colocated_bucket_is_refused_and_the_engine_keeps_its_weights(
    server: str, tiny_model: Path, tiny_model_v2: Path
) -> None:
    from miles_transport_colocated.config import ColocatedOptions
    from miles_transport_colocated.sender import ColocatedSender
    from miles_transport_common.errors import TransportError

    v2 = load(tiny_model_v2)
    before = run(server, lambda c: c.get_weight_version())
    first = run(server, lambda c: c.generate(PROMPT, SP))

    def flip(manifest: Any, data: Any) -> None:
        if manifest.seq == 1:
            data[7] ^= 0x40

    sender = ColocatedSender(ColocatedOptions(bucket_size_mb=0.05, timeout_s=60), fault_hook=flip)
    try:
        with pytest.raises(TransportError, match="checksum"):
            sender.send(named_of(v2), version=77, engines=[server])
    finally:
        sender.close()
    assert run(server, lambda c: c.get_weight_version()) == before
    again = run(server, lambda c: c.generate(PROMPT, SP))
    assert again.output_ids == first.output_ids and close(again.logprobs, first.logprobs, 1e-6)


def test_p2p_extension_path_refuses_a_bad_body(server: str) -> None:
    async def go(c: EngineClient) -> EngineHTTPError:
        with pytest.raises(EngineHTTPError) as err:
            await c.request("POST", "/miles/p2p_weights", {"address": "nowhere", "version": 1})
        return err.value

    err = run(server, go)
    assert err.status == 400 and "address" in err.message


def test_adopt_serves_from_the_given_tensors_and_copies_never_write_into_them(
    tiny_model: Path, tiny_model_v2: Path
) -> None:
    # A full-staging transport commit hands the engine tensors it keeps untouched until the
    # update after next: the engine serves from them without a copy. A later copy-load (from
    # disk) must not write into those buffers, which other engines may serve from too.
    import torch
    from miles_engine_embedded.weights import ModelHolder

    holder = ModelHolder(str(tiny_model), device="cpu", dtype="float32", weight_version="0")
    new = {n: t.detach().clone() + 0.5 for n, t in load(tiny_model_v2).state_dict().items()}
    first = next(iter(new))
    holder.adopt_named(list(new.items()))
    assert holder.adopted
    assert holder.params[first].data_ptr() == new[first].data_ptr()  # no copy
    assert torch.equal(holder.params[first], new[first])
    kept = {n: t.clone() for n, t in new.items()}
    holder.load_from_disk(str(tiny_model))
    assert not holder.adopted
    assert all(torch.equal(new[n], kept[n]) for n in new)  # the handed-over buffers untouched
    disk = load(tiny_model).state_dict()
    assert torch.equal(holder.params[first], disk[first])
    # a dtype that differs from the served one is refused (never silently cast)
    half = {first: new[first].to(torch.bfloat16)}
    with pytest.raises(ValueError, match="dtype"):
        holder.adopt_named(list(half.items()))
    assert holder.params[first].dtype == torch.float32
    with pytest.raises(ValueError, match="unknown weight"):
        holder.adopt_named([("nope", new[first])])
