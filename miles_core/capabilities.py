"""The vocabulary of compatibility: capability names, and what one part needs of another.

A component record (:mod:`miles_core.components`) *offers* a set of capability names (what its
part serves, computes or takes) and *demands* capabilities of the other parts a run selects,
each demand a :class:`Need`. The run config's features (``rollout.routing``,
``rollout.true_on_policy``, an adapter, a teacher...) add needs of their own. One checker
(:mod:`miles_core.config.compatibility`) walks the selected parts and reports every unmet need,
so a new feature or a new capability is a declaration, not a new rule in the core.

Capability names are open: a plugin may offer and demand names of its own. The tables below
document the names the core and its plugins use.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: What an engine can do beyond generation and SGLang's control calls, each named for the HTTP
#: endpoint(s) that provide it: the core's documented names. An engine record lists those it
#: serves (``capabilities``); a transport or adapter lists those it needs. A plugin may add names
#: of its own: a need that no installed record offers is refused naming who could serve it.
ENGINE_CAPABILITIES: dict[str, str] = {
    "update_weights_from_tensor": "SGLang's POST /update_weights_from_tensor (colocated handles)",
    "update_weights_from_distributed": (
        "SGLang's POST /init_weights_update_group and /update_weights_from_distributed"
    ),
    "p2p_weights": "a NIXL receiver the trainer writes into (not an SGLang endpoint)",
    "memory_occupation": "SGLang's POST /release_memory_occupation and /resume_memory_occupation",
    "input_logprobs": (
        "SGLang's prompt log-probs on POST /generate (return_logprob with logprob_start_len, "
        "max_new_tokens 0): a teacher's engine scores tokens it did not generate"
    ),
    "lora": (
        "SGLang's LoRA API: POST /load_lora_adapter, /unload_lora_adapter, "
        "/load_lora_adapter_from_tensors and lora_path on /generate"
    ),
    "routed_experts": (
        "SGLang's return_routed_experts on POST /generate: the experts an MoE model routed every "
        "forwarded position to (meta_info['routed_experts'])"
    ),
    "true_on_policy": (
        "started with true_on_policy=True by a run's rollout.true_on_policy, its log-probs are "
        "bitwise those a trainer backend in the same mode recomputes (miles_core.invariant)"
    ),
    "weights_from_peer": (
        "GET /miles/weights and POST /miles/pull_weights: an engine copies the weights another "
        "engine serves (a joining engine takes the current ones at once; not an SGLang feature)"
    ),
    "lora_weight_updates": (
        "POST /miles/update_lora_from_distributed, and lora_name on /miles/p2p_weights: a "
        "broadcast or p2p update committed into that adapter (not an SGLang feature)"
    ),
}

#: Inputs an algorithm may ask the loop for, beyond rollout log-probs and rewards.
ALGORITHM_NEEDS = ("ref_logprobs", "teacher_logprobs", "values", "old_logprobs")

#: The inputs of :data:`ALGORITHM_NEEDS` that come with the samples rather than from the trainer
#: backend: a teacher's log-probs are scored by the teacher's engine (the run config's
#: ``teacher``) while the groups are generated, and every backend packs them like the engine's.
FROM_SAMPLES = frozenset({"teacher_logprobs"})

#: The capability names the core derives from the records' typed fields, besides the engines'
#: (:data:`ENGINE_CAPABILITIES`) and the inputs of :data:`ALGORITHM_NEEDS` a backend computes.
DERIVED_CAPABILITIES: dict[str, str] = {
    "routing": "a trainer backend that takes the engine's MoE routing record",
    "true_on_policy": "a trainer backend with a batch-invariant forward",
    "multi_adapter": "a trainer backend that trains several adapters on one base",
    "adapter:<name>": "a trainer backend that composes with adapter <name>",
    "adapter_publish": "a transport that publishes an adapter alone",
    "on_policy": "a schedule whose trained tokens all come from the current weights",
    "critic_free": "an algorithm that trains no critic (needs no values)",
}

#: The selected parts a :class:`Need` may be addressed to: the config field that selects each.
ROLES: dict[str, str] = {
    "backend": "backend.name",
    "engine": "engine.name",
    "transport": "transport.name",
    "algorithm": "algorithm.name",
    "adapter": "adapter.name",
    "schedule": "run.mode",
    "teacher.engine": "teacher.engine.name (default: engine.name)",
}

#: The run config's features a :class:`Need` may be conditional on (``when``).
FEATURES: dict[str, str] = {
    "adapter": "the run trains an adapter (adapter, adapters)",
    "adapters": "the run trains several adapters at once (adapters)",
    "routing": "rollout.routing other than 'none'",
    "true_on_policy": "rollout.true_on_policy",
    "teacher": "a teacher section",
}


@dataclass(frozen=True)
class Need:
    """Capabilities one selected part requires of another.

    Attributes:
        role: the part that must offer them (a key of :data:`ROLES`).
        capabilities: the names it must offer (all of them).
        when: a key of :data:`FEATURES`; the need holds only while the run uses that feature
            (empty: always, as long as the declaring part is selected).
        at: the config field a refusal is reported at (empty: none).
        says: how a refusal reads, a ``str.format`` template over ``by`` (who needs),
            ``who`` (the part that lacks), ``missing`` (the list), ``missing_names`` (comma
            separated), ``has`` (what the part offers of ``among``) and ``value`` (the
            feature's value). Empty: "<by> needs the <role> capabilities <missing>, which
            <who> does not serve (it serves: <has>)".
        able: the heading of the list of installed parts that would fit (default:
            "<role>s that do").
        among: the names ``has`` shows (empty: every name the part offers).
    """

    role: str
    capabilities: frozenset[str]
    when: str = ""
    at: str = ""
    says: str = ""
    able: str = ""
    among: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(
                f"a need is addressed to unknown role {self.role!r}; allowed: {', '.join(ROLES)}"
            )
        if self.when and self.when not in FEATURES:
            raise ValueError(
                f"a need is conditional on unknown feature {self.when!r}; "
                f"allowed: {', '.join(FEATURES)}"
            )
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))


def check_names(who: str, names: Iterable[str]) -> None:
    """Refuse capability names that are not names: one a plugin offers or needs must be a
    non-empty string without spaces (an unknown name is allowed)."""
    bad = sorted(repr(n) for n in names if not isinstance(n, str) or not n or " " in n)
    if bad:
        raise ValueError(
            f"{who} names invalid capabilities {', '.join(bad)}: a capability is a non-empty "
            f"string without spaces, such as {', '.join(list(ENGINE_CAPABILITIES)[:3])}"
        )
