"""PPO's critic on Megatron: its options, its values and one PPO step (policy and critic)
against FSDP2's critic on the same weights at every layout, bitwise save/resume with a critic,
sleep/wake, and a weight stream without it."""

from __future__ import annotations

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions, PPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build as build_fsdp2
from miles_backend_megatron.options import SUPPORTED_NEEDS, MegatronOptions
from miles_backend_megatron.plugin import backend
from miles_backend_megatron.trainer import build
from pydantic import ValidationError

# PPO with a recomputed behaviour policy, a KL to the reference and an entropy bonus: the
# policy's and the critic's gradients both come from the one loss of the whole batch.
PPO = PPOOptions(behaviour_policy="recomputed", kl_coef=0.1, entropy_coef=0.01)
# Both clippings bind (the norms are ~1.4 and ~0.9), so the global norms over TP/PP count.
CRITIC = {"lr": 1e-3, "max_grad_norm": 0.5}
OPTS = dict(
    lr=1e-3, eps=1e-3, weight_decay=0.01, max_grad_norm=0.5, micro_batch_tokens=40, critic=CRITIC
)


def test_critic_options_and_what_the_backend_computes() -> None:
    critic = MegatronOptions.model_validate({"critic": {"path": "/ckpt"}}).critic
    assert (critic.path, critic.lr, critic.warmup_steps, critic.max_grad_norm) == (
        "/ckpt",
        1e-5,
        0,
        1.0,
    )
    assert MegatronOptions().critic.path is None  # the policy's checkpoint
    with pytest.raises(ValidationError, match=r"greater than critic.warmup_steps \(8\)"):
        MegatronOptions(lr_schedule="cosine", decay_steps=5, critic={"warmup_steps": 8})
    with pytest.raises(ValidationError) as info:
        MegatronOptions.model_validate({"critic": {"lr": 0}})
    assert [e["loc"] for e in info.value.errors()] == [("critic", "lr")]
    assert "values" in SUPPORTED_NEEDS and backend().computes == SUPPORTED_NEEDS


def test_ppo_on_megatron_is_valid_and_named_among_the_backends_that_compute_values() -> None:
    """Through the real config validation: PPO on megatron passes, and a backend without a
    critic is refused naming megatron among those that compute values."""
    from miles_core import RolloutEngine, TrainerBackend, Transport, hookimpl
    from miles_core.config import validate_config
    from miles_core.errors import IncompatibleError
    from miles_core.plugins import collect_registry, create_plugin_manager

    class Slots:
        """In-test engine and transport (never built) and a backend without a critic."""

        @hookimpl
        def miles_register_trainer_backends(self, register) -> None:
            register(
                TrainerBackend(
                    name="no-critic", factory="x:y", computes=frozenset({"old_logprobs"})
                )
            )

        @hookimpl
        def miles_register_rollout_engines(self, register) -> None:
            register(RolloutEngine(name="mg-test-engine", factory="x:y"))

        @hookimpl
        def miles_register_transports(self, register) -> None:
            register(Transport(name="mg-test-transport", factory="x:y"))

    pm = create_plugin_manager(allow=["miles-algorithms", "miles-backend-megatron"])
    pm.register_plugin(Slots(), name="mg-critic-slots", distribution="tests", version="0")
    registry = collect_registry(pm)

    def config(name: str) -> dict:
        return {
            "run": {"mode": "sync", "placement": "disaggregated"},
            "model": {"path": "unused"},
            "backend": name,
            "engine": "mg-test-engine",
            "transport": "mg-test-transport",
            "algorithm": "ppo",
            "reward": "exact_match",
            "data": {"name": "jsonl", "path": "unused.jsonl"},
        }

    valid = validate_config(config("megatron"), registry)
    assert valid.backend.options.critic.path is None
    with pytest.raises(IncompatibleError, match="backends that do: megatron"):
        validate_config(config("no-critic"), registry)


def _fsdp2_after_step(path: str, groups: list, share_prompts: bool) -> tuple:
    trainer = build_fsdp2(FSDP2Options(**OPTS, cpu_threads=1, share_prompts=share_prompts))
    trainer.setup(path)
    values = trainer.compute_values(groups)
    metrics = trainer.train_step(groups, build_policy_gradient(PPO))
    after = trainer.compute_values(groups)
    weights = dict(trainer.export_weights())
    trainer.close()
    return values, metrics, after, weights


