"""Resume on another world size: a checkpoint saved by two ranks loads on one and one rank's on
two (real gloo groups in spawned processes), with bitwise the saved weights, optimizer state
and RNG states; the resumed run takes the step the saved one would have and goes on learning."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
from miles_algorithms.algorithms import build_sft
from miles_algorithms.options import SFTOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build
from miles_trainer_common.state import load_checkpoint_file
from torch import Tensor

pytestmark = pytest.mark.slow

OPTS = dict(lr=5e-3, weight_decay=0.01, micro_batch_tokens=30, cpu_threads=1)


def _whole(ckpt: str, out: str) -> dict[str, Any]:
    """The checkpoint's DCP folder read back as whole tensors (DCP's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(os.path.join(ckpt, "sharded"), out)
    state: dict[str, Any] = torch.load(out, weights_only=True)
    return state


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of nested dicts and lists, by its path."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = enumerate(tree)  # type: ignore[assignment]
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(_flat(value, f"{prefix}/{key}"))
    return out


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference between two flattened states with the same leaves
    (a leaf that is not a tensor must be equal)."""
    assert sorted(a) == sorted(b)
    worst = 0.0
    for key, value in a.items():
        if isinstance(value, Tensor):
            other = b[key]
            assert value.shape == other.shape and value.dtype == other.dtype, key
            if value.numel():
                worst = max(worst, float((value.double() - other.double()).abs().max()))
            assert torch.equal(value, other), key
        else:
            assert value == b[key], key
    return worst


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)])
def test_resume_on_another_world_size(
    saved: int, resumed: int, llama_path: str, groups, tmp_path
) -> None:
    g = groups(n_groups=2, group_size=3, seed=5)
    sft = build_sft(SFTOptions())
    ckpt, again = str(tmp_path / "ckpt"), str(tmp_path / "again")
    with build(FSDP2Options(world_size=saved, **OPTS)) as first:
        first.setup(llama_path)
        # A one-rank trainer draws from this process's RNG: moved on from the seeded state
        # the other world size's ranks start from, so a rank that restored none differs.
        torch.rand(3)
        random.random()
        first.train_step(g, sft)
        first.save(ckpt, extra={"data_position": 5})
        saved_fp = first.fingerprint()
        next_step = first.train_step(g, sft)
        next_weights = dict(first.export_weights())
    rng0 = load_checkpoint_file(os.path.join(ckpt, "rng_rank0.pt"))

    with build(FSDP2Options(world_size=resumed, **OPTS)) as second:
        second.setup(llama_path)
        assert second.fingerprint() != saved_fp
        second.load(ckpt)
        assert second.extra == {"data_position": 5} and second.weight_version == 1
        # The fingerprint hashes the whole tensors (gathered) by name: the same at any world
        # size, so equal fingerprints are bitwise-equal weights and optimizer state.
        assert second.fingerprint() == saved_fp
        second.save(again)  # what the resumed ranks hold, written again
        if resumed == 1:
            assert torch.equal(torch.get_rng_state(), rng0["torch"])
        # Every resumed rank restored saved rank (its rank % saved world size)'s RNG states.
        for r in range(resumed):
            rng = load_checkpoint_file(os.path.join(again, f"rng_rank{r}.pt"))
            src = load_checkpoint_file(os.path.join(ckpt, f"rng_rank{r % saved}.pt"))
            assert torch.equal(rng["torch"], src["torch"]) and rng["python"] == src["python"]
        # The model and every optimizer tensor (Adam's exp_avg, exp_avg_sq, step), whole.
        before = _flat(_whole(ckpt, str(tmp_path / "before.pt")))
        after = _flat(_whole(again, str(tmp_path / "after.pt")))
        assert any("exp_avg_sq" in k for k in before) and any("/model/" in k for k in before)
        assert _max_diff(before, after) == 0.0

        # The step the saved trainer took next (another world size sums in another order).
        step = second.train_step(g, sft)
        assert step["loss"] == pytest.approx(next_step["loss"], abs=1e-6)
        assert step["grad_norm"] == pytest.approx(next_step["grad_norm"], rel=1e-5)
        for name, tensor in second.export_weights():
            torch.testing.assert_close(tensor, next_weights[name], atol=1e-5, rtol=0, msg=name)
        # ...and it goes on learning: the loss on the batch falls step after step.
        losses = [step["loss"]] + [second.train_step(g, sft)["loss"] for _ in range(2)]
        assert losses[0] > losses[1] > losses[2], losses
