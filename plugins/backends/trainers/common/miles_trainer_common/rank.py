"""What every trainer backend's rank does the same way: seeding, the algorithm's needs, the
optimizer and the placement of its state, sleep/wake."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from miles_core.components import FROM_SAMPLES
from miles_core.contracts import AlgorithmImpl


def seed_everything(seed: int) -> None:
    """Seed ``random``, torch and numpy."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy ships with torch in practice
        pass


def check_needs(
    algorithm: AlgorithmImpl, supported: frozenset[str], backend: str
) -> frozenset[str]:
    """The algorithm's ``needs``; raises, naming the backend, for inputs it cannot compute
    (those that come with the samples, such as a teacher's log-probs, it need not)."""
    needs = frozenset(getattr(algorithm, "needs", frozenset()))
    missing = needs - supported - FROM_SAMPLES
    if missing:
        raise ValueError(
            f"the {backend} backend cannot compute {', '.join(sorted(missing))} for this "
            "algorithm; it computes: " + ", ".join(sorted(supported))
        )
    return needs


def check_algorithm(
    algorithm: AlgorithmImpl, supported: frozenset[str], backend: str, n_adapters: int
) -> frozenset[str]:
    """The algorithm's needs (:func:`check_needs`); raises also for a critic (``values``:
    PPO) with more than one adapter: each adapter is a policy, and one critic cannot serve
    several."""
    needs = check_needs(algorithm, supported, backend)
    if "values" in needs and n_adapters > 1:
        raise ValueError(
            f"the {backend} backend trains {n_adapters} adapters here, and this algorithm needs "
            "a critic's values: one critic cannot serve several policies (each adapter is "
            "one); train one adapter per run with it, or pick an algorithm without a critic "
            "(grpo, gspo, reinforce++)"
        )
    return needs


def empty_adamw(options: Any, lr: float | None = None) -> torch.optim.Optimizer:
    """AdamW over no parameter (one empty group), with the options' settings: the optimizer of
    a rank that holds nothing of what it trains (a pipeline stage none of an adapter's targets
    fall on), so that its LR schedule steps in step with the other ranks'."""
    return torch.optim.AdamW(
        [{"params": []}],
        lr=options.lr if lr is None else lr,
        betas=options.betas,
        eps=options.eps,
        weight_decay=options.weight_decay,
    )


def adamw(
    params: Iterable[nn.Parameter], options: Any, lr: float | None = None
) -> torch.optim.Optimizer:
    """AdamW over the trainable ``params`` with the options' lr (``lr`` when given), betas,
    eps, weight decay."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=options.lr if lr is None else lr,
        betas=options.betas,
        eps=options.eps,
        weight_decay=options.weight_decay,
    )


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move the optimizer's tensors to ``device`` (AdamW's step counter stays on the CPU
    unless capturable: it is left where it is)."""
    for state in optimizer.state.values():
        for key, value in list(state.items()):
            if isinstance(value, Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def sleep(
    optimizers: list[torch.optim.Optimizer | None],
    models: list[nn.Module | None],
    device: torch.device,
) -> None:
    """Free the gradients; on a GPU move the models and the optimizers' state to the CPU
    (``None`` entries: a model or optimizer not built)."""
    for optimizer in optimizers:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        cpu = torch.device("cpu")
        for model in models:
            if model is not None:
                model.to(cpu)
        for optimizer in optimizers:
            if optimizer is not None:
                move_optimizer_state(optimizer, cpu)
        torch.cuda.synchronize(device)
        # cuBLAS keeps its workspaces (tens of MiB per stream on Hopper) in the caching
        # allocator after the first matmul: a colocated engine wants them back too.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        gc.collect()
        torch.cuda.empty_cache()
    else:
        gc.collect()


def wake(
    optimizers: list[torch.optim.Optimizer | None],
    models: list[nn.Module | None],
    device: torch.device,
) -> None:
    """Undo :func:`sleep`."""
    if device.type == "cuda":
        for model in models:
            if model is not None:
                model.to(device)
        for optimizer in optimizers:
            if optimizer is not None:
                move_optimizer_state(optimizer, device)
        torch.cuda.synchronize(device)
