"""The digits: the data and its split, ``miles-diffusion pretrain-digits`` (a tiny budget), the
``digit_classifier`` reward on real digit images and the ``digit_prompts`` data source."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from miles_diffusion.classifier import (
    ClassifierFolderError,
    DigitClassifier,
    load_classifier,
    save_classifier,
)
from miles_diffusion.cli import main
from miles_diffusion.digits import NUM_IMAGES, load_digits, split_digits, split_indices
from miles_diffusion.model import ModelInfo, read_model_info
from miles_diffusion.options import DiffusionOptions, DigitClassifierOptions, DigitPromptsOptions
from miles_diffusion.policy import from_pretrained
from miles_diffusion.pretrain import PretrainSettings, pretrain_digits
from miles_diffusion.prompts import DigitPrompts
from miles_diffusion.rewards import DigitClassifierReward
from miles_diffusion.rollout import DiffusionSample
from pydantic import ValidationError

from miles_core import Kind
from miles_core.data import Sample
from miles_core.errors import MilesUserError
from miles_core.plugins import load_plugins
from miles_core.testing.contracts import check_component

torch.set_num_threads(1)

TINY = ("--steps", "20", "--block-out-channels", "16", "32", "--log-every", "10")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder from the command at a tiny UNet budget; the classifier gets 300 steps
    (a few seconds) so that it is a real digit classifier."""
    out = tmp_path_factory.mktemp("digits") / "model"
    assert main(["pretrain-digits", "--out", str(out), *TINY, "--classifier-steps", "300",
                 "--eval-per-digit", "2"]) == 0  # fmt: skip
    return out


def _image_sample(image01: torch.Tensor) -> Sample:
    return Sample(prompt_ids=[0], metadata={"image": image01})


def test_the_digits_are_scikit_learns() -> None:
    d = load_digits()
    assert d.images.shape == (NUM_IMAGES, 1, 8, 8) and d.images.dtype == torch.float32
    assert float(d.images.min()) == -1.0 and float(d.images.max()) == 1.0
    assert d.labels.bincount().tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert d.labels[:10].tolist() == list(range(10))
    # the first image of sklearn's load_digits(), row 0 (values 0..16)
    first = [0, 0, 5, 13, 9, 1, 0, 0]
    assert ((d.images[0, 0, 0] + 1) / 2 * 16).round().tolist() == first


def test_the_split_is_fixed_and_disjoint() -> None:
    train, held = split_indices()
    assert len(train) == 1438 and len(held) == 359
    assert set(train.tolist()).isdisjoint(held.tolist())
    assert sorted(train.tolist() + held.tolist()) == list(range(NUM_IMAGES))
    again = split_indices()
    assert torch.equal(train, again[0]) and torch.equal(held, again[1])
    assert not torch.equal(held, split_indices(seed=1)[1])
    tr, ho = split_digits()
    assert torch.equal(ho.images, load_digits().images[held]) and len(tr) == 1438
    assert set(ho.labels.tolist()) == set(range(10))


def test_tiny_pretrain_writes_a_loadable_model_folder(model_dir: Path) -> None:
    assert read_model_info(model_dir) == ModelInfo(
        sample_size=8, channels=1, num_classes=10, num_train_timesteps=1000, beta_schedule="linear"
    )
    summary = json.loads((model_dir / "pretrain.json").read_text())
    assert summary["steps"] == 20 and summary["classifier_steps"] == 300
    assert summary["classifier_held_out_accuracy"] > 0.95
    assert 0.0 <= summary["reward"]["mean"] <= 1.0 and len(summary["reward"]["per_digit"]) == 10
    assert summary["reward"]["num_inference_steps"] == 10 and summary["reward"]["eta"] == 1.0
    options = DiffusionOptions(
        sample_size=8, channels=1, num_classes=10, block_out_channels=(16, 32)
    )
    policy = from_pretrained(str(model_dir), options)
    assert policy.unet.config.num_class_embeds == 11
    rollout = policy.sample(list(range(10)), seed=0)
    assert rollout.images.shape == (10, 1, 8, 8) and rollout.logprobs.shape == (10, 10)
    classifier = load_classifier(model_dir / "classifier")
    assert isinstance(classifier, DigitClassifier) and not classifier.training
    config = json.loads((model_dir / "classifier" / "config.json").read_text())
    assert config["format"] == "miles-digit-classifier" and config["num_classes"] == 10


