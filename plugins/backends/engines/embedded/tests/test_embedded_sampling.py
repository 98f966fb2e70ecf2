"""Sampling: the filters keep the right tokens, frequencies follow the tempered distribution,
and the returned log-probs are those of the distribution drawn from at temperature 1 (the raw
logits over the tokens top-k and top-p kept)."""

from __future__ import annotations

import torch
from miles_engine_embedded.sampling import UniformStream, kept_tokens, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
N = 4000


def draw(n: int = N, **kw: object) -> torch.Tensor:
    stream = UniformStream(0)
    rows = LOGITS.expand(n, -1)
    opts = {"temperatures": [1.0] * n, "top_ps": [1.0] * n, "top_ks": [-1] * n}
    opts.update({k: [v] * n for k, v in kw.items()})
    tokens, logprobs = sample(rows, uniforms=[stream.next() for _ in range(n)], **opts)  # type: ignore[arg-type]
    kept = kept_tokens(LOGITS / opts["temperatures"][0], top_ps=opts["top_ps"][:1],
                       top_ks=opts["top_ks"][:1])[0]  # fmt: skip
    if opts["temperatures"][0] == 0.0:
        kept = torch.ones_like(kept)  # a greedy row reports the whole vocabulary's log-prob
    want = torch.log_softmax(LOGITS[0].masked_fill(~kept, float("-inf")), -1)
    assert kept[tokens].all()  # never a token the filters dropped
    assert torch.equal(logprobs, want[tokens])
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


def test_logprobs_are_the_truncated_distributions() -> None:
    """Top-k 2: the log-probs of tokens 0 and 1 renormalised over the two; top-p 0.7 keeps
    the same two; without filters the whole vocabulary's."""
    for kw in ({"top_ks": 2}, {"top_ps": 0.7}, {"top_ks": 3, "top_ps": 0.7}):
        tokens = draw(n=200, **kw)
        assert set(tokens.tolist()) == {0, 1}
    stream = UniformStream(3)
    two = LOGITS.expand(2, -1)
    tokens, lps = sample(two, temperatures=[1.0, 1.0], top_ps=[0.7, 1.0], top_ks=[-1, -1],
                         uniforms=[stream.next(), stream.next()])  # fmt: skip
    head = torch.log_softmax(LOGITS[0, :2], -1)
    full = torch.log_softmax(LOGITS[0], -1)
    assert lps[0] == head[int(tokens[0])]  # the row with top-p: over the kept pair
    assert lps[1] == full[int(tokens[1])]  # the row without, in the same batch: the whole's
    assert lps[0] > full[int(tokens[0])]


def test_kept_tokens_ties_and_bounds() -> None:
    """Top-k keeps every token tied with the k-th; top-p breaks ties in token order; top-p 1
    and top-k -1 keep everything; a vanishing top-p keeps the first token."""
    tied = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert kept_tokens(tied, top_ps=[1.0], top_ks=[2]).tolist() == [
        [False, True, True, True, False]
    ]
    # three equal probabilities of about 0.32 each: top-p 0.5 keeps the first two in token order
    assert kept_tokens(tied, top_ps=[0.5], top_ks=[-1]).tolist() == [
        [False, True, True, False, False]
    ]
    assert kept_tokens(tied, top_ps=[1e-6], top_ks=[-1]).tolist() == [
        [False, True, False, False, False]
    ]
    assert kept_tokens(tied, top_ps=[1.0], top_ks=[-1]).all()
    assert kept_tokens(tied, top_ps=[1e-46], top_ks=[-1]).sum() == 1
