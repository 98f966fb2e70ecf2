"""The adapter on its own (no trainer): target checks, PEFT names, the PEFT folder, merging."""

from __future__ import annotations

import json

import pytest
import torch
from miles_lora.adapter import LoraAdapter, build
from miles_lora.options import LoraOptions
from pydantic import ValidationError

from miles_core.contracts import AdapterImpl


def _wrapped(llama_path: str, hf, **options) -> tuple[LoraAdapter, torch.nn.Module]:
    adapter = build(LoraOptions(**options))
    model = adapter.apply(hf.model(llama_path))
    # a trained-looking adapter: B away from zero
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return adapter, model


def test_the_adapter_implements_the_contract_and_pickles() -> None:
    import pickle

    adapter = build(None)
    assert isinstance(adapter, AdapterImpl)
    assert adapter.name == "policy"
    assert pickle.loads(pickle.dumps(adapter)).options == adapter.options


def test_apply_freezes_the_base_and_seeds_a(llama_path: str, hf) -> None:
    a1 = build(LoraOptions(rank=4, init_seed=3)).apply(hf.model(llama_path))
    torch.manual_seed(999)  # the run's RNG does not matter
    a2 = build(LoraOptions(rank=4, init_seed=3)).apply(hf.model(llama_path))
    trainable = [n for n, p in a1.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    for (n, p), (_, q) in zip(a1.named_parameters(), a2.named_parameters(), strict=True):
        assert torch.equal(p, q), n
        if ".lora_B." in n:
            assert not p.any()
        if ".lora_A." in n:
            assert p.any()


def test_a_pattern_matching_no_module_is_an_error_naming_it(llama_path: str, hf) -> None:
    with pytest.raises(ValueError) as err:
        build(LoraOptions(target_modules=["q_proj", "qkv_proj"])).apply(hf.model(llama_path))
    text = str(err.value)
    assert "adapter.target_modules: 'qkv_proj' matches no module" in text
    assert "q_proj" in text and "model.layers.0.self_attn.q_proj" in text
    with pytest.raises(ValueError, match=r"matches 'model\.layers\.0\.self_attn' .* Linear"):
        build(LoraOptions(target_modules=[r"model\.layers\.0\.self_attn"])).apply(
            hf.model(llama_path)
        )
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        LoraOptions(target_modules=["q_(proj"])


def test_regex_and_suffix_entries_select_what_they_say(llama_path: str, hf) -> None:
    adapter, model = _wrapped(
        llama_path, hf, rank=2, target_modules=["o_proj", r"model\.layers\.1\.mlp\.\w+_proj"]
    )
    names = {n.split(".lora_")[0] for n, _ in adapter.named_weights(model)}
    prefix = "base_model.model.model.layers."
    assert names == {
        prefix + "0.self_attn.o_proj",
        prefix + "1.self_attn.o_proj",
        prefix + "1.mlp.gate_proj",
        prefix + "1.mlp.up_proj",
        prefix + "1.mlp.down_proj",
    }


def test_peft_names_and_a_folder_peft_loads(llama_path: str, hf, groups, tmp_path) -> None:
    from peft import PeftModel, get_peft_model_state_dict

    adapter, model = _wrapped(llama_path, hf, rank=4, use_rslora=True)
    ours = dict(adapter.named_weights(model))
    theirs = get_peft_model_state_dict(model, adapter_name=adapter.name)
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    adapter.save_pretrained(adapter.named_weights(model), str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["use_rslora"] is True
    assert config["peft_type"] == "LORA" and config["target_modules"][0] == "q_proj"
    loaded = PeftModel.from_pretrained(hf.model(llama_path), str(tmp_path / "adapter"))
    loaded.eval()
    model.eval()
    g = groups()
    assert torch.equal(hf.logprobs(loaded, g), hf.logprobs(model, g))


def test_merged_weights_load_in_transformers(llama_path: str, hf, groups) -> None:
    adapter, model = _wrapped(llama_path, hf, rank=4)
    merged = dict(adapter.merged_weights(model))
    plain = hf.model(llama_path)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    model.eval()
    g = groups()
    base = hf.logprobs(hf.model(llama_path), g)
    assert (hf.logprobs(plain, g) - base).abs().max() > 1e-3  # the adapter did something
    torch.testing.assert_close(hf.logprobs(plain, g), hf.logprobs(model, g), atol=1e-5, rtol=0)
