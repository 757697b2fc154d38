"""Serving converted models with inference engines: :mod:`.vllm_plugin` (vLLM's plugin entry point, which
routes a converted folder to :mod:`.vllm_native`, vLLM's own implementation with the AttnRes rewrite, or to
:mod:`.vllm_model`, vLLM's Transformers backend with the AttnRes conversion)."""
