"""Sampling: the filters keep the right tokens, frequencies follow the tempered distribution,
and the returned log-probs are those of the raw distribution."""

from __future__ import annotations

import torch
from miles_engine_embedded.sampling import UniformStream, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
N = 4000


def draw(n: int = N, **kw: object) -> torch.Tensor:
    stream = UniformStream(0)
    rows = LOGITS.expand(n, -1)
    opts = {"temperatures": [1.0] * n, "top_ps": [1.0] * n, "top_ks": [-1] * n}
    opts.update({k: [v] * n for k, v in kw.items()})
    tokens, logprobs = sample(rows, uniforms=[stream.next() for _ in range(n)], **opts)  # type: ignore[arg-type]
    raw = torch.log_softmax(LOGITS[0], -1)
    assert torch.allclose(logprobs, raw[tokens])  # raw log-probs whatever the filters
    return tokens


def test_frequencies_follow_tempered_softmax() -> None:
    for temp in (1.0, 0.5, 2.0):
        counts = torch.bincount(draw(temperatures=temp), minlength=6).float() / N
        expected = torch.softmax(LOGITS[0] / temp, -1)
        assert (counts - expected).abs().max() < 0.03, (temp, counts, expected)


def test_top_k_and_top_p_keep_only_the_head() -> None:
    assert set(draw(top_ks=2).tolist()) == {0, 1}
    probs = torch.softmax(LOGITS[0], -1)  # 0.61, 0.22, ...: top_p 0.7 keeps tokens 0 and 1
    assert probs[0] < 0.7 < probs[0] + probs[1]
    kept = draw(top_ps=0.7)
    assert set(kept.tolist()) == {0, 1}
    share = (kept == 0).float().mean()
    assert abs(share - probs[0] / (probs[0] + probs[1])) < 0.03


def test_greedy_and_streams_are_reproducible() -> None:
    assert set(draw(n=50, temperatures=0.0).tolist()) == {0}
    a = [UniformStream(5).next() for _ in range(3)]
    s = UniformStream(5)
    assert a[0] == s.next() and 0.0 <= a[1] < 1.0
