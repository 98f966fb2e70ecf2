"""LoRA serving end to end: a real embedded server process with ``enable_lora``, adapters made
by ``peft`` on the tiny Llama, driven over HTTP through ``EngineClient``.

The reference is ``peft``'s merged model (``merge_and_unload``) run by transformers in fp32: the
engine's log-probs under an adapter must equal it, base-model requests of the same batch the
plain model's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 13, 17], [1, 7, 3], [1, 20, 21, 22, 23, 24, 25], [1, 40, 41, 42]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, *, seed: int, r: int = 4, **cfg: Any) -> Path:
    """A PEFT adapter with random A and B (peft's B starts at zero: no effect) saved with
    ``save_pretrained``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=cfg.pop("lora_alpha", 2 * r),
        target_modules=cfg.pop("target_modules", TARGETS),
        lora_dropout=0.1,  # a training-time setting: the engine must not apply it
        init_lora_weights=False,
        **cfg,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.15)
    peft_model.save_pretrained(out)
    return out


def merged(base: Path, adapter: Path) -> Any:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def adapter_tensors(path: Path) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    from safetensors.torch import load_file

    config = json.loads((path / "adapter_config.json").read_text())
    return config, list(load_file(path / "adapter_model.safetensors").items())


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny_model, root / "a", seed=1),
        "b": make_adapter(tiny_model, root / "b", seed=2, r=8, use_rslora=True),
        # attention only, another rank: stacked with the others in one batch
        "c": make_adapter(tiny_model, root / "c", seed=3, r=2, target_modules=["q_proj", "v_proj"]),
        "big": make_adapter(tiny_model, root / "big", seed=4, r=16),
    }


def start(model: Path, **options: Any) -> Iterator[tuple[Any, str]]:
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    opts = EmbeddedEngineConfig(
        max_running_requests=8,
        context_length=64,
        num_threads=1,
        startup_timeout_s=120,
        **options,
    )
    launcher = build(opts)
    url = launcher.launch(str(model), index=0)
    try:
        yield launcher, url
    finally:
        launcher.shutdown()


