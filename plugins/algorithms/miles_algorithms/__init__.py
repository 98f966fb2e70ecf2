"""Miles RL algorithms: advantage estimators and per-token losses as pure tensor functions.

Registered through the entry point ``algorithms`` (:mod:`miles_algorithms.plugin`); importing
the package imports no torch.
"""

__version__ = "0.1.0"
