"""The native kernels of the lean forward (``native_kernels.c``), built at run time.

The decode attention (a decode row reads only its own positions of the KV cache, its query
heads sharing a key/value head together, in one call per layer), the fused element-wise steps
of a dense layer, and the plain draw of the sampler (see the C file). The library is compiled
once per machine with the C compiler found (``$CC``, else ``gcc``, else ``cc``) and kept in a
cache folder (``$MILES_KERNEL_CACHE``, else ``~/.cache/miles/kernels``) under a name that
hashes the source, the flags, the compiler's version and the CPU's model and flags: another
machine or compiler builds its own. It links the OpenMP runtime torch already loaded, so it
runs on torch's threads, as many as ``torch.get_num_threads()`` (passed on every call).

``attention`` (the engine option) picks it: ``auto`` uses it where it applies (float32 on the
CPU, head_dim a multiple of 16 up to 256) and it builds, else SDPA; ``native`` raises where it
cannot; ``sdpa`` never uses it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
ATTENTION = ("auto", "native", "sdpa")


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


def _compiler() -> str:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C compiler found ($CC, gcc, cc)")


def _cpu() -> str:
    """The CPU's model and feature flags (``-march=native`` builds for them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))  # every core repeats them


def _cache_dir() -> Path:
    env = os.environ.get("MILES_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "miles" / "kernels"


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run(
                [cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120
            )
        except subprocess.SubprocessError as exc:  # a compiler that hangs past 2 minutes
            raise NativeUnavailable(f"{cc} did not build {SOURCE.name}: {exc}") from exc
        if done.returncode != 0:
            raise NativeUnavailable(
                f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-800:]}"
            )
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL:
    """The built kernel library, loaded (raises :class:`NativeUnavailable` with the reason)."""
    cc = _compiler()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{cc} --version failed: {exc}") from exc
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu()]).encode()
    ).hexdigest()[:16]
    path = _cache_dir() / f"native_kernels-{key}.so"
    if not path.exists():
        try:
            _build(cc, path)
        except OSError as exc:  # an unwritable cache folder: build in a temporary one
            path = Path(tempfile.gettempdir()) / "miles-kernels" / path.name
            if not path.exists():
                try:
                    _build(cc, path)
                except OSError as exc2:
                    raise NativeUnavailable(f"cannot write the kernel: {exc}; {exc2}") from exc2
        log.info("built the native kernels: %s", path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeUnavailable(f"cannot load {path}: {exc}") from exc
    fn = lib.miles_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr]
    fn.argtypes += [i64] * 6 + [ctypes.c_float, i64]
    fn.restype = ctypes.c_int
    fn = lib.miles_add_rms_norm
    fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, ctypes.c_float, ptr, i64, i64, i64, i64]
    fn.restype = None
    fn = lib.miles_rope_store
    fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    fn.restype = None
    fn = lib.miles_sample
    fn.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64]
    fn.restype = None
    fn = lib.miles_silu_mul
    fn.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, i64]
    fn.restype = None
    return lib


def applies(dtype: torch.dtype, device: torch.device, heads: int, kv_heads: int, hd: int) -> str:
    """Why the kernel does not apply to a model of this kind ('' when it does)."""
    if dtype != torch.float32:
        return f"dtype {dtype} (the kernel is float32)"
    if device.type != "cpu":
        return f"device {device.type} (the kernel runs on the CPU)"
    if hd % 16 or hd > 256:
        return f"head_dim {hd} (a multiple of 16 up to 256)"
    if heads % kv_heads or heads // kv_heads > 16:
        return f"{heads} heads over {kv_heads} kv heads (up to 16 per kv head)"
    return ""


