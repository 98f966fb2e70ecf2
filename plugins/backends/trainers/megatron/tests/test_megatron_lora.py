"""LoRA on the Megatron backend against FSDP2 + LoRA (the same adapter options, the same seeded
A): the adapter's tensors before and after a step, the log-probs under it, at tensor parallel
1 and 2 and pipeline parallel 2; the exports (PEFT names, a folder peft loads, the merged
model); the base frozen; bitwise resume; what is refused."""

from __future__ import annotations

import os

import pytest
import torch
from miles_algorithms.algorithms import build_policy_gradient
from miles_algorithms.options import GRPOOptions
from miles_backend_fsdp2.options import FSDP2Options
from miles_backend_fsdp2.trainer import build as build_fsdp2
from miles_backend_megatron.options import MegatronOptions
from miles_backend_megatron.trainer import build
from miles_lora.adapter import build as build_lora
from miles_lora.options import LoraOptions
from miles_trainer_common.testing import hf_response_logprobs

from miles_core.contracts import AdapterTrainer

# GRPO with a recomputed behaviour policy, a KL to the reference (the base: adapter off), an
# entropy bonus and the sequence-mean aggregation, on micro-batches (as the parity tests).
ALGO = GRPOOptions(
    behaviour_policy="recomputed", kl_coef=0.1, entropy_coef=0.01, loss_agg="seq_mean_token_mean"
)
# eps = 1e-3 keeps Adam's first step a smooth function of the gradient (see the FSDP2 tests).
OPTS = dict(lr=1e-2, eps=1e-3, weight_decay=0.01, max_grad_norm=0.5, micro_batch_tokens=40)
LORA = LoraOptions(rank=4, alpha=8, init_seed=3)


def _algo():
    return build_policy_gradient(ALGO)


def _steps(trainer, g, n: int = 2) -> list[dict[str, float]]:
    return [trainer.train_step(g, _algo()) for _ in range(n)]


@pytest.fixture(scope="module")
def fsdp2_lora() -> object:
    """FSDP2 + LoRA per family: the adapter before any step, the metrics of two steps, the
    adapter and the log-probs after them, the merged export."""
    cache: dict[tuple[str, str], dict] = {}

    def get(path: str, groups: list, lora: LoraOptions = LORA) -> dict:
        key = (path, lora.model_dump_json())
        if key not in cache:
            trainer = build_fsdp2(
                FSDP2Options(**OPTS, cpu_threads=1, share_prompts=False), build_lora(lora)
            )
            trainer.setup(path)
            before = dict(trainer.export_weights())
            metrics = _steps(trainer, groups)
            lp, ent = trainer.compute_logprobs(groups)
            cache[key] = {
                "before": before,
                "metrics": metrics,
                "after": dict(trainer.export_weights()),
                "lp": lp,
                "ent": ent,
                "merged": dict(trainer.export_model()),
            }
            trainer.close()
        return cache[key]

    return get