@pytest.fixture(scope="module")
def lora_server(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[str]:
    """A LoRA server: adapter "a" loaded at start (lora_paths), rank <= 8, 5 adapters held."""
    yield from (
        url
        for _, url in start(
            tiny_model,
            enable_lora=True,
            max_lora_rank=8,
            max_loaded_loras=5,
            lora_paths=[f"a={adapters['a']}"],
        )
    )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def generate_batch(
    url: str, prompts: list[list[int]], loras: list[str | None], **extra: Any
) -> list[dict[str, Any]]:
    from miles_engine_client import EngineClient

    async with EngineClient(url) as c:
        body = {
            "input_ids": prompts,
            "sampling_params": GREEDY,
            "return_logprob": True,
            "lora_path": loras,
            **extra,
        }
        return list(await c.request("POST", "/generate", body))


def assert_same(x: dict[str, Any], y: dict[str, Any]) -> None:
    """The same tokens, and log-probs within 1e-5 (two adapters in one batch take different
    columns of the stacked weights: their products may round differently in the last bit)."""
    (tx, lx), (ty, ly) = tokens_and_logprobs(x), tokens_and_logprobs(y)
    assert tx == ty
    assert max(abs(a - b) for a, b in zip(lx, ly, strict=True)) < 1e-5


def tokens_and_logprobs(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    lps = answer["meta_info"]["output_token_logprobs"]
    return list(answer["output_ids"]), [x[0] for x in lps]


async def ensure_loaded(url: str, adapters: dict[str, Path], *names: str) -> None:
    from miles_engine_client import EngineClient

    async with EngineClient(url) as c:
        loaded = (await c.get_server_info())["loaded_lora_adapters"]
        for n in names:
            if n not in loaded:
                await c.load_lora_adapter(n, str(adapters[n]))


def test_server_info_reports_lora(lora_server: str, adapters: dict[str, Path]) -> None:
    from miles_engine_client import EngineClient

    async def go() -> dict[str, Any]:
        async with EngineClient(lora_server) as c:
            return await c.get_server_info()

    info = run(go())
    assert info["enable_lora"] is True
    assert info["max_lora_rank"] == 8
    assert info["max_loras_per_batch"] == 8
    assert info["lora_target_modules"] == TARGETS
    assert info["loaded_lora_adapters"]["a"] == str(adapters["a"])


def test_adapter_logprobs_equal_peft_merged_models(
    lora_server: str,
    adapters: dict[str, Path],
    tiny_model: Path,
    reference: Any,
    teacher_forced: Any,
) -> None:
    """One batch: two adapters (one loaded from tensors), the base twice; each row's log-probs
    equal its own reference model's teacher-forced ones within 1e-5."""
    from miles_engine_client import EngineClient

    async def load_c() -> None:
        async with EngineClient(lora_server) as c:
            loaded = (await c.get_server_info())["loaded_lora_adapters"]
            if "c" not in loaded:
                config, named = adapter_tensors(adapters["c"])
                answer = await c.load_lora_adapter_from_tensors("c", named, config)
                assert answer["loaded_adapters"]["c"] == "__tensor__"

    run(ensure_loaded(lora_server, adapters, "b"))
    run(load_c())
    loras: list[str | None] = ["a", None, "b", "c"]
    out = run(generate_batch(lora_server, PROMPTS, loras))
    for prompt, lora, answer in zip(PROMPTS, loras, out, strict=True):
        model = reference if lora is None else merged(tiny_model, adapters[lora])
        toks, lps = tokens_and_logprobs(answer)
        want = teacher_forced(model, prompt, toks)
        assert max(abs(x - y) for x, y in zip(lps, want, strict=True)) < 1e-5, lora
    # an adapter changes what is generated: the test above is not vacuous
    base = run(generate_batch(lora_server, [PROMPTS[0]], [None]))[0]
    assert tokens_and_logprobs(base)[1] != tokens_and_logprobs(out[0])[1]


def test_mixed_batch_equals_each_request_alone(lora_server: str, adapters: dict[str, Path]) -> None:
    run(ensure_loaded(lora_server, adapters, "b"))
    loras: list[str | None] = ["b", "a", None, "a"]
    mixed = run(generate_batch(lora_server, PROMPTS, loras))
    for prompt, lora, answer in zip(PROMPTS, loras, mixed, strict=True):
        alone = run(generate_batch(lora_server, [prompt], [lora]))[0]
        t_mixed, lp_mixed = tokens_and_logprobs(answer)
        t_alone, lp_alone = tokens_and_logprobs(alone)
        assert t_mixed == t_alone
        assert max(abs(x - y) for x, y in zip(lp_mixed, lp_alone, strict=True)) < 1e-5


def test_input_logprobs_use_the_adapter(
    lora_server: str, adapters: dict[str, Path], tiny_model: Path, teacher_forced: Any
) -> None:
    """The scoring path (prompt log-probs) applies the adapter too."""
    prompt = PROMPTS[2]
    out = run(
        generate_batch(
            lora_server,
            [prompt],
            ["a"],
            sampling_params={"max_new_tokens": 0},
            logprob_start_len=1,
        )
    )[0]
    got = [x[0] for x in out["meta_info"]["input_token_logprobs"]][1:]
    want = teacher_forced(merged(tiny_model, adapters["a"]), prompt[:2], prompt[2:])
    assert max(abs(x - y) for x, y in zip(got, want, strict=True)) < 1e-5


def test_folder_and_tensors_give_the_same_outputs(
    lora_server: str, adapters: dict[str, Path]
) -> None:
    """The same adapter from its folder, from (name, tensor) pairs with peft's in-memory names
    (``.default`` infix, no ``base_model.model.`` prefix) and from a flattened bucket."""
    import torch
    from miles_engine_client import EngineClient
    from miles_transport_common.bucketing import Manifest, Piece
    from miles_transport_common.payload import bucket_payload

    config, named = adapter_tensors(adapters["b"])
    renamed = [
        (n.removeprefix("base_model.model.").replace(".weight", ".default.weight"), t)
        for n, t in named
    ]

    def bucket() -> dict[str, Any]:
        pieces, chunks, offset = [], [], 0
        for n, t in named:
            raw = t.contiguous().view(torch.uint8).flatten()
            pieces.append(
                Piece(name=n, dtype="float32", shape=tuple(t.shape), offset=offset,
                      nbytes=raw.numel(), start=0, total=raw.numel())
            )  # fmt: skip
            chunks.append(raw)
            offset += raw.numel()
        data = torch.cat(chunks)
        return bucket_payload(data, Manifest(seq=0, nbytes=offset, checksum="", pieces=pieces), {})

    async def go() -> None:
        async with EngineClient(lora_server) as c:
            await c.load_lora_adapter("b_dir", str(adapters["b"]))
            await c.load_lora_adapter_from_tensors("b_pairs", renamed, config)
            await c.unload_lora_adapter("b_pairs")
            await c.load_lora_adapter_from_tensors(
                "b_bucket", bucket(), config, load_format="flattened_bucket"
            )

    run(ensure_loaded(lora_server, adapters, "b"))
    run(go())
    try:
        out = run(generate_batch(lora_server, [PROMPTS[0]] * 2, ["b_dir", "b_bucket"]))
        assert_same(out[0], out[1])
    finally:

        async def clean() -> None:
            async with EngineClient(lora_server) as c:
                await c.unload_lora_adapter("b_dir")
                await c.unload_lora_adapter("b_bucket")

        run(clean())
    # the pairs' load gave the same adapter as well
    run(go_pairs(lora_server, renamed, config))


async def go_pairs(url: str, renamed: list[tuple[str, Any]], config: dict[str, Any]) -> None:
    from miles_engine_client import EngineClient

    async with EngineClient(url) as c:
        await c.load_lora_adapter_from_tensors("b_pairs", renamed, config)
    try:
        out = await generate_batch(url, [PROMPTS[0]] * 2, ["b", "b_pairs"])
        assert_same(out[0], out[1])
    finally:
        async with EngineClient(url) as c:
            await c.unload_lora_adapter("b_pairs")


async def client_call(url: str, method: str, *args: Any) -> Any:
    from miles_engine_client import EngineClient

    async with EngineClient(url) as c:
        return await getattr(c, method)(*args)


async def lora_call(url: str, endpoint: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(url + endpoint, json=body) as resp:
        return resp.status, await resp.json()


def test_refusals_change_nothing(lora_server: str, adapters: dict[str, Path]) -> None:
    """Rank above max_lora_rank, another base's shapes, a module the model lacks, a name
    already loaded, and more adapters than max_loaded_loras: each a 400 naming the field, and
    the loaded adapters and what they generate unchanged."""
    from miles_engine_client import EngineClient, EngineHTTPError

    run(ensure_loaded(lora_server, adapters, "b"))
    before = run(generate_batch(lora_server, [PROMPTS[1]], ["a"]))[0]
    loaded = run(client_call(lora_server, "get_server_info"))["loaded_lora_adapters"]

    status, body = run(
        lora_call(
            lora_server, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["big"])}
        )
    )
    assert status == 400 and body["success"] is False
    assert "max_lora_rank" in body["error_message"] and "16" in body["error_message"]
    assert body["loaded_adapters"] == loaded

    # an adapter of another base (inputs 32 wide): the shapes do not fit
    config, named = adapter_tensors(adapters["a"])
    wrong = [(n, t[:, :32] if "lora_A" in n else t) for n, t in named]
    with pytest.raises(EngineHTTPError) as err:
        run(client_call(lora_server, "load_lora_adapter_from_tensors", "x", wrong, config))
    assert err.value.status == 400
    assert "do not fit the base linear" in err.value.message
    assert "lora_A (4, 32)" in err.value.message and "expected lora_A (4, " in err.value.message
    missing = [(n.replace("layers.0.", "layers.7."), t) for n, t in named]
    with pytest.raises(EngineHTTPError, match=r"no module 'model\.layers\.7"):
        run(client_call(lora_server, "load_lora_adapter_from_tensors", "x", missing, config))
    with pytest.raises(EngineHTTPError, match="already loaded"):
        run(client_call(lora_server, "load_lora_adapter", "a", str(adapters["b"])))

    async def fill() -> None:
        async with EngineClient(lora_server) as c:
            n = len((await c.get_server_info())["loaded_lora_adapters"])
            for i in range(5 - n):
                await c.load_lora_adapter(f"fill{i}", str(adapters["c"]))
            with pytest.raises(EngineHTTPError, match="max_loaded_loras"):
                await c.load_lora_adapter("one_more", str(adapters["c"]))
            for i in range(5 - n):
                await c.unload_lora_adapter(f"fill{i}")

    run(fill())
    assert run(client_call(lora_server, "get_server_info"))["loaded_lora_adapters"] == loaded
    after = run(generate_batch(lora_server, [PROMPTS[1]], ["a"]))[0]
    assert tokens_and_logprobs(after) == tokens_and_logprobs(before)


def test_unloaded_adapter_is_refused_by_name(lora_server: str, adapters: dict[str, Path]) -> None:
    from miles_engine_client import EngineClient, EngineHTTPError

    async def go() -> None:
        async with EngineClient(lora_server) as c:
            await c.load_lora_adapter("gone", str(adapters["c"]))
            await c.generate([1, 2, 3], GREEDY, lora_path="gone")
            answer = await c.unload_lora_adapter("gone")
            assert "gone" not in answer["loaded_adapters"]
            with pytest.raises(EngineHTTPError, match="'gone' is not loaded") as err:
                await c.generate([1, 2, 3], GREEDY, lora_path="gone")
            assert err.value.status == 400
            with pytest.raises(EngineHTTPError, match="'gone' is not loaded"):
                await c.unload_lora_adapter("gone")

    run(go())
    status, _ = run(generate_batch_status(lora_server, ["a", "nope"]))
    assert status == 400


async def generate_batch_status(url: str, loras: list[str | None]) -> tuple[int, Any]:
    body = {"input_ids": [[1, 2], [1, 3]], "sampling_params": GREEDY, "lora_path": loras}
    return await lora_call(url, "/generate", body)


def test_prefix_is_never_shared_across_adapters(
    lora_server: str, adapters: dict[str, Path]
) -> None:
    """One batch of the same prompt under "a", the base, "a" again and "b": the engine forwards
    an identical sequence once and copies it to its twins (prefill_tokens_shared), but only
    between requests of the same adapter. Were the key blind to the adapter, the base and "b"
    rows would copy "a"'s keys, values and logits and answer as "a" does."""

    run(ensure_loaded(lora_server, adapters, "b"))
    prompt = PROMPTS[2]
    loras: list[str | None] = ["a", None, "a", "b"]
    info = run(client_call(lora_server, "get_server_info"))["internal_states"][0]
    out = run(generate_batch(lora_server, [prompt] * 4, loras))
    after = run(client_call(lora_server, "get_server_info"))["internal_states"][0]
    assert after["prefill_tokens_shared"] - info["prefill_tokens_shared"] == len(prompt)
    assert_same(out[0], out[2])
    for lora, answer in zip(loras, out, strict=True):
        alone = run(generate_batch(lora_server, [prompt], [lora]))[0]
        assert_same(answer, alone)
    firsts = {tokens_and_logprobs(a)[1][0] for a in (out[0], out[1], out[3])}
    assert len(firsts) == 3


def test_lora_is_refused_when_not_enabled(server: str) -> None:
    """The conftest server has no enable_lora: SGLang's 400 "LoRA is not enabled"."""
    for endpoint, body in (
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}),
        ("/unload_lora_adapter", {"lora_name": "a"}),
    ):
        status, answer = run(lora_call(server, endpoint, body))
        assert status == 400 and "LoRA is not enabled" in answer["error_message"]
    status, answer = run(generate_batch_status(server, ["a", None]))
    assert status == 400 and "not enabled" in answer["error"]["message"]


