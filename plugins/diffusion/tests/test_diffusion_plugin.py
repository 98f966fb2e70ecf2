"""Registration through the real plugin manager, the core's contract checks, compatibility
declarations, the image rewards and the rollout function."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from miles_diffusion import plugin as diffusion_plugin
from miles_diffusion.modality import SAMPLER_FIELDS
from miles_diffusion.options import DiffusionOptions
from miles_diffusion.policy import DiffusionPolicy
from miles_diffusion.rewards import ColourTarget, ImageBrightness, JpegCompressibility
from miles_diffusion.rollout import DiffusionSample, rollout_from_groups

from miles_core import (
    Kind,
    RolloutEngine,
    TrainerBackend,
    Transport,
    hookimpl,
)
from miles_core.config import validate_config
from miles_core.contracts import AlgorithmImpl, RolloutFn
from miles_core.data import Sample
from miles_core.errors import ConfigError, IncompatibleError
from miles_core.plugins import load_plugins
from miles_core.testing.contracts import check_component

torch.set_num_threads(1)

REWARDS = ("image_brightness", "image_colour_target", "jpeg_compressibility")


@pytest.fixture(scope="module")
def plugins() -> Any:
    """The installed entry point of this distribution, loaded by the real manager."""
    return load_plugins(allow=["miles-diffusion"])


def test_entry_point_registers_everything(plugins: Any) -> None:
    info = plugins.pm.infos["diffusion"]
    assert info.distribution == "miles-diffusion"
    assert info.registers == {
        "modality": ["diffusion"],
        "rollout_function": ["diffusion_sample"],
        "reward_function": [*REWARDS, "digit_classifier"],
        "data_source": ["digit_prompts"],
        "algorithm": ["diffusion_grpo"],
        "trainer_backend": ["diffusion"],
        "rollout_engine": ["diffusion"],
    }
    modality = plugins.registry.get(Kind.MODALITY, "diffusion")
    assert modality.default_rollout_function == "diffusion_sample"
    assert modality.config is DiffusionOptions
    for name in (*REWARDS, "digit_classifier"):
        assert plugins.registry.get(Kind.REWARD_FUNCTION, name).requires == {
            "modality": ("diffusion",)
        }


def test_loading_the_plugin_imports_no_torch() -> None:
    code = (
        "import sys; from miles_core.plugins import load_plugins; "
        "p = load_plugins(allow=['miles-diffusion']); "
        "assert 'diffusion' in p.pm.infos; "
        "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", REWARDS)
def test_reward_records_pass_the_contract(plugins: Any, name: str) -> None:
    component = plugins.registry.get(Kind.REWARD_FUNCTION, name)
    check_component(component, build=False)
    # The core's behavioural check scores its own example, a text sample: an image reward
    # refuses it with a clear reason rather than inventing a score.
    with pytest.raises(ValueError, match=r"metadata\['image'\] is missing"):
        check_component(component)


def test_other_components_pass_the_contract(plugins: Any) -> None:
    reg = plugins.registry
    fn = check_component(reg.get(Kind.ROLLOUT_FUNCTION, "diffusion_sample"))
    assert isinstance(fn, RolloutFn)
    algo = check_component(reg.get(Kind.ALGORITHM, "diffusion_grpo"))
    assert isinstance(algo, AlgorithmImpl)
    modality = check_component(
        reg.get(Kind.MODALITY, "diffusion"), options=DiffusionOptions(num_inference_steps=2)
    )
    assert modality.sampler()["num_inference_steps"] == 2
    assert set(modality.sampler()) == set(SAMPLER_FIELDS)


class _OtherSlots:
    """Registration records (never built) for the slots a run config needs besides ours."""

    @hookimpl
    def miles_register_trainer_backends(self, register: Callable[[Any], None]) -> None:
        register(TrainerBackend(name="b", factory=dict))

    @hookimpl
    def miles_register_rollout_engines(self, register: Callable[[Any], None]) -> None:
        register(RolloutEngine(name="e", factory=dict))

    @hookimpl
    def miles_register_transports(self, register: Callable[[Any], None]) -> None:
        register(Transport(name="t", factory=dict))


def _raw(modality: Any, reward: str) -> dict[str, Any]:
    return {
        "model": {"path": "unused"},
        "backend": "b",
        "engine": "e",
        "transport": "t",
        "algorithm": "diffusion_grpo",
        "modality": modality,
        "reward": reward,
        "rollout_function": "diffusion_sample",
        "data": {"name": "jsonl", "path": "prompts.jsonl"},
    }


def test_compatibility_declarations(
    miles_register: Callable[..., Any], miles_registry: Callable[[], Any]
) -> None:
    miles_register(diffusion_plugin, name="diffusion", distribution="miles-diffusion")
    miles_register(_OtherSlots(), name="other-slots")
    registry = miles_registry()
    ok = validate_config(
        _raw({"name": "diffusion", "num_inference_steps": 4, "eta": 0.5}, "image_brightness"),
        registry,
    )
    assert ok.modality.name == "diffusion"
    assert isinstance(ok.modality.options, DiffusionOptions)
    assert ok.modality.options.num_inference_steps == 4
    with pytest.raises(ConfigError, match="eta"):
        validate_config(_raw({"name": "diffusion", "eta": 0}, "image_brightness"), registry)
    single = {**_raw("diffusion", "image_brightness"), "rollout": {"group_size": 1}}
    with pytest.raises(IncompatibleError, match="needs at least 2 samples per prompt"):
        validate_config(single, registry)
    with pytest.raises(IncompatibleError) as exc:
        validate_config(_raw("text", "image_brightness"), registry)
    text = str(exc.value)
    assert "reward function 'image_brightness' requires modality in {diffusion}" in text
    assert "rollout function 'diffusion_sample' requires modality in {diffusion}" in text
    assert "algorithm 'diffusion_grpo' requires modality in {diffusion}" in text


def _image_sample(image: torch.Tensor) -> Sample:
    return Sample(prompt_ids=[0], metadata={"image": image})


def test_brightness_reward() -> None:
    img = torch.full((3, 8, 8), 0.25)
    img[0] = 1.0
    assert ImageBrightness()(_image_sample(img), {}) == pytest.approx(0.5)
    from miles_diffusion.options import BrightnessOptions

    near = ImageBrightness(BrightnessOptions(target=0.4))(_image_sample(img), {})
    assert near == pytest.approx(-0.1)
    # nested lists are accepted too
    assert ImageBrightness()(_image_sample(img.tolist()), {}) == pytest.approx(0.5)  # type: ignore[arg-type]


def test_colour_target_reward() -> None:
    red = torch.zeros(3, 4, 4)
    red[0] = 1.0
    assert ColourTarget()(_image_sample(red), {}) == pytest.approx(1.0)
    assert ColourTarget()(_image_sample(1.0 - red), {}) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="RGB"):
        ColourTarget()(_image_sample(torch.zeros(1, 4, 4)), {})


def test_jpeg_compressibility_reward() -> None:
    from miles_diffusion.options import JpegCompressibilityOptions

    reward = JpegCompressibility(JpegCompressibilityOptions(upscale=4))
    flat = reward(_image_sample(torch.full((3, 16, 16), 0.5)), {})
    noise = reward(
        _image_sample(torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))), {}
    )
    assert flat < 0 and noise < flat  # noise costs more bytes


def _policy() -> DiffusionPolicy:
    return DiffusionPolicy(DiffusionOptions(num_inference_steps=4))


def test_rollout_function_produces_a_scored_group() -> None:
    policy = _policy()
    policy.weight_version = 3
    fn = DiffusionSample()
    group = asyncio.run(
        fn(
            {"prompt": "class two", "label": 2, "seed": 11},
            group_size=3,
            engine=policy,
            reward=ImageBrightness(),
        )
    )
    assert len(group.samples) == 3 and group.prompt["label"] == 2
    assert group.oldest_version == 3
    for i, s in enumerate(group.samples):
        s.check()
        assert s.response_ids == policy.timesteps
        assert len(s.logprobs) == 4 and s.loss_mask == [1] * 4 and s.versions == [3] * 4
        assert s.metadata["label"] == 2 and s.metadata["index"] == i
        assert s.reward == pytest.approx(float(s.metadata["image"].mean()))
    # The group converts back into the batch it was sampled as; its log-probs recompute.
    rollout, rewards, index = rollout_from_groups([group])
    assert index.tolist() == [0, 0, 0] and rewards.shape == (3,)
    direct = policy.sample([2, 2, 2], seed=11)
    assert torch.equal(rollout.latents, direct.latents)
    with torch.no_grad():
        again = policy.step_logprobs(
            rollout.latents[:, :-1], rollout.latents[:, 1:], rollout.timesteps, rollout.labels
        )
    torch.testing.assert_close(again, rollout.logprobs, rtol=0, atol=1e-5)


def test_rollout_function_seeds_and_failures() -> None:
    policy = _policy()
    fn = DiffusionSample()

    async def two() -> Any:
        return await asyncio.gather(
            fn({"label": 1}, group_size=2, engine=policy, reward=ImageBrightness()),
            fn({"label": 1}, group_size=2, engine=policy, reward=ImageBrightness()),
        )

    a, b = asyncio.run(two())
    # Records without a seed get distinct seeds from the function's counter.
    assert {a.samples[0].metadata["seed"], b.samples[0].metadata["seed"]} == {0, 1}

    def broken(sample: Sample, prompt: Any) -> float:
        raise RuntimeError("scorer down")

    g = asyncio.run(fn({"label": 0}, group_size=2, engine=policy, reward=broken))
    assert all(s.failed and "scorer down" in s.metadata["reward_error"] for s in g.samples)
    with pytest.raises(ValueError, match="failed or unscored"):
        rollout_from_groups([g])
    with pytest.raises(ValueError, match="has no 'label' field"):
        asyncio.run(fn({"prompt": "x"}, group_size=2, engine=policy, reward=ImageBrightness()))
    with pytest.raises(TypeError, match="DiffusionPolicy"):
        asyncio.run(fn({"label": 0}, group_size=2, engine=object(), reward=ImageBrightness()))
