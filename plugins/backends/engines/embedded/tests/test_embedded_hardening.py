"""The server against hostile and careless bodies: bounded bodies (413 from the header),
4xx for deep nesting, lone surrogates and a vanishing ``top_p``, a bounded wait on a dead
rendezvous, the KV cache given back by ``/flush_cache``, and a fuzz over every body.

One server process (a tiny Llama with a word-level tokenizer, ``dist_timeout`` 2 s) serves the
module; the memory test starts its own long-context server and stops it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

#: the vocabulary of the conftest's tiny model
VOCAB = 128
DIST_TIMEOUT = 2.0
#: the body limits the server states (``miles_engine_embedded.server``): control endpoints,
#: and the weight endpoints' default (``--max-weights-body-mb``)
CONTROL_BODY_LIMIT = 64 << 10
WEIGHTS_BODY_LIMIT = 256 << 20


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny model's vocabulary, so ``text`` bodies are served."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def start_server(model: Path, tmp: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m miles_engine_embedded.server`` on a free port; returns it and its URL once
    ``/health`` answers."""
    port_file = tmp / f"port-{time.monotonic_ns()}"
    log = open(tmp / f"server-{time.monotonic_ns()}.log", "wb")
    cmd = [
        sys.executable, "-m", "miles_engine_embedded.server",
        "--model-path", str(model),
        "--port", "0",
        "--port-file", str(port_file),
        "--num-threads", "1",
        "--dist-timeout", str(DIST_TIMEOUT),
        *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {Path(log.name).read_text()[-2000:]}")
        if port_file.exists() and port_file.read_text().strip():
            url = f"http://127.0.0.1:{int(port_file.read_text())}"
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not answer /health in 120 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, make_model: Any) -> Path:
    """The conftest's tiny Llama with a word-level tokenizer."""
    model = make_model(tmp_path_factory.mktemp("hardening-model"))
    save_word_tokenizer(model)
    return Path(model)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("hardening")
    extra = ("--max-running-requests", "4", "--context-length", "200")
    proc, base = start_server(model_dir, tmp, *extra)
    try:
        yield base
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
        yield client


def raw_exchange(url: str, head: bytes, body: bytes = b"", wait_s: float = 5.0) -> bytes:
    """Send ``head`` (and ``body``) on a fresh connection; the first bytes answered within
    ``wait_s`` (empty when none came)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(head + body)
        try:
            return sock.recv(4096)
        except TimeoutError:
            return b""


# --- bodies --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "declared"),
    [
        ("/generate", 2**31),
        ("/pause_generation", CONTROL_BODY_LIMIT + 1),
        ("/init_weights_update_group", 2**31),
        ("/update_weights_from_tensor", WEIGHTS_BODY_LIMIT + 1),
    ],
)
def test_declared_oversized_body_is_413_before_it_is_sent(
    url: str, path: str, declared: int
) -> None:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    answer = raw_exchange(url, head)  # only the headers: the body never comes
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.monotonic() - started < 1.0
    assert str(declared).encode() in answer


def test_chunked_body_over_the_limit_is_413(url: str) -> None:
    chunk = b"x" * (CONTROL_BODY_LIMIT + 10)
    head = (
        b"POST /pause_generation HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    body = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
    answer = raw_exchange(url, head, body)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize("depth", [100, 5000, 200_000])
def test_deep_nesting_is_400(http: httpx.Client, depth: int) -> None:
    for raw in (
        b'{"input_ids": ' + b"[" * depth + b"1" + b"]" * depth + b"}",
        b'{"sampling_params": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}",
    ):
        resp = http.post("/generate", content=raw)
        assert resp.status_code == 400, resp.text
        assert "nests deeper than" in resp.json()["error"]["message"]


@pytest.mark.parametrize("field", ["text", "rid"])
def test_lone_surrogate_is_400(http: httpx.Client, field: str) -> None:
    body = {"text": "w5 w6", field: "w5 \\ud800"}
    raw = json.dumps(body).replace("\\\\ud800", "\\ud800").encode()
    assert b'"w5 \\ud800"' in raw  # the JSON escape of a lone surrogate, not text
    resp = http.post("/generate", content=raw)
    assert resp.status_code == 400, resp.text
    assert "surrogate" in resp.json()["error"]["message"]


def test_text_generation_still_served(http: httpx.Client) -> None:
    resp = http.post(
        "/generate", json={"text": "w5 w6 w7", "sampling_params": {"max_new_tokens": 2}}
    )
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["output_ids"]) <= 2


def test_colocated_update_bodies_fit_the_weights_limit(
    url: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the real colocated transport sends: every tensor of the model in one bucket (the
    most metadata one body can carry). Its bodies hold shared-memory handles and a manifest, a
    few hundred bytes per tensor: the default limit leaves room for 20,000 tensors in one
    bucket, one item per rank for 8 ranks (SGLang's tensor parallelism), twice over."""
    import torch
    from miles_transport_colocated.config import ColocatedOptions
    from miles_transport_colocated.sender import ColocatedSender
    from miles_transport_common import http as transport_http
    from transformers import AutoModelForCausalLM

    sizes: list[int] = []
    real_call = transport_http.call

    def measured(base: str, path: str, body: Any, **kw: Any) -> Any:
        if path == "/update_weights_from_tensor":
            sizes.append(len(json.dumps(body)))
        return real_call(base, path, body, **kw)

    monkeypatch.setattr(transport_http, "call", measured)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    sender = ColocatedSender(ColocatedOptions(bucket_size_mb=64, timeout_s=60))
    try:
        sender.send(iter(named), version=5, engines=[url])
    finally:
        sender.close()
    assert sizes, "no update body was sent"
    per_tensor = max(sizes) / len(named)
    assert per_tensor * 20_000 * 8 * 2 < WEIGHTS_BODY_LIMIT, (max(sizes), len(named))
    info = httpx.get(url + "/model_info", trust_env=False).json()
    assert info["weight_version"] == "5"