@pytest.fixture(scope="module")
def fsdp2_ppo() -> object:
    """FSDP2's critic values, PPO metrics, values after the step and exported policy weights,
    per (model, share_prompts): the reference every layout is held to (FSDP2's value head is
    drawn from the seed the same way)."""
    cache: dict[tuple[str, bool], tuple] = {}

    def get(path: str, groups: list, share_prompts: bool = True) -> tuple:
        key = (path, share_prompts)
        if key not in cache:
            cache[key] = _fsdp2_after_step(path, groups, share_prompts)
        return cache[key]

    return get


def _check_ppo_parity(trainer: object, path: str, groups: list, reference: object, share: bool):
    v_ref, m_ref, after_ref, w_ref = reference(path, groups, share)
    values = trainer.compute_values(groups)
    assert (values - v_ref).abs().max() < 1e-5
    assert values.abs().max() > 1e-3  # a seeded head, not zeros: the body gets a gradient
    before = trainer.fingerprint()["critic"]
    metrics = trainer.train_step(groups, build_policy_gradient(PPO))
    for key in ("loss", "loss/value", "loss/policy"):
        assert metrics[key] == pytest.approx(m_ref[key], abs=1e-6), key
    for key in ("grad_norm", "critic/grad_norm"):
        assert metrics[key] == pytest.approx(m_ref[key], rel=1e-5), key
    assert metrics["critic/lr"] == CRITIC["lr"] and metrics["critic/skipped_nonfinite"] == 0.0
    # The critic learned, and exactly as FSDP2's did.
    assert trainer.fingerprint()["critic"] != before
    after = trainer.compute_values(groups)
    assert (after - after_ref).abs().max() < 1e-5
    assert (after - values).abs().max() > 1e-4
    # The weight stream is the policy's alone, as FSDP2's: no critic tensor in it.
    weights = dict(trainer.export_weights())
    assert list(weights) == list(w_ref)
    for name, ref in w_ref.items():
        rel = (weights[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        assert rel < 1e-5, (name, float(rel))


@pytest.mark.parametrize(
    ("share_prompts", "keep_activations"), [(True, True), (False, False), (True, False)]
)
def test_ppo_parity_with_fsdp2_tp1(
    model_path: str, groups, fsdp2_ppo, share_prompts: bool, keep_activations: bool
) -> None:
    g = groups(2, 4, seed=1)
    options = MegatronOptions(
        **OPTS, cpu_threads=1, share_prompts=share_prompts, keep_activations=keep_activations
    )
    trainer = build(options)
    trainer.setup(model_path)
    _check_ppo_parity(trainer, model_path, g, fsdp2_ppo, share_prompts)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "tp", "pp", "dp", "keep", "share"),
    [
        ("qwen3", 2, 1, 1, True, True),  # QK-norm split by heads; the head on both TP ranks
        ("llama", 1, 2, 1, True, False),  # tied embedding: the critic has no head copy
        ("llama", 2, 2, 1, False, True),
        ("qwen3", 2, 1, 2, False, False),  # two replicas, recomputed forward
    ],
)
def test_ppo_parity_with_fsdp2_parallel(
    family: str,
    tp: int,
    pp: int,
    dp: int,
    keep: bool,
    share: bool,
    request,
    groups,
    fsdp2_ppo,
) -> None:
    """Tensor, pipeline and data parallel on gloo (spawned processes) against FSDP2's critic."""
    path = request.getfixturevalue(f"{family}_path")
    g = groups(2, 4, seed=1)
    options = MegatronOptions(
        **OPTS,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=dp,
        keep_activations=keep,
        share_prompts=share,
        cpu_threads=1,
    )
    with build(options) as trainer:
        trainer.setup(path)
        _check_ppo_parity(trainer, path, g, fsdp2_ppo, share)


