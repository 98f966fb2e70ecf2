"""The Ray placement's options, its bundle layout and when it takes a run — no cluster needed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from miles_ray.layout import plan
from miles_ray.options import RayOptions
from miles_ray.placement import RayPlacedLauncher
from miles_ray.plugin import miles_place

from miles_core.errors import ConfigError, MilesUserError


def test_options_default_when_unset() -> None:
    options = RayOptions.from_env({})
    assert options.address is None and options.trainer_cpus == 1.0 and options.strategy is None
    assert options.nodes == 1
    assert RayOptions.from_env({"MILES_RAY": "  "}) == options


def test_options_read_yaml_from_the_environment() -> None:
    options = RayOptions.from_env(
        {"MILES_RAY": "{address: auto, trainer_cpus: 2, trainer_gpus: 0.5, strategy: SPREAD}"}
    )
    assert (options.address, options.trainer_cpus, options.trainer_gpus, options.strategy) == (
        "auto",
        2.0,
        0.5,
        "SPREAD",
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{trainer_cpus: -1}", "MILES_RAY.trainer_cpus: Input should be greater than or equal"),
        ("{strategy: RANDOM}", "MILES_RAY.strategy: Input should be 'PACK', 'SPREAD'"),
        (
            "{trainer_cpu: 1}",
            "MILES_RAY.trainer_cpu: unknown key 'trainer_cpu'; allowed: address, node_address, "
            "num_cpus",
        ),
        ("{ready_timeout_s: 0}", "MILES_RAY.ready_timeout_s: Input should be greater than 0"),
        ("[1, 2]", "expected a mapping of options, got list"),
        ("{a: [", "not valid YAML"),
    ],
)
def test_bad_options_name_the_field(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        RayOptions.from_env({"MILES_RAY": text})
    assert expected in str(err.value)
    assert "invalid config MILES_RAY" in str(err.value)


def test_colocated_layout_shares_one_bundle() -> None:
    layout = plan("colocated", {"CPU": 1, "GPU": 0.5}, {"CPU": 2, "GPU": 0.25}, 2)
    assert layout.bundles == [{"CPU": 5.0, "GPU": 1.0}]
    assert layout.trainer_bundle == 0 and layout.engine_bundles == [0, 0]


def test_disaggregated_layout_gives_each_a_bundle() -> None:
    layout = plan("disaggregated", {"CPU": 2, "GPU": 1}, {"CPU": 1, "GPU": 0}, 3)
    assert layout.bundles == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert layout.trainer_bundle == 0 and layout.engine_bundles == [1, 2, 3]
    assert layout.feeders == [0, 0, 0] and layout.strategy == "PACK"


def test_disaggregated_layout_gives_each_rank_a_bundle() -> None:
    layout = plan(
        "disaggregated", {"CPU": 1}, {"CPU": 1}, 2, world_size=2, strategy="STRICT_SPREAD"
    )
    assert layout.bundles == [{"CPU": 1.0}] * 4
    assert layout.rank_bundles == [0, 1] and layout.engine_bundles == [2, 3]
    assert layout.feeders == [0, 0]  # rank 0 feeds every engine
    assert layout.strategy == "STRICT_SPREAD"


def test_colocated_layout_over_nodes_feeds_each_engine_from_its_node() -> None:
    layout = plan("colocated", {"CPU": 1}, {"CPU": 1}, 4, world_size=4, nodes=2)
    # one bundle a node: two ranks and two engines in each
    assert layout.bundles == [{"CPU": 4.0}, {"CPU": 4.0}]
    assert layout.rank_bundles == [0, 0, 1, 1] and layout.engine_bundles == [0, 0, 1, 1]
    assert layout.feeders == [0, 0, 2, 2]  # the first rank of each engine's node
    assert layout.strategy == "STRICT_SPREAD"  # a bundle a node


def test_colocated_layout_refuses_an_uneven_split() -> None:
    with pytest.raises(MilesUserError, match=r"MILES_RAY.nodes=2.*multiples of 2"):
        plan("colocated", {"CPU": 1}, {"CPU": 1}, 3, world_size=2, nodes=2)


@pytest.mark.parametrize(
    ("placement", "trainer", "engine", "expected"),
    [
        ("colocated", {"CPU": 0}, {"CPU": 0}, "shared bundle would be empty"),
        ("disaggregated", {"CPU": 0, "GPU": 0}, {"CPU": 1}, "MILES_RAY.trainer_cpus"),
        ("disaggregated", {"CPU": 1}, {"GPU": 0}, "ray_num_cpus / ray_num_gpus"),
    ],
)
def test_empty_bundles_are_refused(
    placement: str, trainer: dict[str, float], engine: dict[str, float], expected: str
) -> None:
    with pytest.raises(MilesUserError, match=expected):
        plan(placement, trainer, engine, 1)


def _config(placement: str) -> Any:
    return SimpleNamespace(
        run=SimpleNamespace(placement=placement, name="t"),
        engine=SimpleNamespace(name="embedded", options=SimpleNamespace(num_engines=1)),
    )


def test_a_colocated_run_with_local_engines_stays_in_this_process() -> None:
    from miles_engine_embedded.launcher import EmbeddedLauncher
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = EmbeddedLauncher(EmbeddedEngineConfig())
    assert not isinstance(launcher, RayPlacedLauncher)
    assert miles_place(config=_config("colocated"), launcher=launcher) is None


def test_a_disaggregated_run_with_local_engines_is_refused() -> None:
    from miles_engine_embedded.launcher import EmbeddedLauncher
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = EmbeddedLauncher(EmbeddedEngineConfig())
    with pytest.raises(MilesUserError, match="launch_in: ray_actor"):
        miles_place(config=_config("disaggregated"), launcher=launcher)


def test_the_ray_engine_launcher_can_be_placed() -> None:
    from miles_engine_embedded.launcher import build
    from miles_engine_embedded.plugin import EmbeddedEngineConfig

    launcher = build(EmbeddedEngineConfig(launch_in="ray_actor", ray_num_cpus=2, ray_num_gpus=1))
    assert isinstance(launcher, RayPlacedLauncher)
    assert launcher.engine_resources() == {"CPU": 2.0, "GPU": 1.0}


def test_the_plugin_loads_without_importing_ray() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from miles_core.plugins import load_plugins\n"
        "p = load_plugins(allow=['miles-ray'])\n"
        "hooks = sorted(p.pm.infos['ray'].hooks)\n"
        "assert hooks == ['miles_configure', 'miles_engines_to_add', 'miles_place', "
        "'miles_placement_record'], hooks\n"
        "print('ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_options_from_the_run_config_win_over_the_environment(tmp_path) -> None:
    import subprocess
    import sys

    from miles_core.config import PluginsSection

    class Config:
        plugins = PluginsSection(options={"ray": {"trainer_cpus": 3, "strategy": "SPREAD"}})

    got = RayOptions.from_config(Config(), {"MILES_RAY": "{trainer_cpus: 1}"})
    assert got.trainer_cpus == 3 and got.strategy == "SPREAD"

    class Empty:
        plugins = PluginsSection()

    assert RayOptions.from_config(Empty(), {"MILES_RAY": "{trainer_cpus: 1}"}).trainer_cpus == 1

    class Bad:
        plugins = PluginsSection(options={"ray": {"trainer_cpus": -2}})

    with pytest.raises(ConfigError) as err:
        RayOptions.from_config(Bad())
    assert "plugins.options.ray.trainer_cpus" in str(err.value)
    # through the CLI: refused before any work starts, exit 2, naming the field
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "run: {name: r, output_dir: " + str(tmp_path) + ", placement: disaggregated}\n"
        "model: {path: " + str(tmp_path) + "}\n"
        "backend: {name: fsdp2}\nengine: {name: embedded, launch_in: ray_actor}\n"
        "algorithm: {name: grpo}\ntransport: {name: broadcast}\n"
        "reward: {name: exact_match}\ndata: {name: jsonl, path: " + str(cfg) + "}\n"
        "plugins: {options: {ray: {strategy: RANDOM}}}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "miles_core.cli", "train", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "plugins.options.ray.strategy" in out.stderr


def test_an_engine_beyond_the_plan_joins_only_a_disaggregated_run() -> None:
    from miles_ray.placement import RayPlacement

    disaggregated = RayPlacement(plan("disaggregated", {"CPU": 1}, {"CPU": 2}, 2), RayOptions())
    # no bundle, no placement group: one engine's resources on whichever node has them
    assert disaggregated.engine_actor_options(2) == {
        "num_cpus": 2.0,
        "num_gpus": 0.0,
        "scheduling_strategy": "DEFAULT",
    }
    assert [disaggregated.feeder(i) for i in (0, 1, 2, 7)] == [0, 0, 0, 0]
    with pytest.raises(MilesUserError, match="engine index -1 is not allowed"):
        disaggregated.engine_actor_options(-1)
    colocated = RayPlacement(
        plan("colocated", {"CPU": 1}, {"CPU": 1}, 2, world_size=2, nodes=2), RayOptions()
    )
    assert colocated.feeder(1) == 1  # a planned engine keeps the first rank of its node
    with pytest.raises(MilesUserError, match=r"engine 2 cannot join a run.placement 'colocated'"):
        colocated.engine_actor_options(2)


def test_the_placement_timeout_is_an_option() -> None:
    assert RayOptions.from_env({}).placement_timeout_s == 60.0
    assert RayOptions.from_env({"MILES_RAY": "{placement_timeout_s: 5}"}).placement_timeout_s == 5
    with pytest.raises(
        ConfigError, match=r"MILES_RAY\.placement_timeout_s: Input should be greater"
    ):
        RayOptions.from_env({"MILES_RAY": "{placement_timeout_s: 0}"})


# --- engines for the nodes that join the cluster (join_new_nodes) ---------------------------


class Nodes:
    """A cluster's alive nodes, changed by the test."""

    def __init__(self, **nodes: dict[str, float]) -> None:
        self.alive = dict(nodes)

    def __call__(self) -> dict[str, dict[str, float]]:
        return dict(self.alive)


