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
    # [batch, tokens, in]: the leading axes are kept
    x3 = torch.randn(2, rows, 32, generator=gen)
    torch.testing.assert_close(plan.linear(x3, w, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


def test_plan_chooses_by_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """``transposed[i]`` holds from ``ROWS[i]`` up to the next measured count; the last one
    for every count above."""
    used: list[int] = []
    real = matmul._transposed

    def spy(x: Any, w: Any, b: Any, rows: int) -> Any:
        used.append(rows)
        return real(x, w, b, rows)

    monkeypatch.setattr(matmul, "_transposed", spy)
    choice = [r in (2, 16) for r in ROWS]  # transposed for 2..3 and 16..31 only
    plan = MatmulPlan(choice)
    w = torch.randn(8, 4)
    for rows in (1, 2, 3, 4, 15, 16, 31, 32, 500):
        plan.linear(torch.randn(rows, 4), w)
    assert used == [2, 3, 16, 31]
    assert plan.describe()["2"] == "transposed" and plan.describe()["4"] == "linear"
    with pytest.raises(ValueError, match="one choice per row count"):
        MatmulPlan([True])


def test_plan_for_refuses_an_unknown_choice() -> None:
    with pytest.raises(ValueError, match=r"matmul: 'fast'; allowed: auto, linear, transposed"):
        plan_for([torch.randn(4, 4)], "fast")
    with pytest.raises(ValueError, match="allowed: linear, transposed"):
        MatmulPlan.fixed("auto")


def test_auto_measures_once_per_process_and_skips_small_models(
    monkeypatch: pytest.MonkeyPatch,
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
    first = plan_for(small)
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