def test_save_resume_with_a_critic_is_bitwise(
    llama_path: str, groups, tmp_path, resume_is_bitwise
) -> None:
    options = MegatronOptions(lr=1e-3, critic=CRITIC, cpu_threads=1)
    algo = build_policy_gradient(PPOOptions())
    expected = resume_is_bitwise(options, llama_path, groups(2, 4, seed=2), algo, tmp_path)
    assert {"critic", "critic_optimizer"} <= set(expected)


@pytest.mark.slow
def test_save_resume_with_a_critic_is_bitwise_tp2_pp2(
    qwen3_path: str, groups, tmp_path, resume_is_bitwise
) -> None:
    options = MegatronOptions(
        lr=1e-3, critic=CRITIC, tensor_parallel=2, pipeline_parallel=2, cpu_threads=1
    )
    algo = build_policy_gradient(PPOOptions())
    expected = resume_is_bitwise(options, qwen3_path, groups(2, 4, seed=2), algo, tmp_path)
    assert {"critic", "critic_optimizer"} <= set(expected)


def test_a_checkpoint_without_a_critic_drops_one(llama_path: str, groups, tmp_path) -> None:
    """Saved by a GRPO run: loading it into a trainer that has built a critic drops the
    critic, and the next PPO step builds it fresh, as the saved trainer would have."""
    g = groups(1, 4, seed=4)
    grpo = build(MegatronOptions(lr=1e-3, cpu_threads=1))
    grpo.setup(llama_path)
    grpo.train_step(g, build_policy_gradient(GRPOOptions()))
    grpo.save(str(tmp_path / "grpo"))
    fresh_values = grpo.compute_values(g)  # builds a critic after the save
    ppo = build(MegatronOptions(lr=1e-3, cpu_threads=1))
    ppo.setup(llama_path)
    ppo.train_step(g, build_policy_gradient(PPOOptions()))
    assert "critic" in ppo.fingerprint()
    ppo.load(str(tmp_path / "grpo"))
    assert "critic" not in ppo.fingerprint()
    assert torch.equal(ppo.compute_values(g), fresh_values)


def test_sleep_wake_keeps_the_critic(llama_path: str, groups) -> None:
    g = groups(1, 4, seed=3)
    trainer = build(MegatronOptions(lr=1e-3, critic=CRITIC, cpu_threads=1))
    trainer.setup(llama_path)
    trainer.train_step(g, build_policy_gradient(PPOOptions()))
    before = trainer.fingerprint()
    trainer.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        trainer.compute_values(g)
    trainer.wake()
    assert trainer.fingerprint() == before
    metrics = trainer.train_step(g, build_policy_gradient(PPOOptions()))
    assert metrics["critic/grad_norm"] > 0


def test_a_value_model_checkpoint_as_the_critic(model_path: str, groups, tmp_path) -> None:
    """``critic.path`` may be a Hugging Face value model (token classification, one label, no
    vocabulary head) of a supported family: its body and its ``score`` head are loaded, and the
    values equal a plain Hugging Face forward of that model."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(5)
    value_model = AutoModelForTokenClassification.from_pretrained(
        model_path, num_labels=1, dtype=torch.float32
    )
    with torch.no_grad():
        value_model.score.bias.fill_(0.25)
    value_model.eval()
    value_model.save_pretrained(tmp_path / "value")
    g = groups(2, 3, seed=6)
    trainer = build(MegatronOptions(cpu_threads=1, critic={"path": str(tmp_path / "value")}))
    trainer.setup(model_path)
    values = trainer.compute_values(g)
    samples = [s for group in g for s in group.samples]
    with torch.no_grad():
        for i, s in enumerate(samples):
            out = value_model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits
            p, n = len(s.prompt_ids), len(s.response_ids)
            torch.testing.assert_close(
                values[i, :n], out[0, p - 1 : p - 1 + n, 0], atol=1e-5, rtol=0
            )
    # A critic checkpoint the backend cannot build is refused at set-up, naming the field.
    from miles_core.errors import ConfigError

    broken = build(MegatronOptions(cpu_threads=1, critic={"path": str(tmp_path)}))
    with pytest.raises(ConfigError, match=r"backend\.critic\.path: .* holds no config\.json"):
        broken.setup(model_path)
