"""Attention masks from token positions rather than cache columns, for a cache with holes.

onnxruntime-genai right-pads a batch of prompts and appends every later token after the padding, so a
short row's cache reads ``[its prompt, pad slots (masked), its new tokens]``. Hugging Face builds a
model's masks from cache columns: causality is the same either way, but a sliding window counts the pad
slots as distance, and would hide the prompt from the new tokens too early. Here each column's position
is the number of real tokens before it (``cumsum(attention_mask) - 1``), and the model's own causal and
sliding-window mask functions are applied to those positions, in the format its attention
implementation takes (``transformers.masking_utils``: a boolean mask for ``sdpa``, an additive one for
``eager``). On a cache without holes (left padding, one row) the masks are the ones the model builds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from attnres_fx.compat import hf_attention_implementation
from attnres_fx.errors import ExportError

FULL = "full_attention"
SLIDING = "sliding_attention"


def positions_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each cache column's position in its row: the real tokens before it (pad slots repeat the last)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def layer_kinds(config) -> list[str]:
    """The mask kind of each layer: the config's ``layer_types``, else every layer sliding when the config
    has a sliding window (Mistral, Phi-3), else every layer full."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    kind = SLIDING if getattr(config, "sliding_window", None) else FULL
    return [kind] * config.num_hidden_layers


def position_masks(model: nn.Module, attention_mask: torch.Tensor, query_length: int,
                   dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask argument for ``model`` (a Hugging Face decoder whose last ``query_length``
    cache columns are this call's tokens): one 4D mask when all its layers are of one kind, else a
    dict from kind to mask, the form models with both kinds take (``causal_mask_mapping``)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = model.config.get_text_config()
    implementation = hf_attention_implementation(config)
    if implementation not in ("eager", "sdpa"):
        raise ExportError(f"{type(model).__name__} uses attn_implementation={implementation!r}; its masks are built "
                          "here for 'eager' or 'sdpa' only: load the model with attn_implementation='sdpa'")
    build = ALL_MASK_ATTENTION_FUNCTIONS[implementation]
    positions = positions_of(attention_mask)
    batch, kv_length = attention_mask.shape
    masks = {kind: build(batch_size=batch, q_length=query_length, kv_length=kv_length,
                         q_offset=kv_length - query_length, kv_offset=0,
                         mask_function=_at_positions(_mask_function(kind, model, config), positions),
                         attention_mask=attention_mask.bool(), allow_is_causal_skip=False, use_vmap=False,
                         dtype=dtype, config=config, device=attention_mask.device)
             for kind in dict.fromkeys(layer_kinds(config))}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def _mask_function(kind: str, model: nn.Module, config) -> Callable:
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    if kind == FULL:
        return causal_mask_function
    if kind == SLIDING:
        return sliding_window_causal_mask_function(config.sliding_window)
    raise ExportError(f"{type(model).__name__} has layers of kind {kind!r}: masks are built here for {FULL!r} and "
                      f"{SLIDING!r} layers only")


def _at_positions(mask_function: Callable, positions: torch.Tensor) -> Callable:
    """``mask_function`` applied to the positions of the query and key columns instead of the columns."""
    def at_positions(batch_idx, head_idx, q_idx, kv_idx):
        return mask_function(batch_idx, head_idx, positions[batch_idx, q_idx], positions[batch_idx, kv_idx])
    return at_positions