def _close(got: dict, want: dict, rel: float = 1e-5) -> None:
    assert list(got) == list(want)
    for name, ref in want.items():
        assert got[name].shape == ref.shape, name
        err = (got[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        assert err < rel, (name, float(err))


def _check_parity(trainer, path: str, g: list, reference, lora: LoraOptions = LORA) -> None:
    ref = reference(path, g, lora)
    before = dict(trainer.export_weights())
    # the same adapter to start with: A drawn from init_seed in the HF model's order, B zero
    assert list(before) == list(ref["before"])
    for name, value in ref["before"].items():
        assert torch.equal(before[name], value), name
    metrics = _steps(trainer, g)
    for m, m_ref in zip(metrics, ref["metrics"], strict=True):
        assert m["loss"] == pytest.approx(m_ref["loss"], abs=1e-6)
        assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
        assert m["kl_ref"] == pytest.approx(m_ref["kl_ref"], abs=1e-7)
    assert metrics[1]["kl_ref"] > 0  # the reference is the base, the policy moved off it
    _close(dict(trainer.export_weights()), ref["after"])
    lp, ent = trainer.compute_logprobs(g)
    assert (lp - ref["lp"]).abs().max() < 1e-5
    assert (ent - ref["ent"]).abs().max() < 1e-5


def test_parity_with_fsdp2_lora_tp1(model_path: str, groups, fsdp2_lora) -> None:
    g = groups(2, 4, seed=1)
    trainer = build(MegatronOptions(**OPTS, cpu_threads=1), build_lora(LORA))
    trainer.setup(model_path)
    assert isinstance(trainer, AdapterTrainer)
    _check_parity(trainer, model_path, g, fsdp2_lora)
    # the merged model: W + scaling * B @ A, as FSDP2's (peft's) merge
    _close(dict(trainer.export_model()), fsdp2_lora(model_path, g)["merged"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "tp", "pp", "dp", "keep"),
    [
        ("qwen3", 2, 1, 1, True),  # q/k/v branches' B split by key/value group, QK-norm
        ("llama", 2, 1, 1, True),
        ("llama", 1, 2, 1, True),  # each stage its layers' branches, tied embedding
        ("qwen3", 1, 2, 2, False),  # two replicas of a two-stage pipeline, recomputed forward
    ],
)
def test_parity_with_fsdp2_lora_parallel(
    family: str, tp: int, pp: int, dp: int, keep: bool, request, groups, fsdp2_lora
) -> None:
    path = request.getfixturevalue(f"{family}_path")
    g = groups(2, 4, seed=1)
    options = MegatronOptions(
        **OPTS,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=dp,
        keep_activations=keep,
        cpu_threads=1,
    )
    with build(options, build_lora(LORA)) as trainer:
        trainer.setup(path)
        _check_parity(trainer, path, g, fsdp2_lora)
        _close(dict(trainer.export_model()), fsdp2_lora(path, g)["merged"])


@pytest.mark.slow
def test_a_stage_without_branches_and_resume_at_tp2_pp2(
    qwen3_path: str, groups, fsdp2_lora, tmp_path
) -> None:
    """Targets on layer 1 alone: the first stage has no branch (an empty optimizer), the
    second trains; parity with FSDP2 on the same targets, then save -> resume bitwise."""
    lora = LoraOptions(rank=4, alpha=8, init_seed=5, target_modules=[r"model\.layers\.1\..*_proj"])
    g = groups(2, 4, seed=1)
    options = MegatronOptions(**OPTS, tensor_parallel=2, pipeline_parallel=2, cpu_threads=1)
    with build(options, build_lora(lora)) as trainer:
        trainer.setup(qwen3_path)
        _check_parity(trainer, qwen3_path, g, fsdp2_lora, lora)
        trainer.save(str(tmp_path / "ckpt"))
        _steps(trainer, g, 1)
        expected = trainer.fingerprint()
    with build(options, build_lora(lora)) as second:
        second.setup(qwen3_path)
        second.load(str(tmp_path / "ckpt"))
        _steps(second, g, 1)
        assert second.fingerprint() == expected


def test_exports_load_in_peft_and_transformers(qwen3_path: str, groups, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    g = groups(2, 4, seed=1)
    trainer = build(MegatronOptions(**OPTS, cpu_threads=1), build_lora(LORA))
    trainer.setup(qwen3_path)
    _steps(trainer, g)
    lp, _ = trainer.compute_logprobs(g)
    folder = str(tmp_path / "adapter")
    trainer.save_adapter(folder)
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, folder).eval()
    assert (hf_response_logprobs(peft_model, g) - lp).abs().max() < 1e-5
    merged_ref = peft_model.merge_and_unload().state_dict()
    merged = dict(trainer.export_model())
    assert set(merged) == set(merged_ref)
    for name, value in merged.items():
        assert (value - merged_ref[name]).abs().max() < 1e-5, name
    plain = AutoModelForCausalLM.from_pretrained(qwen3_path, dtype=torch.float32).eval()
    plain.load_state_dict(merged)
    assert (hf_response_logprobs(plain, g) - lp).abs().max() < 1e-5


def test_base_frozen_and_resume_is_bitwise(llama_path: str, groups, tmp_path) -> None:
    g = groups(2, 4, seed=2)
    first = build(MegatronOptions(**OPTS, cpu_threads=1), build_lora(LORA))
    first.setup(llama_path)
    start = first.fingerprint()
    _steps(first, g, 1)
    first.save(str(tmp_path / "ckpt"), extra={"data": 7})
    _steps(first, g, 1)
    expected = first.fingerprint()
    assert expected["weights"] == start["weights"]  # the base: bit for bit unchanged
    assert expected["adapter/policy"] != start["adapter/policy"]
    own = torch.load(tmp_path / "ckpt" / "rank0.pt", weights_only=False)
    assert own["model"] and all(".lora." in name for name in own["model"])  # adapter only
    second = build(MegatronOptions(**OPTS, cpu_threads=1), build_lora(LORA))
    second.setup(llama_path)
    second.load(str(tmp_path / "ckpt"))
    assert second.extra == {"data": 7} and second.weight_version == 1
    _steps(second, g, 1)
    assert second.fingerprint() == expected
    other = build(MegatronOptions(**OPTS, cpu_threads=1), build_lora(LoraOptions(rank=2, alpha=8)))
    other.setup(llama_path)
    with pytest.raises(ValueError, match="resumes only with the adapter"):
        other.load(str(tmp_path / "ckpt"))
    plain = build(MegatronOptions(**OPTS, cpu_threads=1))
    plain.setup(llama_path)
    with pytest.raises(ValueError, match="this one has none"):
        plain.load(str(tmp_path / "ckpt"))


def test_targets_select_and_refuse(llama_path: str, groups) -> None:
    # a regex on layer 1's attention only: the other linears stay the base, the stream
    # holds those branches alone
    only = LoraOptions(rank=2, alpha=4, target_modules=[r"model\.layers\.1\.self_attn\.[qo]_proj"])
    trainer = build(MegatronOptions(**OPTS, cpu_threads=1), build_lora(only))
    trainer.setup(llama_path)
    names = [n for n, _ in trainer.export_weights()]
    assert names == [
        f"base_model.model.model.layers.1.self_attn.{p}_proj.{ab}.weight"
        for p in "qo"
        for ab in ("lora_A", "lora_B")
    ]
    trainer.train_step(groups(1, 4, seed=3), _algo())
    options = MegatronOptions(cpu_threads=1)
    cases = [
        (LoraOptions(target_modules=["lm_head"]), "adapter.target_modules: 'lm_head' selects"),
        (LoraOptions(target_modules=["qkv_proj"]), "adapter.target_modules: 'qkv_proj' matches no"),
        (LoraOptions(target_modules=["self_attn"]), "LoRA adapts Linear layers only"),
        (LoraOptions(dropout=0.1), "adapter.dropout 0.1"),
    ]
    for lora_options, message in cases:
        with pytest.raises(ValueError, match=message):
            build(options, build_lora(lora_options)).setup(llama_path)
    te = MegatronOptions(cpu_threads=1, layer_spec="transformer_engine")
    with pytest.raises(ValueError, match="cannot carry an adapter"):
        build(te, build_lora(LORA)).setup(llama_path)


def test_ppo_with_an_adapter_trains_the_critic_whole(llama_path: str, groups) -> None:
    """With an adapter the critic stays a full model (fully fine-tuned), as on FSDP2; the
    policy's base stays frozen."""
    from miles_algorithms.options import PPOOptions

    g = groups(1, 4, seed=4)
    trainer = build(MegatronOptions(**OPTS, cpu_threads=1), build_lora(LORA))
    trainer.setup(llama_path)
    before = trainer.fingerprint()
    ppo = build_policy_gradient(PPOOptions(behaviour_policy="recomputed", kl_coef=0.1))
    metrics = trainer.train_step(g, ppo)
    assert metrics["critic/grad_norm"] > 0 and metrics["grad_norm"] > 0
    after = trainer.fingerprint()
    assert after["weights"] == before["weights"]
    assert after["adapter/policy"] != before["adapter/policy"] and "critic" in after


# --- several adapters on one base (multi-LoRA) -----------------------------------------------

ALPHA = LoraOptions(rank=4, alpha=8, served_name="alpha", init_seed=1)
# its own rank, lr, seed, and targets on layer 1 alone: at pipeline parallel 2 the first stage
# holds none of it (an empty optimizer there)
BETA = LoraOptions(
    rank=2,
    alpha=4,
    served_name="beta",
    init_seed=2,
    lr=5e-3,
    target_modules=[r"model\.layers\.1\.(self_attn\.[qv]|mlp\.down)_proj"],
)


def _named(groups: list, *names: str) -> list:
    """The groups, the i-th naming ``names[i % len(names)]``."""
    import dataclasses

    return [dataclasses.replace(g, adapter=names[i % len(names)]) for i, g in enumerate(groups)]


def _adapters() -> list:
    return [build_lora(ALPHA), build_lora(BETA)]


@pytest.fixture(scope="module")
def fsdp2_two() -> object:
    """FSDP2 with the two adapters, two steps on mixed groups ``g``: each adapter's tensors
    before and after, the metrics, the log-probs after (each group under its adapter), the
    merged export of ``beta``."""
    cache: dict[str, dict] = {}

    def get(path: str, g: list) -> dict:
        if path not in cache:
            options = FSDP2Options(**OPTS, cpu_threads=1, share_prompts=False)
            with build_fsdp2(options, adapters=_adapters()) as trainer:
                trainer.setup(path)
                before = {n: dict(trainer.export_weights(n)) for n in ("alpha", "beta")}
                metrics = _steps(trainer, g)
                cache[path] = {
                    "before": before,
                    "metrics": metrics,
                    "lp": trainer.compute_logprobs(g)[0],
                    "after": {n: dict(trainer.export_weights(n)) for n in ("alpha", "beta")},
                    "merged": dict(trainer.export_model("beta")),
                }
        return cache[path]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "pp", "resume"),
    [
        (2, 1, False),  # column (q, v) and row (down) branches split over two ranks
        (1, 2, True),  # the first stage holds none of beta: an empty optimizer there
    ],
)
def test_two_adapters_match_fsdp2_train_alone_and_resume(
    tp: int, pp: int, resume: bool, qwen3_path: str, groups, fsdp2_two, tmp_path
) -> None:
    """Two adapters on mixed groups match FSDP2 with the same two (each adapter's tensors,
    metrics, log-probs, the merged export of one); a step whose groups all name ``alpha``
    leaves ``beta``'s tensors and optimizer bit for bit; save -> resume is bitwise."""
    g = _named(groups(2, 4, seed=1), "alpha", "beta")
    ref = fsdp2_two(qwen3_path, g)
    options = MegatronOptions(**OPTS, tensor_parallel=tp, pipeline_parallel=pp, cpu_threads=1)
    with build(options, adapters=_adapters()) as trainer:
        trainer.setup(qwen3_path)
        for name in ("alpha", "beta"):
            before = dict(trainer.export_weights(name))
            assert list(before) == list(ref["before"][name])
            assert all(torch.equal(before[n], v) for n, v in ref["before"][name].items())
        metrics = _steps(trainer, g)
        for m, m_ref in zip(metrics, ref["metrics"], strict=True):
            for name in ("alpha", "beta"):
                assert m[f"{name}/loss"] == pytest.approx(m_ref[f"{name}/loss"], abs=1e-6)
                assert m[f"{name}/grad_norm"] == pytest.approx(m_ref[f"{name}/grad_norm"], rel=1e-5)
                assert m[f"{name}/lr"] == m_ref[f"{name}/lr"]
            assert m["tokens"] == m_ref["tokens"] and m["step"] == m_ref["step"]
        for name in ("alpha", "beta"):
            _close(dict(trainer.export_weights(name)), ref["after"][name])
        lp, _ = trainer.compute_logprobs(g)
        assert (lp - ref["lp"]).abs().max() < 1e-5
        _close(dict(trainer.export_model("beta")), ref["merged"])

        if resume:
            trainer.save(str(tmp_path / "ckpt"))
        start = trainer.fingerprint()
        only_alpha = _named(g, "alpha")
        metrics = trainer.train_step(only_alpha, _algo())
        assert "alpha/loss" in metrics and not any(k.startswith("beta/") for k in metrics)
        expected = trainer.fingerprint()
        assert expected["adapter/alpha"] != start["adapter/alpha"]
        assert expected["optimizer/alpha"] != start["optimizer/alpha"]
        for key in ("adapter/beta", "optimizer/beta", "weights"):
            assert expected[key] == start[key], key
    if not resume:
        return
    with build(options, adapters=_adapters()) as second:
        second.setup(qwen3_path)
        second.load(str(tmp_path / "ckpt"))
        assert second.fingerprint() == start
        second.train_step(only_alpha, _algo())
        assert second.fingerprint() == expected


def test_two_adapters_refusals(llama_path: str, groups) -> None:
    """A group naming no adapter (or one not held), a critic for two policies, a name that
    cannot key the branches: each refused with the reason."""
    from miles_algorithms.options import PPOOptions

    trainer = build(MegatronOptions(**OPTS, cpu_threads=1), adapters=_adapters())
    trainer.setup(llama_path)
    g = groups(1, 4, seed=3)
    with pytest.raises(ValueError, match="each group must name the adapter it trains"):
        trainer.train_step(g, _algo())
    with pytest.raises(ValueError, match="does not hold; it has alpha, beta"):
        trainer.compute_logprobs(_named(g, "gamma"))
    ppo = build_policy_gradient(PPOOptions(behaviour_policy="recomputed"))
    with pytest.raises(ValueError, match="one critic cannot serve several policies"):
        trainer.train_step(_named(g, "alpha"), ppo)
    with pytest.raises(ValueError, match="name the one wanted"):
        dict(trainer.export_weights())
    keys = LoraOptions(served_name="keys")
    with pytest.raises(ValueError, match=r"adapter\.served_name 'keys'"):
        build(MegatronOptions(cpu_threads=1), build_lora(keys)).setup(llama_path)
