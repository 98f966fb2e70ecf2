"""Rollout routing replay in the FSDP2 trainer, on tiny MoEs of both supported routers: the
record is laid out position by position (shared prompts and not), replay routes by it with
gate weights from the trainer's own router (which still trains), and a batch without a record
is refused."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_core.data import Group, RoutedExperts, Sample
from miles_core.testing.tiny_moe import save_tiny_moe

TOP_K = 2
EXPERTS = 4


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dense = {"dense_layers": (1,)} if request.param == "qwen3_moe" else {}
    return save_tiny_moe(
        tmp_path_factory.mktemp(request.param) / "m", request.param, seed=3, scale=4.0, **dense
    )


def own_routing(path: Path, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, layers, k]``: the top-k a float32 Hugging Face forward routes each
    forwarded position to (-1 in dense layers), as the engine reports it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    out = torch.full((len(ids), layers, TOP_K), -1, dtype=torch.int32)
    handles = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue

        def hook(module: Any, args: Any, output: Any, i: int = i) -> None:
            out[:, i] = output[2].view(len(ids), TOP_K).to(torch.int32)

        handles.append(gate.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in handles:
        h.remove()
    return out[:-1]


def groups_with(path: Path, change: bool) -> list[Group]:
    """Two groups of two samples, each with its routing record: the model's own, or (with
    ``change``) another expert set at every third position of every MoE layer."""
    rng = random.Random(0)
    groups = []
    for g in range(2):
        prompt = [1] + [rng.randrange(3, 120) for _ in range(4 + g)]
        samples = []
        for s in range(2):
            response = [rng.randrange(3, 120) for _ in range(5 + s)]
            routing = own_routing(path, prompt + response)
            if change:
                moe = routing[:, :, 0] >= 0
                shifted = (routing + 1) % EXPERTS
                pick = torch.zeros_like(moe)
                pick[::3] = True
                routing = torch.where((moe & pick)[:, :, None], shifted, routing)
            sample = Sample(prompt_ids=prompt, reward=float(s))
            sample.append(
                response,
                logprobs=[-1.0] * len(response),
                version=0,
                routed_experts=RoutedExperts.from_ids(routing.flatten().tolist(), routing.shape[0]),
            )
            samples.append(sample)
        groups.append(Group(samples=samples))
    return groups


def trainer_for(path: Path, routing: str, share_prompts: bool = True) -> Any:
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build

    t = build(FSDP2Options(lr=1e-2, cpu_threads=1, share_prompts=share_prompts), routing=routing)
    t.setup(str(path))
    return t


def test_replay_routes_by_the_record(moe: Path) -> None:
    """Replaying the model's own routing changes nothing; replaying another routing changes
    the log-probs, the same with and without shared prompts, and the agreement with the
    experts routed by is 1.0 while the trainer's own top-k agrees only where nothing changed;
    the router trains through the recomputed gate weights."""
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions

    same, changed = groups_with(moe, False), groups_with(moe, True)
    plain = trainer_for(moe, "none")
    shared = trainer_for(moe, "replay")
    alone = trainer_for(moe, "replay", share_prompts=False)
    try:
        base, _ = plain.compute_logprobs(same)
        assert torch.allclose(shared.compute_logprobs(same)[0], base, atol=1e-5)
        replayed, _ = shared.compute_logprobs(changed)
        assert (replayed - base).abs().max() > 1e-3
        assert torch.allclose(alone.compute_logprobs(changed)[0], replayed, atol=1e-5)

        before = {n: t.clone() for n, t in shared.export_weights() if n.endswith("mlp.gate.weight")}
        metrics = shared.train_step(changed, build_policy_gradient(GRPOOptions()))
        assert metrics["routing/expert_agreement"] == 1.0
        assert 0.4 < metrics["routing/own_agreement"] < 0.9
        assert metrics["routing/bytes_per_token"] > 0
        assert metrics["routing/load_max_over_mean"] >= 1.0
        after = dict(shared.export_weights())
        assert any(not torch.equal(after[n], t) for n, t in before.items())

        with pytest.raises(ValueError, match="carry no routing record"):
            bare = [
                Group(samples=[Sample(**{**vars(s), "routed_experts": None}) for s in g.samples])
                for g in changed
            ]
            shared.train_step(bare, build_policy_gradient(GRPOOptions()))
    finally:
        plain.close()
        shared.close()
        alone.close()


def test_record_measures_without_replaying(moe: Path) -> None:
    """``record``: the trainer routes by its own top-k (the log-probs of a run without
    routing) and reports how often the engine's record agrees with it."""
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions

    changed = groups_with(moe, True)
    plain = trainer_for(moe, "none")
    record = trainer_for(moe, "record")
    try:
        assert torch.allclose(
            record.compute_logprobs(changed)[0], plain.compute_logprobs(changed)[0], atol=1e-6
        )
        metrics = record.train_step(changed, build_policy_gradient(GRPOOptions()))
        assert metrics["routing/expert_agreement"] == metrics["routing/own_agreement"] < 0.9
    finally:
        plain.close()
        record.close()
