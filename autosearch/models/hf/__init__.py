"""Adapters that run Hugging Face ``transformers`` causal LMs under the Engine, parameters under
their own names: `causal_lm` (the Llama layout: Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE) and
`gpt` (GPT-2, GPT-NeoX)."""