def test_a_node_that_joins_gets_as_many_engines_as_it_holds_once() -> None:
    from miles_ray.growth import NodeWatch

    nodes = Nodes(head={"CPU": 8.0}, a={"CPU": 2.0})
    watch = NodeWatch({"CPU": 2.0, "GPU": 0.0}, None, nodes).start()
    assert watch.engines_to_add(1) == 0  # the nodes there when the run was placed
    nodes.alive["b"] = {"CPU": 5.0, "memory": 1e9}
    assert watch.engines_to_add(1) == 2  # 5 CPUs hold two engines of 2
    assert watch.engines_to_add(3) == 0  # counted once
    nodes.alive["c"] = {"CPU": 1.0}
    nodes.alive["d"] = {"CPU": 4.0}
    assert watch.engines_to_add(3) == 2  # c is too small; d holds two
    del nodes.alive["d"]
    nodes.alive["d2"] = {"CPU": 2.0}  # a node back under a new id is new
    assert watch.engines_to_add(5) == 1


def test_the_job_grows_to_max_engines_at_most() -> None:
    from miles_ray.growth import NodeWatch

    nodes = Nodes(head={"CPU": 8.0})
    watch = NodeWatch({"GPU": 1.0}, 3, nodes).start()
    nodes.alive["gpu-node"] = {"CPU": 16.0, "GPU": 8.0}
    assert watch.engines_to_add(2) == 1  # 8 fit; the job has 2 of at most 3
    nodes.alive["gpu-node-2"] = {"GPU": 8.0}
    assert watch.engines_to_add(3) == 0


def test_an_engine_that_reserves_nothing_cannot_be_sized_by_a_node() -> None:
    from miles_ray.growth import NodeWatch

    with pytest.raises(MilesUserError, match="reserves no resource"):
        NodeWatch({"CPU": 0.0}, None, Nodes())


def test_join_new_nodes_is_refused_for_a_colocated_run() -> None:
    from miles_ray.plugin import miles_configure

    config = _config("colocated")
    config.plugins = SimpleNamespace(options={"ray": {"join_new_nodes": True}})
    with pytest.raises(ConfigError, match=r"join_new_nodes: a run\.placement 'colocated' run"):
        miles_configure(config=config)
    config.run.placement = "disaggregated"
    miles_configure(config=config)  # accepted
    config.plugins.options["ray"]["max_engines"] = 0
    with pytest.raises(ConfigError, match="max_engines"):
        miles_configure(config=config)