# --- sampling ------------------------------------------------------------------------------


@pytest.mark.parametrize("top_p", [1e-46, 1e-40, 5e-324])
def test_vanishing_top_p_draws_the_most_probable_token(http: httpx.Client, top_p: float) -> None:
    """A ``top_p`` below float32's smallest normal number keeps the most probable token only
    (what its exact value means), never an empty nucleus (which drew the last token id)."""
    prompt = [1, 5, 9, 13]
    greedy = http.post(
        "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    ).json()["output_ids"]
    resp = http.post(
        "/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 6, "top_p": top_p, "sampling_seed": 3},
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == greedy
    assert VOCAB - 1 not in greedy or greedy.count(VOCAB - 1) == len(greedy)


def test_sample_with_vanishing_top_p_is_argmax() -> None:
    import torch
    from miles_engine_embedded.sampling import sample

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample(
        logits,
        temperatures=[1.0, 0.7, 2.0],
        top_ps=[1e-46, 1e-300, 1e-39],
        top_ks=[-1, -1, 5],
        uniforms=[0.999, 0.5, 0.0],
    )
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


# --- weight-update group -------------------------------------------------------------------


@pytest.mark.parametrize("peer", ["dead", "silent"])
def test_rendezvous_answers_within_the_dist_timeout(http: httpx.Client, peer: str) -> None:
    """A rendezvous nobody listens on (torch's store client retries past its timeout), and one
    that accepts the connection but never answers (the client waits on it for minutes): both
    are answered 504 within ``dist_timeout`` and hold nothing (the second call shows it)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if peer == "silent":
            listener.listen(8)
        else:
            listener.close()
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
        }
        for _ in range(2):
            started = time.monotonic()
            resp = http.post("/init_weights_update_group", json=body)
            elapsed = time.monotonic() - started
            assert elapsed <= 1.2 * DIST_TIMEOUT, elapsed
            assert resp.status_code == 504, resp.text
            assert resp.json()["success"] is False
            assert f"127.0.0.1:{port}" in resp.json()["message"]
    assert http.get("/health").status_code == 200


# --- memory --------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


#: What the resident memory may exceed its size before a long request by, once the cache is
#: freed. The cache of 8 slots at full context is 512 MiB (4 layers x keys and values x 4 heads
#: x 8192 positions x 64 x 4 bytes per slot), at half of it 256 MiB: the old engine kept it.
RSS_LIMIT_MIB = 96


def _kv_length(c: httpx.Client) -> int:
    return int(c.get("/server_info").json()["internal_states"][0]["kv_cache_length"])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="host: no /proc")
def test_kv_cache_of_long_requests_is_given_back(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A request growing the cache to half the context keeps it (the next requests reuse it)
    until ``/flush_cache`` frees it; one growing it past half (an 8,191-token prompt) is freed
    as soon as the engine is idle. Either way the resident memory comes back within
    :data:`RSS_LIMIT_MIB` of what it was before the request."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tmp = tmp_path_factory.mktemp("long-context")
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp / "model")
    proc, base = start_server(tmp / "model", tmp, "--max-running-requests", "8")
    try:
        with httpx.Client(base_url=base, timeout=300, trust_env=False) as c:
            greedy = {"max_new_tokens": 2, "temperature": 0}
            short = {"input_ids": [1, 5, 9], "sampling_params": greedy}
            expected = c.post("/generate", json=short).json()["output_ids"]
            assert c.post("/flush_cache").status_code == 200
            before = rss_mib(proc.pid)

            def long(n: int) -> dict[str, Any]:
                ids = [5 + i % 100 for i in range(n)]
                return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}

            # half the context: kept while idle, freed by the flush
            resp = c.post("/generate", json=long(4000))
            assert resp.status_code == 200, resp.text
            assert _kv_length(c) == 4096
            held = rss_mib(proc.pid)
            resp = c.post("/flush_cache")
            assert resp.status_code == 200 and resp.text.startswith("Cache flushed")
            assert _kv_length(c) == 0
            flushed = rss_mib(proc.pid)
            assert flushed - before < RSS_LIMIT_MIB, (before, held, flushed)

            # past the high-water mark: freed once idle, without a flush
            resp = c.post("/generate", json=long(8191))
            assert resp.status_code == 200, resp.text
            assert resp.json()["meta_info"]["prompt_tokens"] == 8191
            deadline = time.monotonic() + 10
            while _kv_length(c) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _kv_length(c) == 0
            idle = rss_mib(proc.pid)
            assert idle - before < RSS_LIMIT_MIB, (before, idle)

            # the cache comes back at the length needed, with the same answers
            assert c.post("/generate", json=short).json()["output_ids"] == expected
            assert 0 < _kv_length(c) < 8192
    finally:
        stop(proc)


# --- fuzz ----------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats()
    | st.sampled_from([1e-46, 5e-324, -0.0, 1e308, -1e308, 2**63, -(2**63), 2**64])
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
sampling_params = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats() | st.integers(-2, 5) | json_values,
        "top_p": st.floats() | st.sampled_from([1e-46, 1e-38, 5e-324, 1.0]) | json_values,
        "top_k": st.integers(-3, 300) | json_values,
        "max_new_tokens": st.integers(-3, 8) | st.sampled_from([2**31 - 1, 2**40]) | json_values,
        "stop_token_ids": st.lists(st.integers(-3, 140), max_size=8) | json_values,
        "ignore_eos": st.booleans() | json_values,
        "sampling_seed": st.integers(-2, 2**64) | json_values,
        "n": st.integers(0, 3),
    },
)
token_lists = st.lists(st.integers(min_value=-3, max_value=140), max_size=24)
generate_bodies = st.fixed_dictionaries(
    {},
    optional={
        "input_ids": token_lists | st.lists(token_lists, max_size=3) | json_values,
        "text": st.text(max_size=10) | st.lists(st.text(max_size=6), max_size=3) | json_values,
        "sampling_params": sampling_params | st.lists(sampling_params, max_size=3) | json_values,
        "return_logprob": st.booleans() | json_values,
        "logprob_start_len": st.integers(-2, 30) | json_values,
        "rid": st.text(max_size=8) | st.lists(st.text(max_size=4), max_size=3) | json_values,
        "lora_path": st.text(max_size=4) | json_values,
        "stream": st.booleans(),
        "unknown": json_values,
    },
)


def _escape_surrogates(raw: str, where: int) -> str:
    """Put a lone surrogate's JSON escape into the first string of ``raw`` at or after
    ``where`` (hypothesis's text strategies leave surrogates out)."""
    i = raw.find('"', where)
    return raw if i < 0 else raw[: i + 1] + "\\udc80" + raw[i + 1 :]


raw_bodies = (
    generate_bodies.map(json.dumps)
    | st.tuples(generate_bodies.map(json.dumps), st.integers(0, 60)).map(
        lambda t: _escape_surrogates(*t)
    )
    | st.integers(1, 3000).map(lambda n: '{"input_ids": ' + "[" * n + "1" + "]" * n + "}")
    | st.binary(max_size=60).map(lambda b: b.decode("latin-1"))
)
CONTROL = [
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/flush_cache",
    "/update_weight_version",
    "/init_weights_update_group",
    "/release_memory_occupation",
    "/resume_memory_occupation",
]
# A control body must never be valid: a random valid one could pause the server or release
# its memory for the rest of the test; an unknown key makes every object invalid.
control_bodies = st.dictionaries(st.text(max_size=8), json_values, max_size=4).map(
    lambda d: json.dumps({**d, "\x00no-such-field": 1})
) | st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)


def _check(http: httpx.Client, resp: httpx.Response) -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400 and resp.headers.get("content-type", "").startswith(
        "application/json"
    ):
        assert isinstance(resp.json()["error"]["message"], str)


FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)


@FUZZ
@given(raw=raw_bodies)
def test_fuzz_generate_never_500(http: httpx.Client, raw: str) -> None:
    resp = http.post(
        "/generate",
        content=raw.encode("utf-8", "surrogatepass"),
        headers={"content-type": "application/json"},
    )
    _check(http, resp)


@FUZZ
@given(path=st.sampled_from(CONTROL), raw=control_bodies)
def test_fuzz_control_never_500(http: httpx.Client, path: str, raw: str) -> None:
    resp = http.post(path, content=raw.encode())
    _check(http, resp)
    if path != "/flush_cache":  # flush takes no body: it may succeed
        assert 400 <= resp.status_code < 500, resp.text


def test_serves_after_fuzzing(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    body = {"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    first = http.post("/generate", json=body)
    assert first.status_code == 200 and len(first.json()["output_ids"]) == 4
    assert http.post("/generate", json=body).json()["output_ids"] == first.json()["output_ids"]


def test_no_server_error_was_logged(url: str) -> None:
    """Nothing reached the 500 path of the middleware in the whole module."""
    info = httpx.get(url + "/server_info", trust_env=False).json()
    assert info["internal_states"][0]["last_error"] is None
