"""The diffusion engine end to end: a real server process started by the registered launcher,
sampling bitwise like the policy; weights pushed by each registered transport; refusals, pause,
memory release."""

from __future__ import annotations

import asyncio
import base64
import pickle
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from miles_diffusion.client import DiffusionEngineClient, ImageGeneration
from miles_diffusion.engine import DiffusionEngineConfig, DiffusionLauncher, build
from miles_diffusion.policy import DiffusionPolicy, DiffusionRollout, from_pretrained
from miles_diffusion.testing import tiny_options, write_tiny_model
from miles_engine_client import EngineHTTPError

from miles_core import Kind
from miles_core.plugins import load_plugins

# The server runs one torch thread; the same thread count here makes the comparisons bitwise.
torch.set_num_threads(1)

T = TypeVar("T")
STEPS = {"num_inference_steps": 4}  # tiny_options()'s sampler


def run(url: str, fn: Callable[[DiffusionEngineClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with DiffusionEngineClient(url, timeout_s=120) as c:
            return await fn(c)

    return asyncio.run(main())


def generate(url: str, label: int, n: int, seed: int, **sp: Any) -> ImageGeneration:
    params = {"n": n, "seed": seed, **STEPS, **sp}
    return run(url, lambda c: c.generate([label], params))


def same(got: ImageGeneration, want: DiffusionRollout) -> bool:
    return (
        torch.equal(got.latents, want.latents)
        and torch.equal(got.step_logprobs, want.logprobs)
        and got.timesteps == want.timesteps.tolist()
    )


def named(policy: DiffusionPolicy) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.clone()) for n, t in policy.export_weights()]


def blob(items: list[tuple[str, torch.Tensor]]) -> str:
    return base64.b64encode(pickle.dumps(items)).decode()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-diffusion"))


@pytest.fixture(scope="module")
def base(model_dir: Path) -> DiffusionPolicy:
    """The policy over the served folder's weights."""
    return from_pretrained(str(model_dir), tiny_options())


@pytest.fixture(scope="module")
def other() -> DiffusionPolicy:
    """A policy of the same shapes with other weights (what a trainer would push)."""
    return DiffusionPolicy(tiny_options(init_seed=7))


@pytest.fixture(scope="module")
def launcher() -> Iterator[DiffusionLauncher]:
    record = load_plugins().registry.get(Kind.ROLLOUT_ENGINE, "diffusion")
    launcher = record.build(record.config(startup_timeout_s=120, dist_timeout=30))
    assert isinstance(launcher, DiffusionLauncher)
    yield launcher
    launcher.shutdown()


@pytest.fixture(scope="module")
def server(launcher: DiffusionLauncher, model_dir: Path) -> str:
    return launcher.launch(str(model_dir), index=0)


@pytest.fixture
def restore(server: str, base: DiffusionPolicy) -> Iterator[None]:
    """Put the served folder's weights and version "0" back after the test."""
    yield
    run(server, lambda c: c.update_weights_from_tensor([blob(named(base))], weight_version="0"))
    run(server, lambda c: c.continue_generation())
    run(server, lambda c: c.resume_memory_occupation())


def test_generate_is_the_policy_sample_bitwise(
    server: str, model_dir: Path, base: DiffusionPolicy
) -> None:
    got = generate(server, 2, 3, 11)
    assert got.latents.shape == (3, 5, 1, 8, 8) and got.step_logprobs.shape == (3, 4)
    assert same(got, base.sample([2] * 3, 11))
    assert got.weight_version == "0" and got.finish_reason == "stop"
    # other sampler settings: guidance, float64, summed log-probs (a policy each, one UNet)
    sp = {"guidance_scale": 2.0, "dtype": "float64", "logprob_reduction": "sum", "eta": 0.5}
    got64 = generate(server, 1, 2, 3, **sp)
    want64 = from_pretrained(str(model_dir), tiny_options(**sp)).sample([1, 1], 3)
    assert got64.latents.dtype == torch.float64 and same(got64, want64)
    # a seed drawn by the server is reported, and reproduces the batch
    drawn = run(server, lambda c: c.generate([0], {"n": 2, **STEPS}))
    assert drawn.seed is not None and same(drawn, base.sample([0, 0], drawn.seed))


def test_info_and_health(server: str, model_dir: Path) -> None:
    async def go(c: DiffusionEngineClient) -> Any:
        return (
            await c.get_model_info(),
            await c.get_server_info(),
            await c.health(),
            await c.health_generate(),
            await c.get_weight_version(),
        )

    info, sinfo, healthy, healthy_gen, version = run(server, go)
    assert info["model_path"] == str(model_dir) and info["is_generation"] is True
    assert info["weight_version"] == "0" == version
    assert (info["sample_size"], info["channels"], info["num_classes"]) == (8, 1, 4)
    assert sinfo["max_running_requests"] == 16 and sinfo["weight_version"] == "0"
    assert healthy and healthy_gen


@pytest.mark.parametrize(
    ("label", "params", "names"),
    [
        (4, {}, "label 4"),
        (-1, {}, "input_ids"),
        (0, {"n": 0}, "n"),
        (0, {"eta": 0.0}, "eta"),
        (0, {"logprob_reduction": "max"}, "logprob_reduction"),
        (0, {"dtype": "bfloat16"}, "dtype"),
        (0, {"num_inference_steps": 2000}, "num_inference_steps"),
        (0, {"timestep_spacing": "leading"}, "zero variance"),
        (0, {"temperature": 1.0}, "unknown sampling_params ['temperature']; allowed: n, seed"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: str, label: int, params: dict[str, Any], names: str
) -> None:
    async def go(c: DiffusionEngineClient) -> EngineHTTPError:
        with pytest.raises(EngineHTTPError) as err:
            await c.generate([label], {**STEPS, **params})
        return err.value

    err = run(server, go)
    assert err.status == 400 and names in err.message, err.message


def test_two_labels_are_refused(server: str) -> None:
    async def go(c: DiffusionEngineClient) -> EngineHTTPError:
        with pytest.raises(EngineHTTPError) as err:
            await c.generate([0, 1], STEPS)
        return err.value

    err = run(server, go)
    assert err.status == 400 and "exactly one class label" in err.message


@pytest.mark.parametrize("transport", ["colocated", "broadcast", "p2p"])
def test_transport_pushes_a_policy_into_the_engine(
    server: str, base: DiffusionPolicy, other: DiffusionPolicy, transport: str, restore: None
) -> None:
    """Each registered transport, built from its record as a run builds it, publishes the
    weights of another policy; the engine then samples exactly as that policy, with its
    version. A second update brings the first weights back."""
    registry = load_plugins().registry
    record = registry.get(Kind.TRANSPORT, transport)
    assert record.engine_capabilities <= registry.get(Kind.ROLLOUT_ENGINE, "diffusion").capabilities
    sender = record.build(record.config(bucket_size_mb=0.05, timeout_s=60))
    try:
        sender.send(named(other), version=41, engines=[server])
        moved = generate(server, 3, 2, 5)
        sender.send(named(base), version=42, engines=[server])
        back = generate(server, 3, 2, 5)
    finally:
        sender.close()
    assert moved.weight_version == "41" and same(moved, other.sample([3, 3], 5))
    assert back.weight_version == "42" and same(back, base.sample([3, 3], 5))


def test_refused_updates_change_nothing(
    server: str, base: DiffusionPolicy, other: DiffusionPolicy, tmp_path: Path
) -> None:
    from miles_transport_colocated.config import ColocatedOptions
    from miles_transport_colocated.sender import ColocatedSender
    from miles_transport_common.errors import TransportError

    good = named(other)
    wrong_shape = [(n, torch.zeros(3) if i == 0 else t) for i, (n, t) in enumerate(good)]
    unknown = [*good, ("unet.no_such.weight", torch.zeros(2))]
    write_tiny_model(tmp_path / "narrow", tiny_options(num_classes=2))

    async def go(c: DiffusionEngineClient) -> list[EngineHTTPError]:
        errors = []
        for body in (wrong_shape, unknown):
            with pytest.raises(EngineHTTPError) as err:
                await c.update_weights_from_tensor([blob(body)], weight_version="bad")
            errors.append(err.value)
        names = [n for n, _ in good]
        with pytest.raises(EngineHTTPError) as err:
            await c.update_weights_from_distributed(
                names, ["float32"] * len(names), [[1]] * len(names), weight_version="bad"
            )
        errors.append(err.value)
        with pytest.raises(EngineHTTPError) as err:
            await c.update_weights_from_disk(str(tmp_path / "narrow"), weight_version="bad")
        errors.append(err.value)
        return errors

    errors = run(server, go)
    assert [e.status for e in errors] == [400] * 4
    assert "shape" in errors[0].message and "no_such" in errors[1].message
    assert "shape" in errors[2].message and "num_classes=2" in errors[3].message
    sender = ColocatedSender(ColocatedOptions(bucket_size_mb=0.05, timeout_s=60))
    try:
        with pytest.raises(TransportError, match="shape"):
            sender.send(wrong_shape, version=99, engines=[server])
    finally:
        sender.close()
    after = generate(server, 1, 2, 9)
    assert after.weight_version == "0" and same(after, base.sample([1, 1], 9))


def test_update_from_disk(
    server: str, tmp_path: Path, other: DiffusionPolicy, restore: None
) -> None:
    folder = write_tiny_model(tmp_path / "v7", tiny_options(init_seed=7))
    run(server, lambda c: c.update_weights_from_disk(str(folder), weight_version="disk"))
    got = generate(server, 0, 2, 1)
    assert got.weight_version == "disk" and same(got, other.sample([0, 0], 1))
    info = run(server, lambda c: c.get_model_info())
    assert info["model_path"] == str(folder)


def test_pause_holds_new_batches_and_updates_still_land(
    server: str, other: DiffusionPolicy, restore: None
) -> None:
    async def go(c: DiffusionEngineClient) -> tuple[bool, ImageGeneration]:
        await c.pause_generation()
        task = asyncio.create_task(c.generate([1], {"n": 2, "seed": 4, **STEPS}))
        await asyncio.sleep(1.0)
        waiting = not task.done()
        await c.update_weights_from_tensor([blob(named(other))], weight_version="p1")
        await c.continue_generation()
        return waiting, await asyncio.wait_for(task, 60)

    waiting, got = run(server, go)
    assert waiting
    assert got.weight_version == "p1" and same(got, other.sample([1, 1], 4))


def test_release_and_resume_memory_then_an_update_restores_sampling(
    server: str, other: DiffusionPolicy, restore: None
) -> None:
    async def go(c: DiffusionEngineClient) -> tuple[bool, bool, ImageGeneration]:
        await c.release_memory_occupation()
        task = asyncio.create_task(c.generate([2], {"n": 1, "seed": 8, **STEPS}))
        await asyncio.sleep(1.0)
        waiting = not task.done()
        released = (await c.get_server_info())["internal_states"][0]["memory_released"]
        await c.resume_memory_occupation()
        await c.update_weights_from_tensor([blob(named(other))], weight_version="r1")
        # the held request ran on resume, before or after the update; a new one sees it
        await asyncio.wait_for(task, 60)
        return (
            waiting,
            released == ["kv_cache", "weights"],
            await c.generate([2], {"n": 1, "seed": 8, **STEPS}),
        )

    waiting, released, got = run(server, go)
    assert waiting and released
    assert got.weight_version == "r1" and same(got, other.sample([2], 8))


def test_factory_refuses_true_on_policy() -> None:
    with pytest.raises(ValueError, match="true_on_policy"):
        build(DiffusionEngineConfig(), true_on_policy=True)
    with pytest.raises(ValueError, match="extra"):
        DiffusionEngineConfig.model_validate({"device": "cuda"})


def test_engine_record_passes_the_contract() -> None:
    from miles_core.testing.contracts import check_component

    record = load_plugins().registry.get(Kind.ROLLOUT_ENGINE, "diffusion")
    assert record.requires == {"modality": ("diffusion",)}
    assert record.capabilities == {
        "update_weights_from_tensor",
        "update_weights_from_distributed",
        "p2p_weights",
        "memory_occupation",
    }
    launcher = check_component(record)
    assert isinstance(launcher, DiffusionLauncher) and launcher.num_engines == 1
    cmd = launcher.command("/m", 1234)
    assert cmd[1:3] == ["-m", "miles_diffusion.server"] and "--num-threads" in cmd
