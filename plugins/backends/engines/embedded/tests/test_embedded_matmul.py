"""The two layouts of a linear layer's product (``matmul``): same results, the plan's
choice per row count, the measured plan, and the server that serves with it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from miles_engine_embedded import matmul
from miles_engine_embedded.matmul import ROWS, MatmulPlan, plan_for


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_transposed_equals_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    x = torch.randn(rows, 32, generator=gen)
    plan = MatmulPlan.fixed("transposed")
    got = plan.linear(x, w, b)
    assert got.shape == (rows, 48) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # the result as the product left it (no copy into rows-first order): the same values
    loose = plan.strided(x, w, b)
    assert loose.shape == (rows, 48) and (rows == 1 or not loose.is_contiguous())
    torch.testing.assert_close(loose, got, rtol=0, atol=0)
    # padded with zero rows (either layout): the same rows back
    for layout in (False, True):
        padded = MatmulPlan([layout] * len(ROWS), [max(r, min(rows + 3, 64)) for r in ROWS])
        torch.testing.assert_close(padded.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # [batch, tokens, in]: the leading axes are kept
    x3 = torch.randn(2, rows, 32, generator=gen)
    torch.testing.assert_close(plan.linear(x3, w, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


def test_plan_chooses_by_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """``transposed[i]`` holds from ``ROWS[i]`` up to the next measured count, the last one
    for every count above; ``pad_to[i]`` only at exactly ``ROWS[i]`` rows."""
    used: list[tuple[int, int | None]] = []
    real = matmul._transposed

    def spy(x: Any, w: Any, b: Any, rows: int, pad: int | None = None, *rest: Any) -> Any:
        used.append((rows, pad))
        return real(x, w, b, rows, pad, *rest)

    monkeypatch.setattr(matmul, "_transposed", spy)
    choice = [r in (2, 3, 16) for r in ROWS]  # transposed for 2..3 and 16..31 only
    pad = [16 if r == 3 else 12 if r == 10 else r for r in ROWS]
    plan = MatmulPlan(choice, pad)
    w = torch.randn(8, 4)
    for rows in (1, 2, 3, 4, 10, 15, 16, 31, 32, 500):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(plan.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert used == [(2, 2), (3, 16), (16, 16), (31, 31)]
    described = plan.describe()
    assert described["2"] == "transposed" and described["4"] == "linear"
    assert described["3"] == "transposed, 16 rows" and described["10"] == "linear, 12 rows"
    with pytest.raises(ValueError, match="one choice per row count"):
        MatmulPlan([True])
    with pytest.raises(ValueError, match="none below it"):
        MatmulPlan(choice, [1] * len(ROWS))


def test_choose_pads_to_a_faster_count_and_needs_a_margin() -> None:
    """From measured times: a count on a slow path runs padded to a faster larger count in
    either layout; an alternative less than ``MARGIN`` faster than ``linear`` is not taken;
    above ``EXACT`` only the layout is chosen."""
    costs = {(r, t): float(r) for r in ROWS for t in (False, True)}  # even: linear everywhere
    costs[13, False], costs[13, True] = 30.0, 40.0  # 13 rows: slower than 16 in both layouts
    costs[16, True] = 13.0
    costs[15, False] = 14.0  # 16 rows transposed is not faster by the margin
    costs[5, True] = 5.0 / (matmul.MARGIN * 0.99)  # faster, but within the margin
    costs[7, False] = costs[7, True] = 9.0  # padded to 8 (linear, 8.0) wins by the margin
    costs[32, True] = 20.0
    plan = matmul.choose(costs)
    described = plan.describe()
    assert described["13"] == "transposed, 16 rows"
    assert described["7"] == "linear, 8 rows"
    assert described["5"] == "linear" and described["16"] == "transposed"
    assert described["32"] == "transposed" and described["64"] == "linear"
    assert all(described[str(r)] == "linear" for r in (1, 2, 3, 4, 6, 8, 12, 14, 15))


def test_true_on_policy_runs_the_models_own_forward(tiny_model: Any) -> None:
    """True on-policy mode runs the model's own forward (the trainer's, through the
    batch-invariant kernels): no lean forward, so no product leaves ``F.linear``."""
    from miles_engine_embedded.weights import ModelHolder

    kwargs: dict[str, Any] = {"device": "cpu", "dtype": "float32", "weight_version": "0"}
    plain = ModelHolder(str(tiny_model), matmul="transposed", **kwargs)
    assert plain.lean is not None and plain.lean.plan.any
    invariant = ModelHolder(str(tiny_model), matmul="transposed", invariant=True, **kwargs)
    assert invariant.lean is None


def test_plan_for_refuses_an_unknown_choice() -> None:
    with pytest.raises(ValueError, match=r"matmul: 'fast'; allowed: auto, linear, transposed"):
        plan_for([torch.randn(4, 4)], "fast")
    with pytest.raises(ValueError, match="allowed: linear, transposed"):
        MatmulPlan.fixed("auto")


def test_auto_measures_once_per_process_and_skips_small_models(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []
    real = matmul._measure

    def counted(weights: Any, repeats: int) -> MatmulPlan:
        calls.append(len(weights))
        return real(weights, 1)

    monkeypatch.setattr(matmul, "_measure", counted)
    monkeypatch.setattr(matmul, "_measured", {})
    small = [torch.randn(64, 32), torch.randn(32, 64)]
    assert plan_for(small).describe() == MatmulPlan.fixed("linear").describe()
    assert calls == []  # under MIN_BYTES: not measured
    monkeypatch.setattr(matmul, "MIN_BYTES", 0)
    with caplog.at_level("INFO", logger="miles_engine_embedded"):
        first = plan_for(small)
    assert "auto measured the product layouts in" in caplog.text  # the start's delay, said
    again = plan_for([w.clone() for w in small])  # same shapes, dtype and threads
    assert calls == [2] and again is first
    assert set(first.describe()) == {str(r) for r in ROWS}
    plan_for([torch.randn(64, 48)])  # other shapes: measured again
    assert calls == [2, 1]
    assert plan_for(small, "transposed").any and calls == [2, 1]  # fixed: never measured


def test_the_compute_thread_builds_and_runs_the_engine() -> None:
    """The server loads the model on the thread that then runs the scheduler (one OpenMP
    pool in the process), and a failure to build reaches the caller."""
    from miles_engine_embedded.server import start_compute_thread

    built_on: list[threading.Thread] = []
    ran_on: list[threading.Thread] = []

    class FakeEngine:
        def run(self, on_start: Any) -> None:
            ran_on.append(threading.current_thread())
            on_start()  # the caller gets the engine only now

    def build() -> Any:
        built_on.append(threading.current_thread())
        return FakeEngine()

    engine = start_compute_thread(build)
    assert isinstance(engine, FakeEngine)
    assert built_on == ran_on and built_on[0] is not threading.main_thread()

    def broken() -> Any:
        raise SystemExit("--lora-paths: no such folder")

    with pytest.raises(SystemExit, match="no such folder"):
        start_compute_thread(broken)