def test_model_forward_fallback_applies_adapters(
    tiny_model: Path, adapters: dict[str, Path], reference: Any, teacher_forced: Any
) -> None:
    """With lean_forward off (the model's own forward, adapters added by forward hooks)."""
    for _, url in start(tiny_model, lean_forward=False, lora_paths=[f"b={adapters['b']}"]):
        out = run(generate_batch(url, PROMPTS[:2], ["b", None]))
        for lora, prompt, answer in zip(["b", None], PROMPTS[:2], out, strict=True):
            model = reference if lora is None else merged(tiny_model, adapters["b"])
            toks, lps = tokens_and_logprobs(answer)
            want = teacher_forced(model, prompt, toks)
            assert max(abs(x - y) for x, y in zip(lps, want, strict=True)) < 1e-5


def test_packed_rows_apply_each_rows_adapter(
    tiny_model: Path, adapters: dict[str, Path], reference: Any, teacher_forced: Any
) -> None:
    """Prompts of two adapters and the base admitted while requests of other adapters run:
    their rows are packed with the running requests' decode rows in one forward, each row
    with its own adapter; every log-prob equals its own reference model's."""
    import torch
    from miles_engine_embedded.engine import Engine, Request
    from miles_engine_embedded.protocol import SamplingParams
    from miles_engine_embedded.sampling import UniformStream
    from miles_engine_embedded.weights import ModelHolder

    torch.set_num_threads(1)
    holder = ModelHolder(
        str(tiny_model), device="cpu", dtype="float32", weight_version="0",
        lora={"max_lora_rank": 8},
    )  # fmt: skip
    for name in ("a", "b"):
        config, named = adapter_tensors(adapters[name])
        holder.set_adapter(name, config, named, path=str(adapters[name]))
    engine = Engine(holder, max_running_requests=6, max_total_tokens=600, context_length=100,
                    seed=0)  # fmt: skip
    done: list[Any] = []

    def submit(i: int, prompt: list[int], lora: str | None) -> None:
        sp = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0)
        engine._enqueue(Request(rid=str(i), input_ids=prompt, params=sp, return_logprob=True,
                                on_done=done.append, uniforms=UniformStream(i),
                                lora=lora))  # fmt: skip

    with torch.no_grad():
        submit(0, PROMPTS[0], "a")
        submit(1, PROMPTS[1], None)
        assert not engine._admit()
        engine._decode_step()
        submit(2, PROMPTS[2], "b")
        submit(3, PROMPTS[3], "a")
        submit(4, PROMPTS[0], None)  # request 0's prompt, under the base model
        assert engine._admit()  # packed: 2 decode rows, then 7 + 4 + 5 prompt rows
        assert engine.prefill_forwarded == 5 + 3 + 7 + 4 + 5 and engine.steps == 2
        while engine.running:
            engine._decode_step()
    assert len(done) == 5
    for r in done:
        model = reference if r.lora is None else merged(tiny_model, adapters[r.lora])
        want = teacher_forced(model, r.input_ids, r.output_ids)
        # 3e-5: the decode rows attend through the native kernel, which rounds otherwise than
        # SDPA (each within about 2e-7 of a float64 attention: test_embedded_native.py)
        assert max(abs(x - y) for x, y in zip(r.logprobs, want, strict=True)) < 3e-5, r.rid
