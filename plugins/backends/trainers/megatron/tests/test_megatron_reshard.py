"""Resume a Megatron checkpoint at another layout (tensor parallel 2 -> 1 and 1 -> 2, pipeline
2 -> 1 and 1 -> 2 with a tied embedding, with a critic, with LoRA; real gloo groups in spawned
processes): the weights and the optimizer state after the load are bitwise the saved ones,
the next step is the one the saved trainer took, and the resumed run goes on learning. A
layout change the backend cannot make is refused naming why."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient, build_sft
from miles_algorithms.options import PPOOptions, SFTOptions
from miles_backend_megatron.bridge import shard, split_of
from miles_backend_megatron.options import MegatronOptions
from miles_backend_megatron.trainer import build
from miles_lora.adapter import build as build_lora
from miles_lora.options import LoraOptions
from miles_trainer_common.state import load_checkpoint_file
from torch import Tensor

OPTS = dict(lr=5e-3, weight_decay=0.01, micro_batch_tokens=40, cpu_threads=1)
PPO = PPOOptions(behaviour_policy="recomputed", kl_coef=0.1)
LORA = LoraOptions(rank=4, alpha=8, init_seed=3)
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def _options(layout: tuple[int, int, int], **extra: Any) -> MegatronOptions:
    tp, pp, dp = layout
    return MegatronOptions(
        tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp, **OPTS, **extra
    )


def _by_name(file: dict[str, Any], critic: bool) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A rank file's tensors and optimizer states (by optimizer key, then parameter name)."""
    if critic:
        optimizers = {"": file["critic_optimizer"]}
        names = {"": file["critic_optimizer_params"]}
        return file["critic"], _states(optimizers, names)
    return file["model"], _states(file["optimizers"], file["optimizer_params"])


def _states(optimizers: dict[str, Any], names: dict[str, list[str]]) -> dict[str, Any]:
    return {
        key: {
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
            "state": {n: sd["state"][i] for i, n in enumerate(names[key]) if i in sd["state"]},
        }
        for key, sd in optimizers.items()
    }


def _compare(whole_ckpt: str, parted_ckpt: str, critic: bool = False) -> tuple[float, int]:
    """Each rank file of ``parted_ckpt`` against its part (:func:`bridge.shard`) of the
    one-rank checkpoint ``whole_ckpt``: every tensor of the model and of Adam's state
    (``exp_avg``, ``exp_avg_sq`` split as their parameter, ``step`` whole) and the optimizers'
    settings must be equal; returns (the largest absolute difference, tensors compared)."""
    whole_model, whole_optim = _by_name(
        load_checkpoint_file(os.path.join(whole_ckpt, "rank0.pt")), critic
    )
    layout = load_checkpoint_file(os.path.join(parted_ckpt, "trainer.pt"))["layout"]
    tp = layout["tensor_parallel"]
    worst, compared = 0.0, 0

    def check(part: Tensor, expected: Tensor, what: str) -> None:
        nonlocal worst, compared
        assert part.shape == expected.shape and part.dtype == expected.dtype, what
        worst = max(worst, float((part.double() - expected.double()).abs().max()))
        assert torch.equal(part, expected), what
        compared += 1

    for rank in range(tp * layout["pipeline_parallel"] * layout["data_parallel"]):
        file = load_checkpoint_file(os.path.join(parted_ckpt, f"rank{rank}.pt"))
        shift, tp_rank = int(file["layers"][0]), rank % tp

        def source(name: str, table: dict[str, Any], shift: int = shift) -> Any:
            name = _LAYER.sub(lambda m: f"decoder.layers.{int(m[1]) + shift}.", name)
            if name == "output_layer.weight" and name not in table:
                name = "embedding.word_embeddings.weight"  # a tied head's copy
            return table[name]

        model, optim = _by_name(file, critic)
        for name, part in model.items():
            check(part, shard(source(name, whole_model), split_of(name), tp_rank, tp), name)
        for key, own in optim.items():
            assert own["groups"] == whole_optim[key]["groups"]
            for name, state in own["state"].items():
                saved = source(name, whole_optim[key]["state"])
                assert sorted(state) == sorted(saved), name
                for k, v in state.items():
                    expected = shard(saved[k], split_of(name), tp_rank, tp) if v.dim() else saved[k]
                    check(v, expected, f"{name}/{k}")
    return worst, compared


def _same_weights(fingerprint: dict[str, str], saved: dict[str, str]) -> None:
    """The whole weights (and adapters) gathered by the export: the same at any layout."""
    for key, value in saved.items():
        if key == "weights" or key.startswith("adapter/"):
            assert fingerprint[key] == value, key


