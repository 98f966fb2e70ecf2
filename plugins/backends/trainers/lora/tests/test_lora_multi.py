"""Several LoRA adapters on one base model (multi-LoRA), on their own and in the FSDP2
trainer: each adapter trains on its own groups with its own optimizer, schedule and learning
rate, an adapter without groups is untouched bit for bit, log-probs follow each group's
adapter, exports and checkpoints hold each adapter, and two ranks train as one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions, PPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build
from miles_lora.adapter import build as build_lora
from miles_lora.options import LoraOptions
from pydantic import ValidationError

OPTIONS = FSDP2Options(
    lr=2e-2,
    weight_decay=0.1,
    warmup_steps=1,
    lr_schedule="cosine",
    decay_steps=6,
    min_lr_ratio=0.1,
    micro_batch_tokens=30,
    cpu_threads=1,
)
ALPHA = LoraOptions(rank=4, alpha=8, served_name="alpha", init_seed=1)
# its own lr, rank, targets and seed
BETA = LoraOptions(
    rank=2, alpha=4, served_name="beta", init_seed=2, lr=5e-3, target_modules=["q_proj", "v_proj"]
)


def _algo():
    return build_policy_gradient(GRPOOptions(behaviour_policy="recomputed", kl_coef=0.05))


def _named(groups, *names):
    """The groups, the i-th naming ``names[i % len(names)]``."""
    return [dataclasses.replace(g, adapter=names[i % len(names)]) for i, g in enumerate(groups)]


def _two(options: FSDP2Options = OPTIONS):
    trainer = build(options, adapters=[build_lora(ALPHA), build_lora(BETA)])
    return trainer


def _weights(trainer, name: str) -> dict[str, torch.Tensor]:
    return dict(trainer.export_weights(name))


def _base(trainer) -> dict[str, torch.Tensor]:
    return {
        n: v.detach().clone()
        for n, v in trainer._local.model.state_dict().items()
        if ".lora_" not in n
    }


# --- the adapter on its own -------------------------------------------------------------------


def test_served_name_and_lr_are_validated() -> None:
    for bad in ["a.b", "a b", "", "x" * 65]:
        with pytest.raises(ValidationError, match="served_name"):
            LoraOptions(served_name=bad)
    assert LoraOptions(served_name="A_b-9" + "x" * 59).served_name.startswith("A_b-9")
    with pytest.raises(ValidationError, match="lr"):
        LoraOptions(lr=0)
    assert build_lora(LoraOptions(lr=1e-3)).lr == 1e-3 and build_lora(None).lr is None


def test_add_to_holds_two_adapters_each_streams_its_own(llama_path: str, hf, groups) -> None:
    alpha, beta = build_lora(ALPHA), build_lora(BETA)
    model = alpha.apply(hf.model(llama_path))
    beta.add_to(model)
    with pytest.raises(ValueError, match="already holds an adapter of that name"):
        build_lora(ALPHA).add_to(model)
    # base frozen, both adapters trainable; activating one freezes neither
    for _ in range(2):
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == {n for n, _ in alpha.parameters(model)} | {
            n for n, _ in beta.parameters(model)
        }
        beta.activate(model)
    assert model.active_adapter == "beta"
    # each adapter's stream holds its own modules alone, in PEFT's names
    a, b = dict(alpha.named_weights(model)), dict(beta.named_weights(model))
    assert len(a) == 2 * 7 * 2 and len(b) == 2 * 2 * 2
    assert all(".q_proj." in n or ".v_proj." in n for n in b)
    # beta's A from its own seed: what it would be alone
    alone = dict(beta.named_weights(build_lora(BETA).apply(hf.model(llama_path))))
    assert all(torch.equal(b[n], alone[n]) for n in b)
    # B away from zero in both: then merging alpha must leave beta out
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    g = groups()
    model.eval()
    for adapter in (alpha, beta):
        adapter.activate(model)
        plain = hf.model(llama_path)
        merged = dict(adapter.merged_weights(model))
        assert set(merged) == set(plain.state_dict())
        plain.load_state_dict(merged)
        torch.testing.assert_close(hf.logprobs(plain, g), hf.logprobs(model, g), atol=1e-5, rtol=0)


# --- the trainer --------------------------------------------------------------------------------


def test_a_step_on_one_adapter_leaves_the_other_untouched(llama_path: str, groups) -> None:
    trainer = _two()
    trainer.setup(llama_path)
    assert [a.name for a in trainer.adapters] == ["alpha", "beta"]
    base = _base(trainer)
    a0, b0 = _weights(trainer, "alpha"), _weights(trainer, "beta")
    fp0 = trainer.fingerprint()
    assert {"weights", "optimizer", "adapter/alpha", "adapter/beta", "optimizer/beta"} <= set(fp0)

    g = groups(n_groups=4, seed=11)
    m1 = trainer.train_step(_named(g, "alpha"), _algo())
    fp1 = trainer.fingerprint()
    # beta: tensors, optimizer state and schedule bit for bit as they were
    b1 = _weights(trainer, "beta")
    assert all(torch.equal(b1[n], b0[n]) for n in b0)
    assert fp1["adapter/beta"] == fp0["adapter/beta"]
    assert fp1["optimizer/beta"] == fp0["optimizer/beta"]
    assert not trainer._local.optimizers["beta"].state
    assert trainer._local.schedulers["beta"].last_epoch == 0
    # alpha moved
    a1 = _weights(trainer, "alpha")
    assert any(not torch.equal(a1[n], a0[n]) for n in a0)
    assert fp1["adapter/alpha"] != fp0["adapter/alpha"]
    assert fp1["optimizer/alpha"] != fp0["optimizer/alpha"]
    # the metrics: alpha's prefixed, no beta's, the totals plain
    assert m1["alpha/lr"] == pytest.approx(2e-2) and "alpha/loss" in m1
    assert not any(k.startswith("beta/") for k in m1)
    assert m1["step"] == 1.0 and m1["tokens"] == m1["alpha/tokens"] > 0
    assert {"step_time_s", "response_tokens", "tokens_per_s", "weight_version"} <= set(m1)
    assert "loss" not in m1 and "lr" not in m1

    # a mixed step: both move, each at its own learning rate and schedule
    m2 = trainer.train_step(_named(g, "beta", "alpha"), _algo())
    fp2 = trainer.fingerprint()
    assert fp2["adapter/alpha"] != fp1["adapter/alpha"]
    assert fp2["adapter/beta"] != fp1["adapter/beta"]
    assert m2["beta/lr"] == pytest.approx(5e-3)  # beta's first step: its peak lr
    assert m2["alpha/lr"] == pytest.approx(2e-2)
    # each schedule counts its own adapter's steps
    assert trainer._local.schedulers["alpha"].last_epoch == 2
    assert trainer._local.schedulers["beta"].last_epoch == 1
    assert m2["tokens"] == m2["alpha/tokens"] + m2["beta/tokens"]
    assert m2["step"] == 2.0
    assert any(t.any() for n, t in trainer.export_weights("beta") if ".lora_B." in n)
    # the base: bit for bit what it was
    for n, v in _base(trainer).items():
        assert torch.equal(v, base[n]), n

    # sleep frees every adapter's gradients (each optimizer's)
    trainer.sleep()
    assert all(p.grad is None for p in trainer._local.model.parameters())
    trainer.wake()

    # groups and names the trainer does not hold
    with pytest.raises(ValueError, match=r"adapter 'gamma'.*it has alpha, beta"):
        trainer.train_step(_named(g, "gamma"), _algo())
    with pytest.raises(ValueError, match="names no adapter, and the fsdp2 trainer holds"):
        trainer.compute_logprobs(g)
    with pytest.raises(ValueError, match="holds adapters alpha, beta: name the one wanted"):
        trainer.export_weights()
    with pytest.raises(ValueError, match="no adapter 'gamma'; it has alpha, beta"):
        trainer.save_adapter("unused", adapter="gamma")
    trainer.close()


def test_logprobs_follow_each_groups_adapter(llama_path: str, groups, hf, tmp_path) -> None:
    from peft import PeftModel

    from miles_core.runtime.export import export_checkpoint

    trainer = _two()
    trainer.setup(llama_path)
    g = groups(n_groups=4, seed=11)
    trainer.train_step(_named(g, "alpha"), _algo())
    mixed = _named(g, "beta", "alpha")  # groups 0, 2: beta; 1, 3: alpha
    rows = {"beta": [0, 1, 2, 3, 8, 9, 10, 11], "alpha": [4, 5, 6, 7, 12, 13, 14, 15]}
    lp, ent = trainer.compute_logprobs(mixed)
    assert lp.shape == (16, max(len(s.response_ids) for x in g for s in x.samples))
    assert ent is not None and ent.shape == lp.shape
    base = hf.logprobs(hf.model(llama_path), g)
    # beta is still zero: its groups are the base's; alpha's are alpha's, as peft has them
    torch.testing.assert_close(lp[rows["beta"]], base[rows["beta"]], atol=1e-5, rtol=0)
    assert (lp[rows["alpha"]] - base[rows["alpha"]]).abs().max() > 1e-4

    trainer.train_step(mixed, _algo())
    lp, _ = trainer.compute_logprobs(mixed)
    for name in ("alpha", "beta"):
        trainer.save_adapter(str(tmp_path / name), adapter=name)
        peft_model = PeftModel.from_pretrained(hf.model(llama_path), str(tmp_path / name))
        peft_model.eval()
        expected = hf.logprobs(peft_model, g)
        torch.testing.assert_close(lp[rows[name]], expected[rows[name]], atol=1e-5, rtol=0)
        assert (lp[rows[name]] - base[rows[name]]).abs().max() > 1e-4
        # the merged export holds this adapter alone
        export_checkpoint(trainer.export_model(name), Path(llama_path), tmp_path / f"m_{name}")
        merged = hf.logprobs(hf.model(str(tmp_path / f"m_{name}")), g)
        torch.testing.assert_close(merged[rows[name]], lp[rows[name]], atol=1e-5, rtol=0)
    trainer.close()


def test_resume_with_two_adapters_is_bitwise(llama_path: str, groups, tmp_path) -> None:
    g = groups(n_groups=4, seed=11)
    first = _two()
    first.setup(llama_path)
    first.train_step(_named(g, "alpha"), _algo())  # beta's optimizer still empty
    saved = first.fingerprint()
    ckpt = str(tmp_path / "ckpt")
    first.save(ckpt, extra={"data_position": 3})
    assert first.fingerprint() == saved  # saving changes nothing (beta's zero step undone)
    second = first.train_step(_named(g, "beta", "alpha"), _algo())
    third = first.train_step(_named(g, "alpha", "beta", "beta"), _algo())
    expected = first.fingerprint()
    first.close()

    torch.manual_seed(1234)
    resumed = _two()
    resumed.setup(llama_path)
    resumed.load(ckpt)
    assert resumed.fingerprint() == saved and resumed.extra == {"data_position": 3}
    again = resumed.train_step(_named(g, "beta", "alpha"), _algo())
    assert again["beta/loss"] == second["beta/loss"]
    assert again["alpha/grad_norm"] == second["alpha/grad_norm"]
    resumed.train_step(_named(g, "alpha", "beta", "beta"), _algo())
    assert resumed.fingerprint() == expected
    assert third["step"] == 3.0
    resumed.close()

    # a trainer with other adapters is refused, naming them
    alone = build(OPTIONS, adapters=[build_lora(ALPHA)])
    alone.setup(llama_path)
    with pytest.raises(ValueError, match=r"adapters \{'alpha'.*'beta'.*resumes only with"):
        alone.load(ckpt)
    alone.close()


def test_a_critic_is_refused_with_several_adapters(llama_path: str, groups) -> None:
    ppo = build_policy_gradient(PPOOptions(behaviour_policy="recomputed"))
    trainer = _two()
    with pytest.raises(ValueError, match="one critic cannot serve several policies"):
        trainer.check_algorithm(ppo)
    # one adapter with a critic trains as before, its metrics unprefixed
    one = build(OPTIONS, adapters=[build_lora(ALPHA)])
    one.setup(llama_path)
    metrics = one.train_step(groups(seed=11), ppo)
    assert "critic/grad_norm" in metrics and metrics["lr"] == pytest.approx(2e-2)
    one.close()


def test_the_factory_and_the_controller_take_adapters(llama_path: str) -> None:
    one = build(OPTIONS, build_lora(ALPHA))
    assert one.adapter.name == "alpha" and [a.name for a in one.adapters] == ["alpha"]
    two = _two()
    with pytest.raises(AttributeError, match=r"holds 2 adapters \(alpha, beta\): use .adapters"):
        _ = two.adapter
    with pytest.raises(ValueError, match="adapter= or adapters=, not both"):
        build(OPTIONS, build_lora(ALPHA), adapters=[build_lora(BETA)])
    with pytest.raises(ValueError, match="'alpha' is given more than once"):
        build(OPTIONS, adapters=[build_lora(ALPHA), build_lora(ALPHA)])
    assert build(OPTIONS).adapters == [] and build(OPTIONS).adapter is None


@pytest.mark.slow
def test_two_ranks_train_two_adapters_as_one(llama_path: str, groups, tmp_path) -> None:
    g = groups(n_groups=4, seed=11)
    steps = [_named(g, "alpha"), _named(g, "beta", "alpha")]
    runs = []
    for options in (OPTIONS, OPTIONS.model_copy(update={"world_size": 2})):
        trainer = _two(options)
        trainer.setup(llama_path)
        beta0 = trainer.fingerprint()["adapter/beta"]
        m1 = trainer.train_step(steps[0], _algo())
        assert trainer.fingerprint()["adapter/beta"] == beta0  # untouched on every rank
        m2 = trainer.train_step(steps[1], _algo())
        lp, _ = trainer.compute_logprobs(steps[1])
        weights = {name: _weights(trainer, name) for name in ("alpha", "beta")}
        runs.append((trainer, [m1, m2], lp, weights))
    (one, m_one, lp_one, w_one), (two, m_two, lp_two, w_two) = runs
    for a, b in zip(m_one, m_two, strict=True):
        for key in ("alpha/loss", "beta/loss", "alpha/grad_norm", "beta/grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(lp_one, lp_two, atol=1e-5, rtol=0)
    for name in ("alpha", "beta"):
        assert set(w_one[name]) == set(w_two[name])
        for n in w_one[name]:
            torch.testing.assert_close(w_one[name][n], w_two[name][n], atol=1e-6, rtol=1e-5)
    ckpt = str(tmp_path / "ckpt2")
    two.save(ckpt)
    fp = two.fingerprint()
    two.save_adapter(str(tmp_path / "beta2"), adapter="beta")
    assert (tmp_path / "beta2" / "adapter_model.safetensors").exists()
    two.close()
    again = _two(OPTIONS.model_copy(update={"world_size": 2}))
    again.setup(llama_path)
    again.load(ckpt)
    assert again.fingerprint() == fp
    again.close()
    one.close()
