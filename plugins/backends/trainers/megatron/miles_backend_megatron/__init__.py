"""Miles's Megatron-core trainer backend: Hugging Face Llama/Qwen3 checkpoints trained as
Megatron ``GPTModel``s, tensor- and data-parallel, weights exported in Hugging Face naming."""
