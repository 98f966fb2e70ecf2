"""Options of the LoRA adapter (torch-free, validated when a run selects ``adapter: lora``)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: The attention and MLP projections of the Llama family (Llama, Qwen, Mistral, SmolLM...).
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_SUFFIX = re.compile(r"^[A-Za-z0-9_.]+$")
#: an adapter's served name: peft's adapter name (a key of its ModuleDicts, so no '.') and a
#: folder name
SERVED_NAME = r"^[A-Za-z0-9_-]{1,64}$"


def is_suffix(pattern: str) -> bool:
    """A plain module-name suffix (``q_proj``, ``self_attn.q_proj``) rather than a regex."""
    return bool(_SUFFIX.match(pattern))


class LoraOptions(BaseModel):
    """The ``adapter: {name: lora, ...}`` block. A bad value is an error naming the field."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, description="LoRA rank r: A is [r, in], B is [out, r]")
    alpha: float = Field(16.0, gt=0, description="lora_alpha: the update is scaled by alpha / r")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="lora_dropout on the adapter's input (a backend that runs its model in "
        "eval mode, as fsdp2 does, refuses a non-zero one)",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LLAMA_PROJECTIONS),
        min_length=1,
        description="the Linear layers to adapt: each entry a module-name suffix "
        "(q_proj matches model.layers.0.self_attn.q_proj) or a regular expression matched "
        "against the whole module name (model\\.layers\\.[0-3]\\..*_proj); an entry that "
        "matches no module of the model is an error at setup",
    )
    use_rslora: bool = Field(False, description="rank-stabilised LoRA: scale by alpha / sqrt(r)")
    served_name: str = Field(
        "policy",
        pattern=SERVED_NAME,
        description="the name the engines serve the adapter under (lora_path on /generate); "
        "also peft's adapter name and a folder name, so letters, digits, '_' and '-' only "
        "(1 to 64)",
    )

    @field_validator("served_name")
    @classmethod
    def _not_in_peft_prefix(cls, value: str) -> str:
        # peft finds an adapter's weights by its name beside the "lora_" prefix: a name
        # inside that prefix ("a", "or") makes it take other tensors for the adapter's.
        if value in "lora_":
            raise ValueError(
                f"{value!r} is part of peft's prefix 'lora_', which would mix its weights "
                "up with others; choose a longer name"
            )
        return value

    lr: float | None = Field(
        None,
        gt=0,
        description="this adapter's own learning rate (peak, under the backend's schedule); "
        "None: the trainer backend's lr",
    )
    init_seed: int = Field(
        0,
        description="seeds the initialisation of A (B starts at zero, as peft does), "
        "independent of the run's RNG so every rank and every run draws the same adapter",
    )

    @field_validator("target_modules")
    @classmethod
    def _patterns_compile(cls, value: list[str]) -> list[str]:
        for entry in value:
            if not entry:
                raise ValueError("an entry is empty")
            if not is_suffix(entry):
                try:
                    re.compile(entry)
                except re.error as exc:
                    raise ValueError(
                        f"{entry!r} is not a valid regular expression: {exc}"
                    ) from None
        return value

    def scaling(self) -> float:
        """The factor the low-rank update is multiplied by."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def peft_target_modules(self) -> list[str] | str:
        """``target_modules`` as peft reads it: the list of suffixes when every entry is one
        (peft matches ``name == s or name.endswith("." + s)``), else one regular expression
        that peft full-matches, equivalent entry by entry."""
        if all(is_suffix(e) for e in self.target_modules):
            return list(self.target_modules)
        parts = [
            rf"(?:.*\.)?{re.escape(e)}" if is_suffix(e) else f"(?:{e})" for e in self.target_modules
        ]
        return "|".join(parts)
