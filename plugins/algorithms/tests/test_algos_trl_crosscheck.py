"""Cross-check against Hugging Face TRL's GRPO on the same inputs.

The loss side calls TRL's own ``GRPOTrainer.compute_loss`` (its real method, on an instance
whose attributes are set directly instead of through ``__init__``, which would need a dataset,
reward functions and a tokenizer). The model handed to it is a table of logits whose forward
returns what TRL reads (``log_probs`` and ``entropy`` of the completion tokens), so TRL's loss
and ours are differentiated with respect to the same parameters and the gradients compared.

TRL computes advantages and the vLLM importance-sampling ratio inline in
``_generate_and_score_completions``, which cannot be called without generation; those lines are
reproduced here with TRL's own ``nanstd``.
"""

from __future__ import annotations

import types
from collections import defaultdict

# TRL is a test dependency (the plugin's [test] extra): a missing install fails loudly.
import accelerate
import pytest
import torch
import trl.trainer.grpo_trainer as trl_grpo
from miles_algorithms.algorithms import PolicyGradient
from miles_algorithms.options import GRPOOptions
from trl.trainer.utils import nanstd

from miles_core.contracts import TokenBatch

B, P, T, V, G = 6, 3, 5, 11, 3  # samples, prompt length, completion length, vocab, group size
MAX_COMPLETION = 8  # TRL's max_completion_length (dr_grpo's constant), != T on purpose
AGG = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dr_grpo": "constant"}


class LogitTable(torch.nn.Module):
    """A "model" whose parameters are the completion logits themselves; its forward speaks
    the interface TRL 1.16's ``_get_per_token_logps_and_entropies`` reads."""

    def __init__(self, logits: torch.Tensor, completion_ids: torch.Tensor) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())
        self.register_buffer("ids", completion_ids)

    def logprobs_and_entropy(self) -> tuple[torch.Tensor, torch.Tensor]:
        lp = torch.log_softmax(self.logits, -1)
        tok = lp.gather(-1, self.ids.unsqueeze(-1)).squeeze(-1)
        return tok, -(lp.exp() * lp).sum(-1)

    def forward(self, input_ids, attention_mask, labels=None, fused_lm_head=False, **_):
        tok, ent = self.logprobs_and_entropy()
        pad = torch.zeros(tok.shape[0], P, dtype=tok.dtype)  # prompt positions, sliced off
        return types.SimpleNamespace(
            log_probs=torch.cat([pad, tok], 1), entropy=torch.cat([pad, ent], 1)
        )


def trl_trainer(model: LogitTable, **attrs: object) -> object:
    """A GRPOTrainer carrying only the attributes ``_compute_loss`` reads."""
    trainer = trl_grpo.GRPOTrainer.__new__(trl_grpo.GRPOTrainer)
    base = dict(
        model=model,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=0.0,
        loss_type="grpo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION,
        _entropy_bonus_enabled=False,
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        aux_loss_enabled=False,
        accelerator=accelerate.Accelerator(cpu=True),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None),
    )
    base.update(attrs)
    for key, value in base.items():
        setattr(trainer, key, value)
    return trainer


