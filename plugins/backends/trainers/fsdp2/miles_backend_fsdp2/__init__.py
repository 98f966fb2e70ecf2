"""Miles FSDP2 trainer backend: Hugging Face causal LMs sharded with ``fully_shard``.

Importing the package imports no torch; the trainer is built through
``miles_backend_fsdp2.trainer:build`` when a run selects the ``fsdp2`` backend.
"""

from miles_backend_fsdp2.options import FSDP2Options

__all__ = ["FSDP2Options"]