def resolve(attention: str, why_not: str) -> bool:
    """Whether the lean forward uses the native kernel, for the option ``attention`` and the
    model's reason it does not apply (``why_not``, '' when it does)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention: {attention!r}; allowed: {', '.join(ATTENTION)}")
    if attention == "sdpa":
        return False
    try:
        if why_not:
            raise NativeUnavailable(f"it does not apply: {why_not}")
        library()
    except NativeUnavailable as exc:
        if attention == "native":
            raise ValueError(f"attention: 'native' is not available: {exc}") from exc
        log.warning("native decode attention not used (%s); using SDPA", exc)
        return False
    return True


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
) -> None:
    """Row ``r`` of ``q [rows, heads, 1, head_dim]`` (any strides, unit along ``head_dim``)
    attends over positions ``[0, lengths[r])`` of slot ``slots[r]`` (default ``r``) of the
    caches ``[slots, kv_heads, length, head_dim]``; its heads are written to row ``r`` of
    ``out [rows, heads * head_dim]`` (contiguous). ``lengths``/``slots``: int64, contiguous."""
    rows, heads, _, hd = q.shape
    kv_heads = k_cache.shape[1]
    if q.stride(3) != 1:
        q = q.contiguous()
    assert out.is_contiguous() and lengths.dtype == torch.int64
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.stride(2) == hd and lengths.is_contiguous()
    rc = library().miles_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        None if slots is None else slots.data_ptr(), lengths.data_ptr(),
        out.data_ptr(), heads * hd, hd,
        rows, heads, kv_heads, hd, scale, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"decode attention: unsupported shape {tuple(q.shape)} / {kv_heads}")


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``h += delta`` in place (when ``delta`` is given: any strides, ``h``'s shape), then the
    RMS norm of ``h`` over its last axis times ``weight``, as a new tensor of ``h``'s shape
    (``h``: contiguous float32)."""
    n = h.shape[-1]
    assert h.is_contiguous() and weight.is_contiguous()
    h2 = h.view(-1, n)
    out = torch.empty_like(h)
    d_ptr, d_row, d_col = None, 0, 0
    if delta is not None:
        d2 = delta.reshape(-1, n)
        d_ptr, d_row, d_col = d2.data_ptr(), d2.stride(0), d2.stride(1)
    library().miles_add_rms_norm(
        h2.data_ptr(), n, d_ptr, d_row, d_col, weight.data_ptr(), eps, out.data_ptr(), n,
        h2.shape[0], n, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2 * inter]`` (the gate first), in the layout of
    ``gate_up``: a product's transposed ``[out, rows]`` result gives a ``[rows, inter]`` view of
    an ``[inter, rows]`` tensor (what the next product in that layout reads as it is)."""
    lead = gate_up.shape[:-1]
    g2 = gate_up.reshape(-1, 2 * inter)
    rows = g2.shape[0]
    lib = library()
    if g2.stride(0) == 1 and rows > 1:  # [2 * inter, rows] in memory, columns s apart
        s = g2.stride(1)
        out = g2.new_empty(inter, rows)
        p = g2.data_ptr()
        lib.miles_silu_mul(
            p, p + inter * s * 4, s, out.data_ptr(), rows, inter, rows, torch.get_num_threads()
        )
        return out.t().reshape(*lead, inter)
    if g2.stride(1) != 1:
        g2 = g2.contiguous()
    out = g2.new_empty(rows, inter)
    p = g2.data_ptr()
    lib.miles_silu_mul(
        p, p + inter * 4, g2.stride(0), out.data_ptr(), inter, rows, inter, torch.get_num_threads()
    )
    return out.view(*lead, inter)


def rope_store(
    y: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dst: torch.Tensor,
    heads: int,
    head_dim: int,
) -> torch.Tensor:
    """The rotary embedding and cache store of a forward's rows: ``y [..., (heads + 2 *
    kv_heads) * head_dim]`` (the q/k/v product, in either layout: rows-first, or a transposed
    product's result read where it lies), ``cos``/``sin [..., head_dim]`` (``sin``'s
    first half negated, as ``fast_forward._rotate`` takes it); the rotated keys and the values
    go to the cache rows ``dst [rows, kv_heads]`` (``kv_cache.SlotKVCache.rows``). Returns the
    rotated queries ``[..., heads * head_dim]``, contiguous."""
    width = y.shape[-1]
    y2 = y.reshape(-1, width)
    if y2.stride(1) != 1 and y2.stride(0) != 1:
        y2 = y2.contiguous()
    rows = y2.shape[0]
    kv_heads = (width // head_dim - heads) // 2
    c2, s2 = cos.reshape(rows, head_dim), sin.reshape(rows, head_dim)
    assert c2.is_contiguous() and s2.is_contiguous() and dst.is_contiguous()
    assert dst.shape == (rows, kv_heads) and k_cache.is_contiguous() and v_cache.is_contiguous()
    q = y2.new_empty(*y.shape[:-1], heads * head_dim)
    library().miles_rope_store(
        y2.data_ptr(), y2.stride(0), y2.stride(1), c2.data_ptr(), s2.data_ptr(), q.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), dst.data_ptr(), rows, heads, kv_heads,
        head_dim, torch.get_num_threads(),
    )  # fmt: skip
    return q


def sample(
    logits: torch.Tensor, uniforms: list[float], greedy: list[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` (float32, rows-first or tokens-first: a
    product's result in either layout, uncopied) from the raw distribution (temperature 1,
    no top-k or top-p) by the inverse CDF at ``uniforms`` (the first maximum where
    ``greedy``), and its raw log-prob: ``(tokens int64 [B], logprobs float32 [B])``, the plain
    case of :func:`.sampling.sample` in one call."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 and logits.stride(0) != 1:
        logits = logits.contiguous()
    u = torch.tensor(uniforms, dtype=torch.float64)
    g = torch.tensor(greedy, dtype=torch.uint8)
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    blocks = -(-vocab // 1024)
    scratch = torch.empty(2 * blocks * rows, dtype=torch.float32)
    library().miles_sample(
        logits.data_ptr(), logits.stride(0), logits.stride(1), vocab, rows, u.data_ptr(),
        g.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(), scratch.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return tokens, logprobs