def trl_advantages(rewards: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, sum_then_normalize branch."""
    mean_grouped = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale_rewards in ["group", "none"]:
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_is_ratio(old, sampling, mask, mode: str, clip_min, clip_max) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio (same method, reproduced)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -float("inf")
    hi = clip_max if clip_max is not None else float("inf")
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def make_inputs(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=dtype)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0  # ragged lengths: 3, 1 and 5 tokens
    mask[4, 1:] = 0
    current = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    # Old / reference / rollout log-probs near the current ones so some ratios clip, some not.
    old = current + 0.3 * torch.randn(B, T, generator=gen, dtype=dtype)
    ref = current + 0.2 * torch.randn(B, T, generator=gen, dtype=dtype)
    rollout = old + 0.4 * torch.randn(B, T, generator=gen, dtype=dtype)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.4], dtype=dtype)
    return dict(
        logits=logits, ids=ids, mask=mask, old=old, ref=ref, rollout=rollout, rewards=rewards
    )


CASES = [
    # (loss_type, beta, eps_low, eps_high, level, scale_rewards, entropy_coef, is_mode)
    ("grpo", 0.0, 0.2, 0.2, "token", "group", 0.0, None),
    ("grpo", 0.04, 0.2, 0.28, "token", "group", 0.0, None),
    ("bnpo", 0.0, 0.2, 0.28, "token", "batch", 0.0, None),
    ("bnpo", 0.1, 0.1, 0.3, "token", "group", 0.01, None),
    ("dr_grpo", 0.0, 0.2, 0.2, "token", "none", 0.0, None),
    ("dr_grpo", 0.04, 0.2, 0.28, "token", "none", 0.0, None),
    ("grpo", 0.0, 3e-4, 4e-4, "sequence", "group", 0.0, None),  # GSPO
    ("grpo", 0.04, 0.05, 0.1, "sequence", "group", 0.0, None),
    ("grpo", 0.0, 0.2, 0.28, "token", "group", 0.02, None),
    ("grpo", 0.04, 0.2, 0.28, "token", "group", 0.0, "token_truncate"),
    ("bnpo", 0.0, 0.2, 0.28, "token", "group", 0.0, "token_mask"),
    ("grpo", 0.0, 0.2, 0.28, "token", "group", 0.0, "sequence_truncate"),
    ("grpo", 0.0, 0.2, 0.28, "token", "group", 0.0, "sequence_mask"),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-7), (torch.float32, 1e-6)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_same_loss_gradients_and_metrics_as_trl(
    case: tuple, dtype: torch.dtype, tol: float
) -> None:
    loss_type, beta, eps_low, eps_high, level, scale, ent_coef, is_mode = case
    d = make_inputs(dtype, seed=CASES.index(case))
    is_max, is_min = 1.5, (0.5 if is_mode and is_mode.endswith("mask") else None)

    # --- TRL -----------------------------------------------------------------------------
    trl_model = LogitTable(d["logits"], d["ids"])
    advantages = trl_advantages(d["rewards"], scale)
    trainer = trl_trainer(
        trl_model,
        loss_type=loss_type,
        beta=beta,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        importance_sampling_level=level,
        _entropy_bonus_enabled=ent_coef != 0.0,
        entropy_coef=ent_coef,
        use_vllm=is_mode is not None,
        vllm_importance_sampling_correction=is_mode is not None,
    )
    inputs = {
        "prompt_ids": torch.ones(B, P, dtype=torch.long),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": d["ids"],
        "completion_mask": d["mask"].long(),
        "advantages": advantages,
        "old_per_token_logps": d["old"],
        "ref_per_token_logps": d["ref"],
    }
    if is_mode is not None:
        inputs["importance_sampling_ratio"] = trl_is_ratio(
            d["old"], d["rollout"], d["mask"], is_mode, is_min, is_max
        )
    trl_loss = trainer.compute_loss(trl_model, inputs)
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # --- ours ----------------------------------------------------------------------------
    options = GRPOOptions(
        estimator="grpo",
        scale_rewards=scale,
        std_unbiased=True,
        std_eps=1e-4,
        loss_agg=AGG[loss_type],
        max_response_length=MAX_COMPLETION,
        clip_eps_low=eps_low,
        clip_eps_high=eps_high,
        ratio_level=level,
        kl_coef=beta,
        kl_type="k3",
        kl_mode="loss",
        entropy_coef=ent_coef,
        behaviour_policy="recomputed",
        off_policy_correction="none" if is_mode is None else is_mode.split("_")[1][0] + "is",
        correction_level="token" if is_mode is None else is_mode.split("_")[0],
        is_max=is_max,
        is_min=is_min,
    )
    algo = PolicyGradient(options)
    batch = TokenBatch(
        response_mask=d["mask"],
        rollout_logprobs=d["rollout"],
        rewards=d["rewards"],
        group_index=torch.arange(B) // G,
        old_logprobs=d["old"],
        ref_logprobs=d["ref"],
    )
    algo.compute_advantages(batch)
    torch.testing.assert_close(
        batch.advantages, advantages.unsqueeze(-1) * d["mask"], atol=tol, rtol=0
    )
    ours_model = LogitTable(d["logits"], d["ids"])
    logprobs, entropy = ours_model.logprobs_and_entropy()
    loss, metrics = algo.loss(batch, logprobs, entropy=entropy)
    loss.backward()

    assert abs(float(loss.detach()) - float(trl_loss.detach())) <= tol
    torch.testing.assert_close(ours_model.logits.grad, trl_model.logits.grad, atol=tol, rtol=0)
    assert ours_model.logits.grad.abs().sum() > 0
    assert metrics["entropy"] == pytest.approx(trl_metrics["entropy"], abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(
        trl_metrics["clip_ratio/region_mean"], abs=1e-6
    )
    assert metrics["clip_fraction/low"] == pytest.approx(
        trl_metrics["clip_ratio/low_mean"], abs=1e-6
    )
    if beta:
        assert metrics["kl_ref"] == pytest.approx(trl_metrics["kl"], abs=1e-6)
