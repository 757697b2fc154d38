"""Tiny decoder language models of the families onnxruntime-genai serves, a tiny tokenizer, and the
reference a served folder is checked against: ``model.generate`` greedily, on a left-padded batch.

Built from config classes with seeded random weights and a byte-level BPE trained on the Python standard
library's source: nothing is downloaded.

    model = serving_model("mistral")                       # 2 layers, hidden 32, a sliding window of 8
    tokenizer = tiny_tokenizer()
    reference = greedy_reference(model, [[5, 6, 7], [8, 9]], max_new_tokens=12)
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import torch
from torch import nn

from attnres_fx.export.genai_runtime import until_eos

PAD, BOS, EOS = 0, 1, 2
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")     # ids PAD, BOS, EOS in the tokenizer
VOCAB = 384
SLIDING_WINDOW = 8       # shorter than the test prompts and generations: the window binds
SEED = 0

_TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=BOS,
             eos_token_id=EOS, tie_word_embeddings=False)
# family -> (transformers config class, model class, config fields beside the tiny ones)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),                      # query and key norms
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": SLIDING_WINDOW}),
    # Its fused qkv and gate/up projections; eager attention (the others take transformers' default, sdpa).
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"original_max_position_embeddings": 128,
                                               "attn_implementation": "eager"}),
    # RMSNorm scaled by 1 + weight, embeddings scaled by sqrt(hidden).
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    # Multipliers on the embeddings, attention scores, residual branches and logits.
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 2.0, "attention_multiplier": 0.3,
                                                        "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    # Rotary embeddings left out of every fourth layer.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    # Sliding-window and full layers alternating, logit soft-capping, norms before and after each sublayer.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": SLIDING_WINDOW, "query_pre_attn_scalar": 16}),
    # One sliding-window layer and one full one; query and key norms, embeddings scaled by sqrt(hidden).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": SLIDING_WINDOW,
                                                         "layer_types": ["sliding_attention", "full_attention"],
                                                         "query_pre_attn_scalar": 16}),
}


def serving_model(family: str, **config: Any) -> nn.Module:
    """A fresh eval-mode model of ``family`` (:data:`FAMILIES`), the same weights on every call; ``config``
    overrides config fields (a larger model for the benchmark)."""
    import transformers

    config_class, model_class, fields = FAMILIES[family]
    torch.manual_seed(SEED)
    cfg = getattr(transformers, config_class)(**{**_TINY, **fields, **config})
    return getattr(transformers, model_class)(cfg).eval()


def tiny_tokenizer(vocab_size: int = VOCAB):
    """A byte-level BPE of ``vocab_size`` tokens trained on the source of Python's ``json`` package, as a
    ``PreTrainedTokenizerFast`` with the special tokens :data:`SPECIAL_TOKENS` at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([inspect.getsource(json.decoder), inspect.getsource(json.encoder)], trainer)
    pad, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token=pad, bos_token=bos, eos_token=eos)


def greedy_reference(model: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``model.generate(..., do_sample=False)`` on the prompts left-padded into one batch (how Hugging
    Face batches prompts): each row's new tokens up to and including its first EOS."""
    longest = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[PAD] * (longest - len(prompt)) + list(prompt) for prompt in prompts])
    mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=PAD, eos_token_id=EOS)
    return [until_eos(row, {EOS}) for row in out[:, longest:].tolist()]