def test_pretraining_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    def run(name: str, seed: int) -> dict[str, torch.Tensor]:
        settings = PretrainSettings(
            steps=3, classifier_steps=3, block_out_channels=(16, 32), eval_per_digit=1, seed=seed
        )
        summary = pretrain_digits(tmp_path / name, settings, log=lambda m: None)
        assert summary["settings"]["seed"] == seed
        options = DiffusionOptions(
            sample_size=8, channels=1, num_classes=10, block_out_channels=(16, 32)
        )
        policy = from_pretrained(str(tmp_path / name), options)
        state = dict(policy.unet.state_dict())
        state.update(load_classifier(tmp_path / name / "classifier").state_dict())
        return state

    a, b, c = run("a", 0), run("b", 0), run("c", 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_the_command_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pretrain-digits", "--out", "x", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    assert main(["pretrain-digits", "--out", "x", "--block-out-channels", "12", "24"]) == 2
    assert "--block-out-channels" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["pretrain-digits"])  # --out is required


def test_the_reward_is_high_for_the_prompted_digit_and_low_for_another(model_dir: Path) -> None:
    reward = DigitClassifierReward(DigitClassifierOptions(path=str(model_dir / "classifier")))
    _, held = split_digits()
    own, other = [], []
    for i in range(0, 200, 2):  # 100 held-out images the classifier never saw
        image01 = (held.images[i] + 1) / 2
        label = int(held.labels[i])
        own.append(reward(_image_sample(image01), {"label": label}))
        other.append(reward(_image_sample(image01), {"label": (label + 3) % 10}))
    assert all(0.0 <= r <= 1.0 for r in own + other)
    assert sum(own) / len(own) > 0.9
    assert sum(other) / len(other) < 0.05
    # the label key is an option; the folder is loaded once
    keyed = DigitClassifierReward(
        DigitClassifierOptions(path=str(model_dir / "classifier"), label_key="digit")
    )
    image01 = (held.images[0] + 1) / 2
    assert keyed(_image_sample(image01), {"digit": int(held.labels[0])}) == pytest.approx(own[0])
    assert keyed.classifier() is keyed.classifier()


