"""Routed-expert agreement per response token: the router hooks' counts per position against a
hand-made record (a matching token, a token differing in one MoE layer, a token without a
record), the positions of both forward layouts, and a train step of the FSDP2 trainer whose
samples carry each token's agreement, its mean over every forwarded position being the batch's
``routing/own_agreement``."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from miles_trainer_common.agreement import TokenAgreement, forward_positions
from miles_trainer_common.batch import pack
from miles_trainer_common.layout import shared_layout
from miles_trainer_common.routing import RoutingReplay
from miles_trainer_common.testing import make_groups

from miles_core.data import Group, RoutedExperts, Sample
from miles_core.testing.tiny_moe import save_tiny_moe

TOP_K = 2
EXPERTS = 4


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE of three layers, the middle one dense: two MoE layers."""
    return save_tiny_moe(
        tmp_path_factory.mktemp("moe") / "m",
        "qwen3_moe",
        seed=3,
        scale=4.0,
        num_layers=3,
        dense_layers=(1,),
    )


def own_routing(model: Any, ids: list[int]) -> torch.Tensor:
    """``[len(ids), layers, k]``: the top-k a float32 forward routes each position to (-1 in
    dense layers)."""
    layers = model.config.num_hidden_layers
    out = torch.full((len(ids), layers, TOP_K), -1, dtype=torch.int32)
    handles = []
    for i, layer in enumerate(model.model.layers):
        if type(layer.mlp).__name__.endswith("SparseMoeBlock"):

            def hook(module: Any, args: Any, output: Any, i: int = i) -> None:
                out[:, i] = output[2].view(len(ids), TOP_K).to(torch.int32)

            handles.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for h in handles:
        h.remove()
    return out


