"""HTTP request bodies of the SGLang-native API subset, as strict pydantic models.

Strict models turn every malformed body (unknown field, wrong type, out-of-range value) into a
400 whose message names the field, before anything reaches the scheduler.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

_STRICT = ConfigDict(extra="forbid", strict=True)


class SamplingParams(BaseModel):
    """SGLang ``sampling_params`` (the subset the embedded engine implements)."""

    model_config = _STRICT

    temperature: float = Field(1.0, ge=0.0, le=1e4)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(-1, ge=-1, le=2**31 - 1)
    max_new_tokens: StrictInt = Field(128, ge=0, le=2**31 - 1)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    sampling_seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    n: StrictInt = Field(1, ge=1, le=1)

    @model_validator(mode="after")
    def _top_k_not_zero(self) -> SamplingParams:
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return self


class GenerateRequest(BaseModel):
    """Body of ``POST /generate``: one request, or a batch when ``input_ids`` is a list of lists."""

    model_config = _STRICT

    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    text: StrictStr | list[StrictStr] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: StrictBool = False
    #: with return_logprob: the first input position whose log-prob is returned; -1: none
    logprob_start_len: StrictInt = Field(-1, ge=-1, le=2**63 - 1)
    top_logprobs_num: StrictInt = Field(0, ge=0, le=0)
    #: SGLang's routing record: ``meta_info["routed_experts"]``, base64 of int32
    #: ``[prompt + output - 1, num_hidden_layers, num_experts_per_tok]`` (MoE models only)
    return_routed_experts: StrictBool = False
    return_text_in_logprobs: StrictBool = False
    rid: StrictStr | list[StrictStr] | None = None
    #: SGLang's LoRA selection: an adapter name for every input, or one (or null: the base
    #: model) per input of a batch
    lora_path: StrictStr | list[StrictStr | None] | None = None
    stream: Literal[False] = False
    # sglang-router re-serializes every /generate body through its own request struct, which
    # writes these fields with their defaults; SGLang's GenerateReqInput accepts them, so must
    # this engine. Only the defaults (or, for the bookkeeping ones, any value) are served.
    log_metrics: StrictBool = True
    no_logs: StrictBool = False
    return_hidden_states: Literal[False] = False
    return_entropy: Literal[False] = False
    return_bytes: Literal[False] = False
    background: Literal[False] = False

    @model_validator(mode="before")
    @classmethod
    def _drop_router_model(cls, data: object) -> object:
        # sglang-router also writes "model" (null unless the caller named one). SGLang has no
        # such field and ignores unknown keys; this strict model drops that one key instead.
        if isinstance(data, dict) and isinstance(data.get("model", 0), (str, type(None))):
            data = {k: v for k, v in data.items() if k != "model"}
        return data

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids or text")
        return self


class AbortRequest(BaseModel):
    """Body of ``POST /abort_request`` (SGLang's ``AbortReq``: a null ``rid`` means ``""``)."""

    model_config = _STRICT

    rid: StrictStr | None = ""
    abort_all: StrictBool = False


class PauseGenerationRequest(BaseModel):
    """Body of ``POST /pause_generation``."""

    model_config = _STRICT

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(BaseModel):
    """Body of ``POST /continue_generation`` (SGLang's ``ContinueGenerationReqInput``)."""

    model_config = _STRICT

    torch_empty_cache: StrictBool = True


class UpdateWeightsFromDiskRequest(BaseModel):
    """Body of ``POST /update_weights_from_disk``."""

    model_config = _STRICT

    model_path: StrictStr
    load_format: StrictStr | None = None
    abort_all_requests: StrictBool = False
    weight_version: StrictStr | None = None
    flush_cache: StrictBool = True
    is_async: StrictBool = False
    torch_empty_cache: StrictBool = False
    keep_pause: StrictBool = False


class InitWeightsUpdateGroupRequest(BaseModel):
    """Body of ``POST /init_weights_update_group``."""

    model_config = _STRICT

    master_address: StrictStr
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt = Field(ge=1)
    world_size: StrictInt = Field(ge=2)
    group_name: StrictStr = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "gloo"


class UpdateWeightsFromDistributedRequest(BaseModel):
    """Body of ``POST /update_weights_from_distributed``."""

    model_config = _STRICT

    names: list[StrictStr]
    dtypes: list[StrictStr]
    shapes: list[list[StrictInt]]
    group_name: StrictStr = "weight_update_group"
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: StrictStr | None = None
    load_format: StrictStr | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedRequest:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


class UpdateWeightsFromTensorRequest(BaseModel):
    """Body of ``POST /update_weights_from_tensor``."""

    model_config = _STRICT

    serialized_named_tensors: list[StrictStr]
    load_format: StrictStr | None = None
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: StrictStr | None = None
    torch_empty_cache: StrictBool = False


class UpdateWeightVersionRequest(BaseModel):
    """Body of ``POST /update_weight_version``."""

    model_config = _STRICT

    new_version: StrictStr
    abort_all_requests: StrictBool = True


class MemoryOccupationRequest(BaseModel):
    """Body of ``POST /release_memory_occupation`` and ``/resume_memory_occupation``."""

    model_config = _STRICT

    tags: list[Literal["kv_cache", "weights"]] | None = None


class UpdateLoraFromDistributedRequest(UpdateWeightsFromDistributedRequest):
    """Body of ``POST /miles/update_lora_from_distributed`` (Miles's extension for the
    broadcast transport publishing an adapter): SGLang's ``/update_weights_from_distributed``
    body plus the adapter the update is committed into."""

    lora_name: StrictStr = Field(min_length=1)
    config_dict: dict[str, object]


class ReceiverUpdateRequest(BaseModel):
    """Body of a transport's receiver route (Miles's extension, not an SGLang endpoint; the
    ``p2p`` transport's ``POST /miles/p2p_weights``): receive one update through the
    transport's receiver, built with ``options`` and connected to the trainer's sender at
    ``address``."""

    model_config = _STRICT

    options: dict[str, object] = Field(default_factory=dict)
    address: list[object]
    version: StrictInt = Field(ge=0)
    #: Miles's ``lora_weight_updates``: the update is committed into this adapter
    lora_name: StrictStr | None = None
    config_dict: dict[str, object] | None = None


#: the name the body had when only the ``p2p`` transport declared a receiver route
P2PWeightsRequest = ReceiverUpdateRequest


class LoadLoRAAdapterRequest(BaseModel):
    """Body of ``POST /load_lora_adapter`` (SGLang's ``LoadLoRAAdapterReqInput``)."""

    model_config = _STRICT

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)
    pinned: StrictBool = False
    lora_id: StrictStr | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """Body of ``POST /unload_lora_adapter`` (SGLang's ``UnloadLoRAAdapterReqInput``)."""

    model_config = _STRICT

    lora_name: StrictStr = Field(min_length=1)
    lora_id: StrictStr | None = None


