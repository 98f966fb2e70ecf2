"""The diffusion modality for Miles: a diffusers UNet as the RL policy.

Importing this package imports neither torch nor diffusers; the policy, rollout function,
rewards and trainer live in their own modules (``policy``, ``rollout``, ``rewards``, ``grpo``).
"""

__version__ = "0.1.0"