def test_reward_errors_are_clear(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="path"):
        DigitClassifierOptions.model_validate({})
    with pytest.raises(MilesUserError, match=r"digit_classifier: path '.*nowhere' is not a folder"):
        DigitClassifierReward(DigitClassifierOptions(path=str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MilesUserError, match=r"path .* has no config\.json or model\.safetensors"):
        DigitClassifierReward(DigitClassifierOptions(path=str(tmp_path / "empty")))
    broken = tmp_path / "broken"
    save_classifier(DigitClassifier(), broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    reward = DigitClassifierReward(DigitClassifierOptions(path=str(broken)))
    image = torch.zeros(1, 8, 8)
    for _ in range(2):  # the load error is raised again, not a later AttributeError
        with pytest.raises(MilesUserError, match=r"digit_classifier: path .*cannot load"):
            reward(_image_sample(image), {"label": 1})
    (broken / "config.json").write_text('{"format": "something-else"}')
    with pytest.raises(ClassifierFolderError, match="format is 'something-else'"):
        load_classifier(broken)
    good = DigitClassifierReward(DigitClassifierOptions(path=str(model_dir / "classifier")))
    with pytest.raises(ValueError, match=r"no 'label' field \(label_key\)"):
        good(_image_sample(image), {"prompt": "digit 1"})
    with pytest.raises(ValueError, match="label 10 is not a class"):
        good(_image_sample(image), {"label": 10})
    with pytest.raises(ValueError, match=r"takes \(1, 8, 8\)"):
        good(_image_sample(torch.zeros(3, 8, 8)), {"label": 1})
    with pytest.raises(ValueError, match=r"metadata\['image'\] is missing"):
        good(Sample(prompt_ids=[0]), {"label": 1})


def test_the_home_folder_is_expanded(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(model_dir))
    reward = DigitClassifierReward(DigitClassifierOptions(path="~/classifier"))
    assert reward.path == model_dir / "classifier"


def test_a_rollout_of_the_pretrained_model_scored_by_the_classifier(model_dir: Path) -> None:
    options = DiffusionOptions(
        sample_size=8, channels=1, num_classes=10, block_out_channels=(16, 32)
    )
    policy = from_pretrained(str(model_dir), options)
    reward = DigitClassifierReward(DigitClassifierOptions(path=str(model_dir / "classifier")))
    record = next(iter(DigitPrompts(DigitPromptsOptions(seed=7))))
    group = asyncio.run(DiffusionSample()(record, group_size=3, engine=policy, reward=reward))
    assert not group.failed
    assert all(s.metadata["seed"] == record["seed"] for s in group.samples)
    assert all(s.metadata["label"] == record["label"] for s in group.samples)
    assert all(0.0 <= float(s.reward or -1) <= 1.0 for s in group.samples)
    again = policy.sample([record["label"]] * 3, seed=record["seed"])
    assert torch.equal(again.images[0], group.samples[0].metadata["image"])


def _take(source: DigitPrompts, n: int) -> list[dict[str, Any]]:
    return list(itertools.islice(iter(source), n))


def test_digit_prompts_records_and_determinism() -> None:
    records = _take(DigitPrompts(DigitPromptsOptions(size=50)), 50)
    assert all(set(r) == {"prompt", "label", "seed"} for r in records)
    assert all(r["prompt"] == f"digit {r['label']}" for r in records)
    assert sorted(r["label"] for r in records) == sorted(list(range(10)) * 5)
    assert len({r["seed"] for r in records}) == 50
    assert all(isinstance(r["seed"], int) and 0 <= r["seed"] < 2**31 for r in records)
    assert records == _take(DigitPrompts(DigitPromptsOptions(size=50)), 50)
    held = _take(DigitPrompts(DigitPromptsOptions(size=50, seed=1)), 50)
    assert held != records and held == _take(DigitPrompts(DigitPromptsOptions(size=50, seed=1)), 50)
    # a new epoch is a new order and new noise
    two = _take(DigitPrompts(DigitPromptsOptions(size=50)), 100)
    assert two[:50] == records and two[50:] != records
    some = _take(DigitPrompts(DigitPromptsOptions(size=7, classes=(3, 5))), 7)
    assert sorted(r["label"] for r in some) == [3, 3, 3, 3, 5, 5, 5]
    assert len(list(DigitPrompts(DigitPromptsOptions(size=5, epochs=2)))) == 10
    with pytest.raises(ValidationError, match="repeat"):
        DigitPromptsOptions(classes=(1, 1))
    with pytest.raises(ValidationError, match="non-negative"):
        DigitPromptsOptions(classes=(-1,))


@pytest.mark.parametrize("stop", [3, 10, 12])  # inside an epoch, at its end, in the next
def test_digit_prompts_resume_the_exact_sequence(stop: int) -> None:
    whole = _take(DigitPrompts(DigitPromptsOptions(size=10)), 25)
    first = DigitPrompts(DigitPromptsOptions(size=10))
    assert _take(first, stop) == whole[:stop]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = DigitPrompts(DigitPromptsOptions(size=10))
    resumed.load_state_dict(state)
    assert _take(resumed, 25 - stop) == whole[stop:]
    assert resumed.skipped == 0


def test_digit_prompts_pass_the_core_contract() -> None:
    plugins = load_plugins(allow=["miles-diffusion"])
    source = check_component(plugins.registry.get(Kind.DATA_SOURCE, "digit_prompts"))
    assert isinstance(source, DigitPrompts)
    reward = plugins.registry.get(Kind.REWARD_FUNCTION, "digit_classifier")
    check_component(reward, build=False)
    assert reward.config is DigitClassifierOptions