class LoadLoRAAdapterFromTensorsRequest(BaseModel):
    """Body of ``POST /load_lora_adapter_from_tensors`` (SGLang's
    ``LoadLoRAAdapterFromTensorsReqInput``): the tensors are one item serialized as for
    ``/update_weights_from_tensor``, in ``serialized_named_tensors`` (SGLang's list of one item
    per rank; this engine is one rank)."""

    model_config = _STRICT

    lora_name: StrictStr = Field(min_length=1)
    config_dict: dict[str, object]
    serialized_named_tensors: list[StrictStr]
    load_format: Literal["flattened_bucket", "direct"] | None = None
    pinned: StrictBool = False
    added_tokens_config: dict[str, StrictInt] | None = None
    lora_id: StrictStr | None = None
    expected_checksums: dict[str, StrictStr] | None = None

    @model_validator(mode="after")
    def _one_item(self) -> LoadLoRAAdapterFromTensorsRequest:
        if len(self.serialized_named_tensors) != 1:
            raise ValueError(
                "serialized_named_tensors: one item per rank, and this engine is one rank "
                f"(got {len(self.serialized_named_tensors)})"
            )
        if self.added_tokens_config:
            raise ValueError("added_tokens_config: adapters with added tokens are not served")
        if self.expected_checksums:
            raise ValueError("expected_checksums: not served; allowed: null")
        return self

    @property
    def item(self) -> str:
        """The one serialized item."""
        return self.serialized_named_tensors[0]
