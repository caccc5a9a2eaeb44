"""Adapters that run Hugging Face ``transformers`` causal LMs under the Engine, parameters under
their own names; `families` says which wrapper takes which ``model_type``."""