CASES = [
    ("qwen3", (2, 1, 1), (1, 1, 1), "critic"),  # TP 2 -> 1, QK-norm whole, untied head
    ("llama", (1, 1, 1), (2, 1, 1), None),  # TP 1 -> 2, the vocabulary split
    ("llama", (1, 2, 1), (1, 1, 1), None),  # PP 2 -> 1: the tied head's copy left out
    ("llama", (1, 1, 1), (1, 2, 1), None),  # PP 1 -> 2: the copy taken from the embedding
    ("qwen3", (1, 1, 1), (2, 1, 1), "lora"),  # TP 1 -> 2, LoRA's A and B split as they are
]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "saved", "resumed", "extra"), CASES)
def test_resume_at_another_layout(
    family: str, saved: tuple, resumed: tuple, extra: str | None, request, groups, tmp_path
) -> None:
    path = request.getfixturevalue(f"{family}_path")
    g = groups(2, 3, seed=4)
    first_algo = build_policy_gradient(PPO) if extra == "critic" else build_sft(SFTOptions())
    adapter = (lambda: build_lora(LORA)) if extra == "lora" else (lambda: None)
    critic = {"critic": {"lr": 1e-3}} if extra == "critic" else {}
    ckpt, again = str(tmp_path / "ckpt"), str(tmp_path / "again")
    with build(_options(saved, **critic), adapter()) as first:
        first.setup(path)
        first.train_step(g, first_algo)
        first.save(ckpt, extra={"data": 3})
        saved_fp = first.fingerprint()
        next_step = first.train_step(g, first_algo)
        next_weights = dict(first.export_weights())

    with build(_options(resumed, **critic), adapter()) as second:
        second.setup(path)
        second.load(ckpt)
        assert second.extra == {"data": 3} and second.weight_version == 1
        _same_weights(second.fingerprint(), saved_fp)
        second.save(again)  # what the resumed ranks hold, written again
        whole, parted = (again, ckpt) if resumed == (1, 1, 1) else (ckpt, again)
        worst, compared = _compare(whole, parted)
        assert worst == 0.0 and compared > 0
        if extra == "critic":
            assert _compare(whole, parted, critic=True)[0] == 0.0
        # Each resumed rank restored saved rank (its rank % the saved world size)'s RNG.
        world = saved[0] * saved[1] * saved[2]
        for r in range(resumed[0] * resumed[1] * resumed[2]):
            rng = load_checkpoint_file(os.path.join(again, f"rank{r}.pt"))["rng"]
            src = load_checkpoint_file(os.path.join(ckpt, f"rank{r % world}.pt"))["rng"]
            assert torch.equal(rng["torch"], src["torch"]) and rng["python"] == src["python"]

        # The step the saved trainer took next (another layout sums in another order).
        step = second.train_step(g, first_algo)
        assert step["loss"] == pytest.approx(next_step["loss"], abs=1e-6)
        assert step["grad_norm"] == pytest.approx(next_step["grad_norm"], rel=1e-5)
        for name, tensor in second.export_weights():
            torch.testing.assert_close(tensor, next_weights[name], atol=1e-5, rtol=0, msg=name)
        # ...and it goes on learning: the loss on the batch falls step after step.
        sft = build_sft(SFTOptions())
        losses = [second.train_step(g, sft)["loss"] for _ in range(3)]
        assert losses[0] > losses[1] > losses[2], losses


def _relabel(ckpt: str, **changes: Any) -> None:
    """Rewrite ``trainer.pt`` as if the checkpoint had been saved at another layout (or by a
    version without ``reshardable``: ``reshardable=None``)."""
    file = os.path.join(ckpt, "trainer.pt")
    meta = load_checkpoint_file(file)
    meta["layout"] = {**meta["layout"], "tensor_parallel": 2}
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    torch.save(meta, file)


def test_what_cannot_be_resharded_is_refused(qwen3_path: str, groups, tmp_path) -> None:
    """Megatron's distributed optimizer at another layout, and a checkpoint written before
    the rank files recorded their splits: refused naming why (one rank, in this process)."""
    g = groups(1, 2, seed=1)
    sft = build_sft(SFTOptions())
    for sharded, changes, message in (
        (True, {}, r"backend\.distributed_optimizer=true; this trainer has .*same tensor_par"),
        (False, {"reshardable": None}, r"did not record how its tensors are split"),
    ):
        ckpt = str(tmp_path / f"ckpt-{sharded}")
        trainer = build(_options((1, 1, 1), distributed_optimizer=sharded))
        trainer.setup(qwen3_path)
        trainer.train_step(g, sft)
        trainer.save(ckpt)
        _relabel(ckpt, **changes)
        with pytest.raises(ValueError, match=message):
            trainer.load(ckpt)
        trainer.close()
