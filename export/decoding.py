"""ONNX for decoding: a decoder LM with its KV cache as graph inputs and outputs, and greedy decoding in
onnxruntime.

The graph follows the layout ``optimum`` uses for decoders with past: inputs ``input_ids`` ``[batch,
sequence]``, ``attention_mask`` ``[batch, past_sequence + sequence]`` and, per layer ``i``,
``past_key_values.{i}.key`` / ``.value`` ``[batch, kv_heads, past_sequence, head_dim]``; outputs
``logits`` ``[batch, sequence, vocab]`` and ``present.{i}.key`` / ``.value`` (the cache after this
step). One graph serves the prompt (``past_sequence`` 0) and every decoding step.

    path = export.to_onnx(model, (ids,), "decoder.onnx", with_cache=True)
    tokens = export.generate_onnx(export.session(path), ids, max_new_tokens=20)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from attnres_fx import compat
from attnres_fx.errors import ExportError

EXAMPLE_PAST = 4        # past length of the traced example: > 1, so torch.export keeps it dynamic


class DecoderWithCache(nn.Module):
    """``model`` (a Hugging Face decoder LM) with its cache as flat tensors: what the graph computes."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: list[torch.Tensor]):
        layers = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        # Sliding-window layers keep every position too (their masks apply the window): a windowed cache's
        # length is decided by branches the trace would fix at the example's length.
        cache = compat.full_length_cache(layers, self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         **{compat.cache_argument(self.model.forward): cache}, use_cache=True, return_dict=True)
        present = [tensor for layer in compat.output_cache(out).layers for tensor in (layer.keys, layer.values)]
        return (out.logits, *present)


def cache_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a Hugging Face decoder's KV cache, from its config."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "is_decoder", True) or getattr(config, "is_encoder_decoder", False):
        raise ExportError(f"with_cache=True exports Hugging Face decoder language models; "
                          f"{type(model).__name__} is not one")
    _require_key_value_cache(model, config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return layers, kv_heads, head_dim


def _require_key_value_cache(model: nn.Module, config) -> None:
    """Refuse a model whose cache holds more than keys and values: the graph's cache is one key and one
    value tensor per layer, which has no place for the convolution or recurrent states of linear-attention
    and state-space layers (Lfm2, FalconH1, GraniteMoeHybrid, Kimi Linear)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    layers = DynamicCache(config=config).layers
    other = sorted({type(layer).__name__ for layer in layers
                    if not isinstance(layer, DynamicLayer) or isinstance(layer, LinearAttentionCacheLayerMixin)})
    if other:
        raise ExportError(
            f"with_cache=True exports a cache of keys and values per layer; {type(model).__name__}'s cache also "
            f"holds {', '.join(other)} layers (the states of its linear-attention or state-space layers), "
            "which that layout has no place for. Export without the cache (with_cache=False): the graph then "
            "recomputes the whole sequence at every step.")


def input_names(layers: int) -> list[str]:
    return ["input_ids", "attention_mask",
            *(f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value"))]


def output_names(layers: int) -> list[str]:
    return ["logits", *(f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value"))]


def example_call(model: nn.Module, input_ids: torch.Tensor) -> tuple[tuple, Any]:
    """Example inputs for the trace (a past of :data:`EXAMPLE_PAST` positions) and their dynamic axes."""
    layers, kv_heads, head_dim = cache_shape(model)
    batch = input_ids.shape[0]
    reference = next(model.parameters())
    past = [torch.zeros(batch, kv_heads, EXAMPLE_PAST, head_dim, dtype=reference.dtype, device=reference.device)
            for _ in range(2 * layers)]
    mask = torch.ones(batch, EXAMPLE_PAST + input_ids.shape[1], dtype=torch.long, device=input_ids.device)
    auto = torch.export.Dim.AUTO
    dynamic = {"input_ids": {0: auto, 1: auto}, "attention_mask": {0: auto, 1: auto},
               "past": [{0: auto, 2: auto} for _ in past]}
    return (input_ids, mask, past), dynamic


def generate_onnx(session, input_ids, max_new_tokens: int, *, attention_mask=None,
                  eos_token_id: int | None = None) -> np.ndarray:
    """Greedy decoding with a ``with_cache=True`` ONNX model in onnxruntime: the prompt once, then one
    token per step with the cache the graph returned. Returns ``[batch, prompt + new]`` token ids;
    with ``eos_token_id``, stops once every sequence has produced it (later positions repeat it)."""
    ids = np.asarray(input_ids.detach().cpu() if isinstance(input_ids, torch.Tensor) else input_ids, dtype=np.int64)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(
        attention_mask.detach().cpu() if isinstance(attention_mask, torch.Tensor) else attention_mask, dtype=np.int64)
    inputs = session.get_inputs()
    names = [i.name for i in inputs]
    if names[:2] != ["input_ids", "attention_mask"] or not all(n.startswith("past_key_values.") for n in names[2:]):
        raise ExportError(f"generate_onnx needs a model exported with with_cache=True; this one takes {names}")
    past = [np.zeros((ids.shape[0], i.shape[1], 0, i.shape[3]), dtype=_numpy_type(i.type)) for i in inputs[2:]]
    tokens, step, finished = ids, ids, np.zeros(ids.shape[0], dtype=bool)
    for _ in range(max_new_tokens):
        feed = {"input_ids": step, "attention_mask": mask, **dict(zip(names[2:], past))}
        logits, *past = session.run(None, feed)
        step = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        if eos_token_id is not None:
            step[finished] = eos_token_id
            finished |= step[:, 0] == eos_token_id
        tokens = np.concatenate([tokens, step], axis=1)
        mask = np.concatenate([mask, np.ones_like(step)], axis=1)
        if eos_token_id is not None and finished.all():
            break
    return tokens


def _numpy_type(onnx_type: str):
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}.get(
        onnx_type, np.float32)
