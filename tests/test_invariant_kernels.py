"""The batch-invariant kernels (:mod:`miles_core.invariant.kernels`): a row's result does not
depend on the rest of the batch, a decode through a KV cache equals a teacher-forced forward
bitwise, and the gradients are the ordinary ones."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from miles_core.invariant import unsupported
from miles_core.invariant.kernels import ROWS, TILE, attention, invariant_mode, linear


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_row_of_a_linear_is_the_same_in_any_batch_and_thread_count(threads: None) -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(384, 160, generator=g), torch.randn(384, generator=g)
    row = torch.randn(1, 160, generator=g)
    ref = linear(row, w, b)[0]
    for n in (1, 2, ROWS - 1, ROWS, ROWS + 1, 5 * ROWS + 3):
        for count in (1, 2):
            torch.set_num_threads(count)
            batch = torch.cat([torch.randn(n - 1, 160, generator=g), row])
            assert torch.equal(linear(batch, w, b)[-1], ref)
            assert torch.equal(linear(batch.view(1, n, 160), w, b)[0, -1], ref)


def test_the_cuda_products_are_one_shape_whatever_the_rows() -> None:
    """CUDA's path (run here on the CPU): every batched product has the same block count, so a
    row's result is the same in any batch, across chunks too, and equals a plain product."""
    from miles_core.invariant.kernels import CUDA_BLOCKS, _fixed_mm

    g = torch.Generator().manual_seed(2)
    w_t = torch.randn(96, 40, generator=g)
    row = torch.randn(1, 96, generator=g)
    ref = torch.empty(1, 40)
    _fixed_mm(row, w_t, ref)
    torch.testing.assert_close(ref, row @ w_t)
    for n in (2, ROWS + 1, ROWS * CUDA_BLOCKS, ROWS * CUDA_BLOCKS + 5):
        batch = torch.cat([torch.randn(n - 1, 96, generator=g), row])
        out = torch.empty(n, 40)
        _fixed_mm(batch, w_t, out)
        assert torch.equal(out[-1], ref[0])
        torch.testing.assert_close(out, batch @ w_t)


def test_the_linear_gradients_are_the_ordinary_ones() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 21, 48, generator=g, requires_grad=True)
    w = torch.randn(32, 48, generator=g, requires_grad=True)
    b = torch.randn(32, generator=g, requires_grad=True)
    up = torch.randn(2, 21, 32, generator=g)
    (linear(x, w, b) * up).sum().backward()
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    (F.linear(x, w, b) * up).sum().backward()
    for mine, theirs in zip(got, (x.grad, w.grad, b.grad), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_attention_matches_sdpa_and_a_query_ignores_later_keys_and_other_queries() -> None:
    g = torch.Generator().manual_seed(2)
    b, h, hkv, length, d = 2, 4, 2, TILE + 37, 16
    q = torch.randn(b, h, length, d, generator=g)
    k = torch.randn(b, hkv, length, d, generator=g)
    v = torch.randn(b, hkv, length, d, generator=g)
    full = attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    for p in (0, 5, TILE - 1, TILE, length - 1):
        # a decode: one query at position p, the keys of a cache padded past it (masked)
        pad = length + TILE + 9
        kc = torch.cat([k[:, :, : p + 1], torch.randn(b, hkv, pad - p - 1, d, generator=g)], 2)
        vc = torch.cat([v[:, :, : p + 1], torch.randn(b, hkv, pad - p - 1, d, generator=g)], 2)
        mask = (torch.arange(pad) <= p).view(1, 1, 1, pad)
        one = attention(q[:, :, p : p + 1], kc, vc, attn_mask=mask, enable_gqa=True)
        assert torch.equal(one[:, :, 0], full[:, :, p])


def _tiny(kind: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from miles_core.invariant.kernels import prepare
    from miles_core.testing.tiny_moe import tiny_moe_config

    torch.manual_seed(0)
    if kind in ("qwen3_moe", "mixtral"):
        config = tiny_moe_config(kind, vocab_size=96, hidden_size=32, expert_size=16)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        with torch.no_grad():  # peaked routers, as in a trained model
            for p in model.parameters():
                p.mul_(4.0 if p.dim() >= 2 else 1.0)
        return prepare(model).eval()
    common = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    if kind == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False)
    else:
        config = Qwen3Config(**common, head_dim=8, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_a_kv_cache_decode_equals_a_padded_teacher_forced_batch_bitwise(kind: str) -> None:
    from transformers import DynamicCache

    model = _tiny(kind)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in (5, 37, TILE + 30, 11)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = s, 1
    # the cache's keyword: ``cache`` in recent transformers, ``past_key_values`` before
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad(), invariant_mode():
        batch = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits, -1)
        for i, s in enumerate(seqs):
            cache = DynamicCache(config=model.config)
            steps = [model(input_ids=s[None, :3], **{kw: cache}).logits[0]]
            for t in range(3, len(s)):
                steps.append(model(input_ids=s[None, t : t + 1], **{kw: cache}).logits[0])
            decoded = torch.log_softmax(torch.cat(steps), -1)
            assert torch.equal(decoded, batch[i, : len(s)]), f"sequence {i}"


def test_outside_the_mode_nothing_changes() -> None:
    with invariant_mode(enabled=False):
        assert F.linear is not linear
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with invariant_mode():
        inside = F.linear(x, w)
    assert torch.equal(inside, linear(x, w))


def test_the_covered_models() -> None:
    assert unsupported({"model_type": "llama"}) is None
    assert unsupported({"text_config": {"model_type": "qwen3"}}) is None
    assert unsupported({"model_type": "mixtral", "sliding_window": None}) is None
    why = unsupported({"model_type": "gpt2"})
    assert why is not None and "gpt2" in why and "qwen3" in why
    assert "sliding" in (unsupported({"model_type": "qwen2", "use_sliding_window": True}) or "")


def test_the_attention_gradients_are_sdpas() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 70, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 70, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 70, 8, generator=g, requires_grad=True)
    up = torch.randn(2, 4, 70, 8, generator=g)
    (attention(q, k, v, is_causal=True, enable_gqa=True) * up).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * up).sum().backward()
    for mine, theirs in zip(got, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
