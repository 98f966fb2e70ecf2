"""The native kernels (``native_kernels.c`` via :mod:`miles_engine_embedded.native`): built
with the machine's compiler; the decode attention equal to a float64 attention within float32
rounding and used by the lean forward where it applies; the fused element-wise steps and the
plain draw equal to the torch operations they replace; the option's errors.

They need a C compiler (``$CC``, ``gcc`` or ``cc``) and fail, rather than skip, where the
kernels cannot be built: ``attention: auto`` would then fall back to SDPA, and the kernels
would go untested."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from miles_engine_embedded import native
from miles_engine_embedded.engine import Engine, Request
from miles_engine_embedded.protocol import SamplingParams
from miles_engine_embedded.weights import ModelHolder


def _reference(q, k_cache, v_cache, lengths, slots, scale):  # type: ignore[no-untyped-def]
    """Each row on its own, in float64: ``[rows, heads * d]``."""
    rows, heads = q.shape[:2]
    groups = heads // k_cache.shape[1]
    out = []
    for r in range(rows):
        s, n = int(slots[r]), int(lengths[r])
        k = k_cache[s, :, :n].double().repeat_interleave(groups, 0)
        v = v_cache[s, :, :n].double().repeat_interleave(groups, 0)
        o = F.scaled_dot_product_attention(q[r].double(), k, v, scale=scale)  # [heads, 1, d]
        out.append(o.reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (8, 8, 64), (16, 2, 128), (4, 2, 16), (24, 2, 32), (5, 1, 48)],
)
def test_kernel_equals_a_float64_attention_over_each_rows_own_positions(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """Specialised shapes (head_dim 64/128, up to 8 query heads per kv head) and the general
    path (head_dim 16, 32, 48; 12 or 5 query heads per kv head); rows of length 1 and of a
    length whose scores outgrow the kernel's stack buffer; rows reading other slots than
    their own; a query with strides (tokens-first, as the forward makes it)."""
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
    slots_n, cap = 6, 2048
    k_cache = torch.randn(slots_n, kv_heads, cap, head_dim, generator=gen)
    v_cache = torch.randn(slots_n, kv_heads, cap, head_dim, generator=gen)
    lengths = torch.tensor([1, 7, 300, 2000, 64], dtype=torch.int64)
    slots = torch.tensor([5, 0, 3, 1, 2], dtype=torch.int64)
    rows = lengths.numel()
    q = torch.randn(rows, 1, heads, head_dim, generator=gen).transpose(1, 2)  # strided view
    scale = head_dim**-0.5
    out = torch.full((rows, heads * head_dim), float("nan"))
    native.decode_attention(q, k_cache, v_cache, lengths, out, scale, slots=slots)
    want = _reference(q, k_cache, v_cache, lengths, slots, scale)
    assert (out.double() - want).abs().max().item() < 2e-6
    # without ``slots``, row r reads slot r
    out2 = torch.empty_like(out)
    native.decode_attention(q, k_cache, v_cache, lengths, out2, scale)
    want2 = _reference(q, k_cache, v_cache, lengths, torch.arange(rows), scale)
    assert (out2.double() - want2).abs().max().item() < 2e-6


def test_kernel_is_as_accurate_as_sdpa_on_a_batched_decode() -> None:
    """Against the batched masked SDPA the lean forward used before: both within float32
    rounding of the float64 attention, and the kernel's error no larger in the mean."""
    gen = torch.Generator().manual_seed(0)
    b, heads, kv, d, cap = 16, 9, 3, 64, 512
    k_cache = torch.randn(b, kv, cap, d, generator=gen)
    v_cache = torch.randn(b, kv, cap, d, generator=gen)
    lengths = torch.randint(1, cap, (b,), generator=gen)
    q = torch.randn(b, heads, 1, d, generator=gen)
    visible = int(lengths.max())
    seen = torch.arange(visible).view(1, -1) < lengths.view(-1, 1)
    mask = torch.zeros(b, 1, 1, visible).masked_fill_(~seen.view(b, 1, 1, -1), float("-inf"))
    sdpa = F.scaled_dot_product_attention(
        q.reshape(b, kv, heads // kv, d),
        k_cache[:, :, :visible],
        v_cache[:, :, :visible],
        attn_mask=mask,
        scale=0.125,
    ).reshape(b, heads * d)
    out = torch.empty(b, heads * d)
    native.decode_attention(q, k_cache, v_cache, lengths, out, 0.125)
    want = _reference(q, k_cache, v_cache, lengths, torch.arange(b), 0.125)
    err_native = (out.double() - want).abs()
    err_sdpa = (sdpa.double() - want).abs()
    assert err_native.max().item() < 1e-6 and err_sdpa.max().item() < 1e-6
    assert err_native.mean().item() <= 1.5 * err_sdpa.mean().item()


def test_the_library_is_built_into_the_cache_folder_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$MILES_KERNEL_CACHE`` holds the build, named by a hash of the source, the flags, the
    compiler and the CPU; a second load reuses the file."""
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path))
    build = native.library.__wrapped__  # the uncached loader
    lib = build()
    files = list(tmp_path.glob("native_kernels-*.so"))
    assert len(files) == 1 and lib.miles_decode_attention
    stamp = files[0].stat().st_mtime_ns
    build()
    assert [f.stat().st_mtime_ns for f in tmp_path.glob("*.so")] == [stamp]


def test_the_attention_option_is_checked_and_auto_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"attention: 'flash'; allowed: auto, native, sdpa"):
        native.resolve("flash", "")
    assert native.resolve("sdpa", "") is False
    assert native.resolve("auto", "") is True
    why = native.applies(torch.bfloat16, torch.device("cpu"), 4, 2, 16)
    assert why.startswith("dtype torch.bfloat16")
    with pytest.raises(ValueError, match=r"attention: 'native' is not available: .*bfloat16"):
        native.resolve("native", why)
    assert native.applies(torch.float32, torch.device("cpu"), 4, 2, 20).startswith("head_dim 20")
    monkeypatch.setattr(native, "library", native.library.__wrapped__)
    # a compiler that fails: auto warns and uses SDPA, native says why it cannot
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("MILES_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.resolve("auto", "") is False
    assert "false failed to build native_kernels.c" in caplog.text
    with pytest.raises(ValueError, match="attention: 'native' is not available: false failed"):
        native.resolve("native", "")
    assert not list(tmp_path.iterdir())  # nothing left behind
    # no compiler at all
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.resolve("auto", "") is False
    assert "no C compiler found" in caplog.text
    with pytest.raises(ValueError, match="no C compiler found"):
        native.resolve("native", "")


def _engine(path: Path, attention: str) -> Engine:
    holder = ModelHolder(
        str(path), device="cpu", dtype="float32", weight_version="0", attention=attention
    )
    return Engine(holder, max_running_requests=3, max_total_tokens=512, context_length=128, seed=0)


def test_the_engine_decodes_through_the_kernel_and_matches_the_model(
    tiny_model: Path, teacher_forced, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """With ``attention: native`` the lean forward's decode rows (plain decode steps and the
    decode rows of packed steps) go through the kernel, and every log-prob equals the
    teacher-forced model's; ``sdpa`` never calls it."""
    calls: list[int] = []
    real = native.decode_attention

    def spy(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(native, "decode_attention", spy)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    for attention in ("native", "sdpa"):
        calls.clear()
        engine = _engine(tiny_model, attention)
        assert engine.holder.lean is not None and engine.holder.lean.native is (
            attention == "native"
        )
        done: list[Request] = []
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 4], [20, 21, 22, 23]]
        for i, p in enumerate(prompts):  # three slots: the fourth joins while others decode
            engine._enqueue(
                Request(
                    rid=str(i),
                    input_ids=p,
                    params=SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True),
                    return_logprob=True,
                    on_done=done.append,
                    uniforms=engine.new_stream(i),
                )
            )
        while not engine.idle:
            if not engine._admit() and engine.running:
                engine._decode_step()
        assert len(done) == 4
        for r in done:
            want = teacher_forced(model, r.input_ids, r.output_ids)
            assert max(abs(x - y) for x, y in zip(r.logprobs, want, strict=True)) < 1e-5
        if attention == "native":
            assert calls and max(calls) == 3 and 1 in calls, calls
        else:
            assert not calls


