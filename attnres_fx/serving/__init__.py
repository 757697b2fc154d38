"""Serving converted models with inference engines: :mod:`.vllm_plugin` (vLLM's plugin entry point, which
routes a converted folder to :mod:`.vllm_model`)."""
