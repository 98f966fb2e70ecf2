"""A mixture-of-experts model through the whole loop on CPU: a live embedded engine generates
with a tiny Qwen3-MoE (fused 3-D expert weights, one dense layer), the FSDP2 trainer computes
the engine's log-probs at the same weights and trains on the engine's samples with GRPO, and
every weight transport carries the new weights (the fused experts and routers in the engine's
naming) into the engine, which then generates with them; with ``rollout.routing: record`` every
trained token carries its routed-expert agreement with the engine's routing record."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from miles_core.data import Group, Sample
from miles_core.testing.tiny_moe import save_tiny_moe

pytestmark = pytest.mark.slow

#: float32 on both sides: the engine and the trainer compute the same function
TOL = 1e-5
PROMPTS = [[1, 5, 9, 13, 17], [1, 7, 3, 8, 40, 41, 42]]
GROUP_SIZE = 4
#: weights of the fused experts and of the routers, the tensors an MoE adds
MOE_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_moe(
        tmp_path_factory.mktemp("model") / "tiny-qwen3-moe",
        "qwen3_moe",
        seed=4,
        scale=4.0,
        dense_layers=(1,),
    )


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[str]:
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(
        EmbeddedEngineConfig(
            max_running_requests=4, context_length=64, num_threads=1, startup_timeout_s=120
        )
    )
    try:
        yield launcher.launch(str(model), index=0)
    finally:
        launcher.shutdown()


@pytest.fixture(scope="module")
def trainer(model: Path) -> Iterator[Any]:
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build

    t = build(FSDP2Options(lr=3e-3, cpu_threads=1))
    t.setup(str(model))
    try:
        yield t
    finally:
        t.close()


def rollout(url: str, seed: int, routed: bool = False) -> list[Group]:
    """One group per prompt of ``GROUP_SIZE`` sampled answers, generated concurrently (so the
    engine batches them), with the engine's log-probs and weight version (and, ``routed``, its
    routing record)."""
    from miles_engine_client import EngineClient

    async def go() -> list[Any]:
        async with EngineClient(url, timeout_s=120) as client:
            return await asyncio.gather(
                *[
                    client.generate(
                        p,
                        {"max_new_tokens": 6 + i, "ignore_eos": True, "sampling_seed": seed + i},
                        return_logprob=True,
                        return_routed_experts=routed,
                    )
                    for p in PROMPTS
                    for i in range(GROUP_SIZE)
                ]
            )

    results = iter(asyncio.run(go()))
    groups = []
    for g, prompt in enumerate(PROMPTS):
        samples = []
        for i in range(GROUP_SIZE):
            r = next(results)
            s = Sample(prompt_ids=list(prompt))
            s.append(
                list(r.output_ids),
                logprobs=list(r.logprobs),
                version=int(r.weight_version),
                routed_experts=r.routed_experts,
            )
            s.reward = float((i + g) % 2)  # a spread of rewards in every group
            samples.append(s)
        groups.append(Group(samples=samples, prompt={"prompt": f"p{g}"}))
    return groups


def worst_gap(trainer: Any, groups: list[Group]) -> float:
    """The largest |trainer - engine| log-prob over every generated token."""
    lp, _ = trainer.compute_logprobs(groups)
    samples = [s for g in groups for s in g.samples]
    return max(
        abs(float(lp[i, j]) - e) for i, s in enumerate(samples) for j, e in enumerate(s.logprobs)
    )


def test_fsdp2_trains_the_moe_on_engine_samples(engine: str, trainer: Any) -> None:
    """At equal weights the trainer's log-probs are the engine's; two GRPO steps give a
    finite loss and move the fused experts and the routers."""
    import torch
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions

    groups = rollout(engine, seed=0)
    assert worst_gap(trainer, groups) < TOL
    before = {n: t.clone() for n, t in trainer.export_weights()}
    assert any(n.endswith(MOE_TENSORS[0]) and t.dim() == 3 for n, t in before.items())
    algo = build_policy_gradient(GRPOOptions())
    for _ in range(2):
        metrics = trainer.train_step(groups, algo)
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = dict(trainer.export_weights())
    assert after.keys() == before.keys()
    for suffix in MOE_TENSORS:
        moved = [n for n in after if n.endswith(suffix) and not torch.equal(after[n], before[n])]
        assert moved, f"no {suffix} changed"


def test_record_gives_every_trained_token_its_expert_agreement(engine: str, model: Path) -> None:
    """``routing: record``: after each step every trained sample carries, per response token,
    the fraction of MoE layers whose engine-recorded experts are the trainer's own top-k, in
    [0, 1]. At the engine's weights (float32 on both sides) every token agrees, as the batch's
    ``routing/own_agreement`` does; after an update the batch metric (which also counts the
    prompts' positions) stays within what the tokens' agreement allows."""
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build

    groups = rollout(engine, seed=300, routed=True)
    samples = [s for g in groups for s in g.samples]
    assert all(s.routed_experts is not None for s in samples)
    # one sequence per sample: each forwards its prompt once, so every count is known
    trainer = build(FSDP2Options(lr=3e-2, cpu_threads=1, share_prompts=False), routing="record")
    trainer.setup(str(model))
    try:
        for step in range(2):
            metrics = trainer.train_step(groups, build_policy_gradient(GRPOOptions()))
            agree = [s.trainer_expert_agreement for s in samples]
            for s, a in zip(samples, agree, strict=True):
                assert a is not None and len(a) == len(s.response_ids)
                assert all(x is not None and 0.0 <= x <= 1.0 for x in a)
            agreed = sum(x for a in agree for x in a if x is not None)
            tokens = sum(len(s.response_ids) for s in samples)
            own = metrics["routing/own_agreement"]
            if step == 0:
                assert agreed == tokens and own == 1.0
            # every MoE layer recorded at each forwarded position (prompt + response - 1 of
            # them per sample): the tokens' layers, plus the prompt's before its last token
            prompts = sum(len(s.prompt_ids) - 1 for s in samples)
            assert agreed / (tokens + prompts) - 1e-9 <= own
            assert own <= (agreed + prompts) / (tokens + prompts) + 1e-9
    finally:
        trainer.close()


def transport(name: str) -> Any:
    from miles_core import Kind
    from miles_core.plugins import load_plugins

    record = load_plugins().registry.get(Kind.TRANSPORT, name)
    options = {"broadcast": {"backend": "gloo", "timeout_s": 60}}.get(name, {"timeout_s": 60})
    return record.build(record.config.model_validate(options))


@pytest.mark.parametrize("name", ["colocated", "broadcast", "p2p"])
def test_every_transport_syncs_the_moe(name: str, engine: str, trainer: Any) -> None:
    """A train step, then the transport sends the whole model; the engine then serves the new
    weights: its version is the trainer's and what it generates has the trainer's log-probs."""
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions

    groups = rollout(engine, seed=100)
    trainer.train_step(groups, build_policy_gradient(GRPOOptions()))
    version = trainer.weight_version
    stale = worst_gap(trainer, groups)
    assert stale > 1e-3  # the engine serves the previous weights until the sync
    sender = transport(name)
    try:
        stream = list(trainer.export_weights())
        assert [n for n, _ in stream if n.endswith(MOE_TENSORS)], "no MoE tensor exported"
        sender.send(iter(stream), version=version, engines=[engine])
    finally:
        sender.close()
    fresh = rollout(engine, seed=200)
    assert {v for g in fresh for s in g.samples for v in s.versions if v >= 0} == {version}
    assert worst_gap(trainer, fresh) < TOL