@pytest.mark.parametrize("layout", ["rows", "transposed", "padded", "none"])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_add_rms_norm_equals_the_torch_steps(layout: str, rows: int) -> None:
    """The residual add (a product's result in either layout, or none) and the RMS norm of
    the lean forward's torch path, within float32 rounding; 300 rows of 576 take the parallel
    path."""
    gen = torch.Generator().manual_seed(rows)
    n = 576
    h = torch.randn(rows, n, generator=gen)
    w = torch.randn(n, generator=gen)
    if layout == "rows":
        delta = torch.randn(rows, n, generator=gen)
    elif layout == "transposed":
        delta = torch.randn(n, rows, generator=gen).t()
    elif layout == "padded":  # the transposed result of a product over padded rows
        delta = torch.randn(n, rows + 3, generator=gen).t()[:rows]
    else:
        delta = None
    want_h = h if delta is None else h + delta
    want = w * (want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = native.add_rms_norm(h, delta, w, 1e-5)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)  # the add is exact, and in place
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("layout", ["rows", "transposed", "padded"])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_mul_equals_torch_and_keeps_the_layout(layout: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    inter = 1536
    if layout == "rows":
        gu = torch.randn(1, rows, 2 * inter, generator=gen) * 8
    elif layout == "transposed":
        gu = (torch.randn(2 * inter, rows, generator=gen) * 8).t().reshape(1, rows, -1)
    else:
        gu = (torch.randn(2 * inter, rows + 2, generator=gen) * 8).t()[:rows].reshape(1, rows, -1)
    gate, up = gu.split(inter, dim=-1)
    want = F.silu(gate) * up
    got = native.silu_mul(gu, inter)
    assert got.shape == (1, rows, inter)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    if layout != "rows" and rows > 1:  # [rows, inter] over an [inter, rows] tensor
        assert got.stride()[1:] == (1, rows)


def test_the_fused_forward_equals_the_torch_forward(tiny_model: Path) -> None:
    """The lean forward with the native kernels (attention, adds, norms, ``silu * up``)
    against the same forward with ``attention: sdpa`` (torch operations only): the logits of
    a padded prefill agree within float32 rounding."""
    holders = {
        a: ModelHolder(str(tiny_model), device="cpu", dtype="float32", weight_version="0",
                       attention=a)
        for a in ("native", "sdpa")
    }  # fmt: skip
    assert holders["native"].lean.fused and not holders["sdpa"].lean.fused
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    pos = torch.arange(6).expand(2, 6)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    with torch.no_grad():
        out = {a: h.lean(ids, pos, mask, _NoCache()) for a, h in holders.items()}
    torch.testing.assert_close(out["native"], out["sdpa"], rtol=1e-5, atol=1e-5)


class _NoCache:
    """A cache that keeps nothing (``update`` returns the step's own keys and values)."""

    packed = None

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        return k, v


@pytest.mark.parametrize("layout", ["rows", "transposed", "padded"])
def test_rope_store_equals_the_rotation_and_the_indexed_store(layout: str) -> None:
    """Queries rotated as ``fast_forward._rotate`` rotates them; keys rotated and values
    copied to the cache rows a ``SlotKVCache`` gives (slots and positions out of order); the
    q/k/v product's result read in either layout (a transposed one over padded rows too)."""
    from miles_engine_embedded.fast_forward import _rotate
    from miles_engine_embedded.kv_cache import SlotKVCache

    gen = torch.Generator().manual_seed(0)
    heads, kv, hd = 6, 2, 64
    cache = SlotKVCache(
        num_layers=1, num_slots=4, num_kv_heads=kv, head_dim=hd, max_length=32,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    cache.ensure(32)
    positions = torch.tensor([3, 0, 17, 9])
    cache.prepare_decode(positions, 18)
    assert cache.rows is not None and cache.rows.shape == (4, kv)
    width = (heads + 2 * kv) * hd
    y = torch.randn(4, 1, width, generator=gen)
    if layout == "transposed":
        y = y.view(4, width).t().contiguous().t().view(4, 1, width)
    elif layout == "padded":
        yt = torch.zeros(width, 7)
        yt[:, :4] = y.view(4, width).t()
        y = yt.t()[:4].reshape(4, 1, width)
    assert (y.stride(-1) == 1) == (layout == "rows")
    cos = torch.randn(4, 1, hd, generator=gen)
    sin = torch.randn(4, 1, hd, generator=gen)
    q = native.rope_store(y, cos, sin, cache.keys[0], cache.values[0], cache.rows, heads, hd)
    heads_of = y.view(4, 1, -1, hd)
    want = _rotate(heads_of, cos.unsqueeze(2), sin.unsqueeze(2))
    torch.testing.assert_close(q.view(4, 1, heads, hd), want[:, :, :heads], rtol=1e-6, atol=1e-6)
    for r, p in enumerate(positions.tolist()):
        got_k, got_v = cache.keys[0][r, :, p], cache.values[0][r, :, p]
        torch.testing.assert_close(got_k, want[r, 0, heads : heads + kv], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_v, heads_of[r, 0, heads + kv :], rtol=0, atol=0)
    assert cache.keys[0].abs().sum(-1).gt(0).sum().item() == 4 * kv  # nothing else written
    k, v = cache.attended(0)
    assert k.shape == v.shape == (4, kv, 18, hd) and k.data_ptr() == cache.keys[0].data_ptr()


@pytest.mark.parametrize("layout", ["rows", "tokens", "padded"])
def test_native_sampling_draws_the_torch_samplers_tokens(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain case of ``sampling.sample`` (temperature 1 or greedy, no top-k/top-p) in one
    call, on logits in either product layout: the same inverse-CDF token for each uniform (a
    vocabulary of several blocks, a dominant token in some rows), the first maximum for
    greedy rows, the raw log-prob within float32 rounding; a filtered row sends the batch to
    the torch path."""
    from miles_engine_embedded import sampling

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 24, 3000
    base = torch.randn(rows, vocab, generator=gen) * 3
    base[:12, 100] = 16.0  # a dominant token in half the rows
    base[1, 2900] = 25.0
    base[1, 7] = 25.0  # two maxima in different blocks: greedy takes the first
    if layout == "rows":
        logits = base.clone()
    elif layout == "tokens":
        logits = base.t().contiguous().t()
    else:  # a transposed product's result over padded rows
        logits = torch.zeros(vocab, rows + 8)
        logits[:, :rows] = base.t()
        logits = logits.t()[:rows]
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64).tolist()
    uniforms[2], uniforms[3] = 0.0, 1.0 - 1e-12
    greedy = [r in (0, 1) for r in range(rows)]
    temps = [0.0 if g else 1.0 for g in greedy]
    kw = {"temperatures": temps, "top_ps": [1.0] * rows, "top_ks": [-1] * rows}
    tokens, lps = sampling.sample(logits, uniforms=uniforms, native_kernel=True, **kw)
    want_t, want_lp = sampling.sample(base, uniforms=uniforms, **kw)
    assert tokens.tolist() == want_t.tolist()
    assert tokens[1].item() == 7 and tokens[0].item() == 100
    torch.testing.assert_close(lps, want_lp, rtol=0, atol=1e-5)
    assert len(set(tokens.tolist())) > 5  # not only the dominant token
    calls: list[int] = []
    real = native.sample
    monkeypatch.setattr(native, "sample", lambda *a: calls.append(1) or real(*a))
    sampling.sample(logits, uniforms=uniforms, native_kernel=True, **kw)
    assert calls == [1]
    top_ps = [1.0] * rows
    top_ps[5] = 0.9
    sampling.sample(logits, uniforms=uniforms, native_kernel=True, **{**kw, "top_ps": top_ps})
    assert calls == [1]