def test_per_position_counts_against_a_hand_made_record(moe: Path) -> None:
    """Per position, the MoE layers whose recorded experts are the trainer's own top-k, of
    those with a record: 2 of 2 where the record is the model's own, 1 of 2 where one layer's
    set differs, 0 of 0 where there is no record; the batch counts are their sums."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    ids = [1, 17, 33, 5, 90, 61]
    record = own_routing(model, ids)
    record[2, 2] = (record[2, 2] + 1) % EXPERTS  # position 2: layer 2 differs
    record[4, 0] = (record[4, 0] + 1) % EXPERTS  # position 4: layer 0 differs
    record[5] = -1  # position 5: no record (the engine never forwards the last token)
    hooks = RoutingReplay(model, "record")
    flat = record.view(1, len(ids), -1)
    with torch.no_grad(), hooks.per_position() as forwards:
        with hooks.use(flat):
            model(input_ids=torch.tensor([ids]))
        with hooks.use(flat):  # a second forward: a second entry, counted apart
            model(input_ids=torch.tensor([[*ids[:3], 2, 2, 2]]))
    assert len(forwards) == 2 and forwards[0].shape == (1, len(ids), 2)
    same, known = forwards[0][0, :, 0].tolist(), forwards[0][0, :, 1].tolist()
    assert known == [2, 2, 2, 2, 2, 0]
    assert same == [2, 2, 1, 2, 1, 0]
    # the first three positions are the same tokens in both forwards
    assert forwards[1][0, :3].tolist() == forwards[0][0, :3].tolist()
    assert hooks.metrics()["routing/own_agreement"] == pytest.approx(
        float(forwards[0][..., 0].sum() + forwards[1][..., 0].sum()) / 20
    )
    # outside per_position no position is kept
    with torch.no_grad(), hooks.use(flat):
        model(input_ids=torch.tensor([ids]))
    assert len(forwards) == 2
    hooks.close()


def test_token_agreement_reads_the_predicting_position() -> None:
    """Token ``j`` of a sample takes the counts at the position that predicts it (the
    prompt's last for ``j = 0``), ``NaN`` past its response; a round's forward count other
    than one, or a layout other than the forward's, is refused."""
    groups = make_groups(1, 2, seed=1, env_tokens=False)
    packed = pack(groups)
    shape = forward_positions(packed, [0, 1], False, None)[0]
    forward = torch.zeros(*shape, 2)
    forward[:, :, 1] = 2.0
    forward[:, :, 0] = torch.arange(shape[1]).remainder(3).float()[None, :].clamp(max=2)
    forwards: list[torch.Tensor] = []
    agreement = TokenAgreement(packed, forwards, False, None, torch.device("cpu"))
    forwards.append(forward)
    agreement.take([0, 1])
    forwards.append(forward)
    agreement.take(None)  # a padding round: dropped
    assert not forwards
    out = agreement.result()
    for row, s in enumerate(s for g in groups for s in g.samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        expect = [min((p - 1 + j) % 3, 2) / 2 for j in range(n)]
        assert out[row, :n].tolist() == expect
        assert all(math.isnan(x) for x in out[row, n:].tolist())
    with pytest.raises(RuntimeError, match="0 measured forwards"):
        agreement.take([0])
    forwards.append(forward[:, :-1])
    with pytest.raises(RuntimeError, match="one sequence per sample"):
        agreement.take([0, 1])


@pytest.mark.parametrize("tile", [None, 4])
def test_shared_positions_are_the_layouts(tile: int | None) -> None:
    """:func:`forward_positions` with shared prompts gives the shape and the positions of
    :func:`shared_layout`, without its attention mask."""
    packed = pack(make_groups(3, 4, seed=5))
    rows = [0, 1, 2, 3, 5, 6, 9, 10, 11]
    layout = shared_layout(packed, rows, tile)
    shape, unit, pos, valid = forward_positions(packed, rows, True, tile)
    if shape == (len(rows), int(packed.seq_lens[rows].max())):
        assert tile is not None  # the tiled layout's fallback: one sequence per sample
        return
    assert shape == tuple(layout.ids.shape)
    assert torch.equal(unit, layout.unit) and torch.equal(valid, layout.valid)
    assert torch.equal(torch.where(valid, pos, 0), torch.where(layout.valid, layout.pos, 0))


def shifted_groups(model: Any) -> list[Group]:
    """Two groups of three samples whose record is the model's own routing but at every
    third position (0, 3, 6...), where every MoE layer's set is shifted."""
    rng = random.Random(0)
    groups = []
    for g in range(2):
        prompt = [1] + [rng.randrange(3, 120) for _ in range(3 + g)]
        samples = []
        for s in range(3):
            response = [rng.randrange(3, 120) for _ in range(4 + s)]
            routing = own_routing(model, prompt + response)[:-1]
            moe = routing[:, :, 0] >= 0
            moe[1::3] = moe[2::3] = False
            routing = torch.where(moe[:, :, None], (routing + 1) % EXPERTS, routing)
            sample = Sample(prompt_ids=prompt, reward=float(s % 2))
            sample.append(
                response,
                logprobs=[-1.0] * len(response),
                version=0,
                routed_experts=RoutedExperts.from_ids(routing.flatten().tolist(), len(routing)),
            )
            samples.append(sample)
        groups.append(Group(samples=samples))
    return groups


@pytest.mark.parametrize(("share_prompts", "world_size"), [(False, 1), (True, 1), (False, 2)])
def test_train_step_sets_each_tokens_agreement(
    moe: Path, share_prompts: bool, world_size: int
) -> None:
    """After a step with ``routing: record``, every sample's ``trainer_expert_agreement`` is
    0 at the tokens predicted at a shifted position and 1 elsewhere (on two ranks too: each
    forwards its share of the micro-batches, rank 0 answers for all); over every forwarded
    position (the prompts' too) the counts are the batch's ``routing/own_agreement``."""
    from miles_algorithms.algorithms import build_policy_gradient
    from miles_algorithms.options import GRPOOptions
    from miles_backend_fsdp2.options import FSDP2Options
    from miles_backend_fsdp2.trainer import build
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    groups = shifted_groups(hf)
    # one sequence per sample: several micro-batches; shared: each group's prompt forwarded once
    budget = {} if share_prompts else {"micro_batch_tokens": 24}
    options = FSDP2Options(
        lr=1e-2, cpu_threads=1, share_prompts=share_prompts, world_size=world_size, **budget
    )
    trainer = build(options, routing="record")
    trainer.setup(str(moe))
    try:
        metrics = trainer.train_step(groups, build_policy_gradient(GRPOOptions()))
    finally:
        trainer.close()
    agreed = forwarded = 0.0
    for g in groups:
        for s in g.samples:
            p, n = len(s.prompt_ids), len(s.response_ids)
            expect = [0.0 if (p - 1 + j) % 3 == 0 else 1.0 for j in range(n)]
            assert s.trainer_expert_agreement == expect
            # the prompt's positions before its last, as forwarded (once per group when shared)
            if not share_prompts or s is g.samples[0]:
                agreed += sum(i % 3 != 0 for i in range(p - 1))
                forwarded += p - 1
            agreed += sum(expect)
            forwarded += n
    if share_prompts:
        # the prompt's last position predicts every sample's first token: forwarded once
        agreed -= sum(float((len(g.samples[0].prompt_ids) - 1) % 3 != 0) * 2 for g in groups)
        forwarded -= 2 * len(groups)
    assert metrics["routing/own_agreement"] == pytest.approx(agreed / forwarded, abs=1e-12)
