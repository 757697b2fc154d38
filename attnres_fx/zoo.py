"""Tiny, randomly initialised Hugging Face models: the architectures attnres_fx is checked on.

Every model is built from a config with random (seeded) weights, so nothing is downloaded. Models are
in eval mode, with every dropout probability 0, eager attention and ``use_cache=False``.
``transformers`` is imported inside the functions that need it: importing this module never imports
it (``pip install 'attnres-fx[hf]'`` to build the models).

    model = zoo.build("llama")                          # LlamaForCausalLM, 2 layers, hidden 32
    args, kwargs = zoo.example_inputs("llama", batch=2, seq=16)
    logits = zoo.main_output("llama", model(*args, **kwargs))

``build(name, **config)`` overrides config fields, e.g. ``build("gpt2", layer_norm_epsilon=1e-12)``;
``spec(name).eps_field`` names the norm-epsilon field of each architecture.

The CLI (``attnres-fx demo --model NAME``), the test-suite and ``benchmarks/architectures.py`` share
these definitions, and the measurements the README reports (:func:`relative_error`,
:func:`eps_bound`).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .api import sites

VOCAB = 128
HIDDEN = 32
HEADS = 2
LAYERS = 2
INTERMEDIATE = 64
MAX_POS = 128
IMAGE_SIZE = 32
PATCH_SIZE = 8
NUM_CHANNELS = 3
NUM_LABELS = 10
SEED = 0

Inputs = tuple[tuple[Any, ...], dict[str, Any]]

__all__ = ["ARCHITECTURES", "ARCH_NAMES", "PRE_NORM_NAMES", "ArchSpec", "Inputs", "build", "eps_bound",
           "example_inputs", "expected_sites", "lm_loss", "main_output", "relative_error", "spec",
           "transformers_available"]


@dataclass(frozen=True)
class ArchSpec:
    """One tiny architecture: how to build it, feed it, and what AttnRes should find in it."""

    name: str
    hf_class: str                   # transformers model class
    config_class: str               # transformers config class
    config: dict[str, Any]          # config fields (overridable by ``build(name, **config)``)
    inputs: str                     # "tokens" | "seq2seq" (ids + decoder ids) | "image"
    # "causal_lm" | "seq2seq_lm" | "text_encoder" | "image_encoder" | "image_classifier"
    task: str
    parallel_residual: bool         # h + attn(ln1(h)) + mlp(ln2(h)): one site per layer
    streams: dict[str, int]         # stream -> residual sites (the final aggregation not counted)
    layer_paths: dict[str, str]     # stream -> the ModuleList holding its layers
    norm: str                       # "layernorm" | "rmsnorm"
    norm_position: str              # "pre" | "sandwich" (pre and post norms, Gemma2) | "post" (BERT)
    output_field: str               # the ModelOutput field holding the main tensor
    eps_field: str                  # the config field holding the norms' epsilon
    num_layers: int = LAYERS        # layers per stream
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    # stream -> owner paths (``{i}`` = layer index) of the modules whose forward performs the residual
    # adds, in execution order within a layer; default ``"<layer path>.{i}"`` for every site.
    site_owners: dict[str, tuple[str, ...]] | None = None

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    @property
    def num_sites(self) -> int:
        return sum(self.streams.values())

    @property
    def sites_per_layer(self) -> dict[str, int]:
        return {k: v // self.num_layers for k, v in self.streams.items()}

    @property
    def is_lm(self) -> bool:
        return self.task in ("causal_lm", "seq2seq_lm")


_LLAMA_LIKE = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HIDDEN // HEADS,
    max_position_embeddings=MAX_POS, attention_dropout=0.0, use_cache=False, attn_implementation="eager",
    tie_word_embeddings=False,
)
_T5 = dict(
    vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTERMEDIATE, num_layers=LAYERS,
    num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
    relative_attention_max_distance=32, dropout_rate=0.0, classifier_dropout=0.0, feed_forward_proj="relu",
    use_cache=False, decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager",
)
_T5_OWNERS = {"encoder": ("encoder.block.{i}.layer.0", "encoder.block.{i}.layer.1"),
              "decoder": ("decoder.block.{i}.layer.0", "decoder.block.{i}.layer.1", "decoder.block.{i}.layer.2")}
_VIT = dict(
    hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
    num_channels=NUM_CHANNELS, attn_implementation="eager",
)
_SEQUENTIAL = {"main": 2 * LAYERS}          # attention and MLP sites in every layer


def _specs() -> list[ArchSpec]:
    gpt2 = dict(vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                n_inner=INTERMEDIATE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                summary_first_dropout=0.0, use_cache=False, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                attn_implementation="eager")
    phi = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=MAX_POS,
               resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, use_cache=False,
               attn_implementation="eager")
    neox = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=MAX_POS, attention_dropout=0.0,
                hidden_dropout=0.0, classifier_dropout=0.0, use_parallel_residual=True, use_cache=False,
                attn_implementation="eager")
    bert = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=INTERMEDIATE, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                classifier_dropout=0.0, max_position_embeddings=MAX_POS, use_cache=False,
                attn_implementation="eager")
    lm = dict(inputs="tokens", task="causal_lm", output_field="logits")
    return [
        ArchSpec("gpt2", "GPT2LMHeadModel", "GPT2Config", gpt2, parallel_residual=False, streams=_SEQUENTIAL,
                 layer_paths={"main": "transformer.h"}, norm="layernorm", norm_position="pre",
                 eps_field="layer_norm_epsilon", **lm),
        ArchSpec("llama", "LlamaForCausalLM", "LlamaConfig", _LLAMA_LIKE, parallel_residual=False,
                 streams=_SEQUENTIAL, layer_paths={"main": "model.layers"}, norm="rmsnorm", norm_position="pre",
                 eps_field="rms_norm_eps", **lm),
        ArchSpec("qwen2", "Qwen2ForCausalLM", "Qwen2Config", _LLAMA_LIKE, parallel_residual=False,
                 streams=_SEQUENTIAL, layer_paths={"main": "model.layers"}, norm="rmsnorm", norm_position="pre",
                 eps_field="rms_norm_eps", **lm),
        # One key/value head: grouped-query attention.
        ArchSpec("mistral", "MistralForCausalLM", "MistralConfig",
                 {**_LLAMA_LIKE, "num_key_value_heads": 1, "sliding_window": None}, parallel_residual=False,
                 streams=_SEQUENTIAL, layer_paths={"main": "model.layers"}, norm="rmsnorm", norm_position="pre",
                 eps_field="rms_norm_eps", **lm),
        # Pre and post norms around each sublayer, embeddings scaled by sqrt(hidden), tied head.
        ArchSpec("gemma2", "Gemma2ForCausalLM", "Gemma2Config",
                 {**_LLAMA_LIKE, "num_key_value_heads": 1, "tie_word_embeddings": True,
                  "query_pre_attn_scalar": HIDDEN // HEADS, "sliding_window": MAX_POS},
                 parallel_residual=False, streams=_SEQUENTIAL, layer_paths={"main": "model.layers"},
                 norm="rmsnorm", norm_position="sandwich", eps_field="rms_norm_eps", **lm),
        # Parallel layers; Phi's attention and MLP share one LayerNorm.
        ArchSpec("phi", "PhiForCausalLM", "PhiConfig", phi, parallel_residual=True, streams={"main": LAYERS},
                 layer_paths={"main": "model.layers"}, norm="layernorm", norm_position="pre",
                 eps_field="layer_norm_eps", **lm),
        ArchSpec("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", neox, parallel_residual=True,
                 streams={"main": LAYERS}, layer_paths={"main": "gpt_neox.layers"}, norm="layernorm",
                 norm_position="pre", eps_field="layer_norm_eps", **lm),
        ArchSpec("t5_encoder", "T5EncoderModel", "T5Config", _T5, inputs="tokens", task="text_encoder",
                 parallel_residual=False, streams={"encoder": 2 * LAYERS},
                 layer_paths={"encoder": "encoder.block"},
                 norm="rmsnorm", norm_position="pre", output_field="last_hidden_state",
                 eps_field="layer_norm_epsilon", site_owners={"encoder": _T5_OWNERS["encoder"]}),
        # Two streams: the decoder's layers have self-attention, cross-attention and MLP sites.
        ArchSpec("t5", "T5ForConditionalGeneration", "T5Config", _T5, inputs="seq2seq", task="seq2seq_lm",
                 parallel_residual=False, streams={"encoder": 2 * LAYERS, "decoder": 3 * LAYERS},
                 layer_paths={"encoder": "encoder.block", "decoder": "decoder.block"}, norm="rmsnorm",
                 norm_position="pre", output_field="logits", eps_field="layer_norm_epsilon",
                 site_owners=_T5_OWNERS),
        ArchSpec("vit", "ViTModel", "ViTConfig", _VIT, inputs="image", task="image_encoder",
                 parallel_residual=False, streams=_SEQUENTIAL, layer_paths={"main": "layers"}, norm="layernorm",
                 norm_position="pre", output_field="last_hidden_state", eps_field="layer_norm_eps",
                 model_kwargs={"add_pooling_layer": False}),
        ArchSpec("vit_classifier", "ViTForImageClassification", "ViTConfig", {**_VIT, "num_labels": NUM_LABELS},
                 inputs="image", task="image_classifier", parallel_residual=False, streams=_SEQUENTIAL,
                 layer_paths={"main": "vit.layers"}, norm="layernorm", norm_position="pre",
                 output_field="logits", eps_field="layer_norm_eps"),
        # Post-norm: not convertible (UnsupportedArchitectureError).
        ArchSpec("bert", "BertModel", "BertConfig", bert, inputs="tokens", task="text_encoder",
                 parallel_residual=False, streams=_SEQUENTIAL, layer_paths={"main": "encoder.layer"},
                 norm="layernorm", norm_position="post", output_field="last_hidden_state",
                 eps_field="layer_norm_eps", model_kwargs={"add_pooling_layer": False},
                 site_owners={"main": ("encoder.layer.{i}.attention.output", "encoder.layer.{i}.output")}),
    ]


ARCHITECTURES: dict[str, ArchSpec] = {s.name: s for s in _specs()}
ARCH_NAMES = tuple(ARCHITECTURES)
PRE_NORM_NAMES = tuple(n for n, s in ARCHITECTURES.items() if s.norm_position != "post")


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("the model zoo needs Hugging Face transformers: pip install 'attnres-fx[hf]'") from err
    return transformers


def spec(name: str) -> ArchSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise KeyError(f"unknown architecture {name!r}; known: {list(ARCHITECTURES)}") from None


def build(name: str, **config: Any) -> nn.Module:
    """A fresh, eval-mode model; the same weights on every call (``config`` overrides config fields)."""
    s = spec(name)
    transformers = _transformers()
    torch.manual_seed(SEED)
    cfg = getattr(transformers, s.config_class)(**{**s.config, **config})
    return getattr(transformers, s.hf_class)(cfg, **s.model_kwargs).eval()


def _ids(batch: int, seq: int, offset: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234 + offset + 7 * batch + seq)
    # No id 0: it is the pad token of T5 / BERT / Gemma2, and padding would make the masks matter.
    return torch.randint(1, VOCAB, (batch, seq), generator=generator, dtype=torch.long)


def example_inputs(name: str, batch: int = 2, seq: int = 16) -> Inputs:
    """``(args, kwargs)`` for ``model(*args, **kwargs)``, deterministic. ViT ignores ``seq``: its
    position embeddings fix the image size, hence the token count (16 patches and [CLS])."""
    kind = spec(name).inputs
    if kind == "image":
        generator = torch.Generator().manual_seed(4321 + batch)
        return (torch.randn(batch, NUM_CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=generator),), {}
    if kind == "seq2seq":
        return (_ids(batch, seq),), {"decoder_input_ids": _ids(batch, seq, offset=99)}
    return (_ids(batch, seq),), {}


def expected_sites(name: str) -> int:
    """Residual sites detection must find, over all streams (final aggregations not counted)."""
    return spec(name).num_sites


def main_output(name: str, output) -> torch.Tensor:
    """The main tensor of a model's output (ModelOutput, tuple, dict or tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    output_field = spec(name).output_field
    if getattr(output, output_field, None) is not None:
        return getattr(output, output_field)
    if isinstance(output, dict):
        return output[output_field] if output_field in output else next(iter(output.values()))
    if isinstance(output, (tuple, list)):
        return output[0]
    raise TypeError(f"cannot find the main output {output_field!r} in {type(output).__name__}")


def lm_loss(name: str, output, inputs: Inputs) -> torch.Tensor:
    """A scalar training loss: next-token cross-entropy for language models (T5: on the decoder ids),
    cross-entropy against fixed labels for classifiers, and for encoders the squared error to a fixed
    random target (``mean(h**2)`` would not do: encoders end in a norm, so it is ~1 whatever h is)."""
    s = spec(name)
    y = main_output(name, output)
    args, kwargs = inputs
    cross_entropy = torch.nn.functional.cross_entropy
    if s.is_lm:
        ids = kwargs["decoder_input_ids"] if s.task == "seq2seq_lm" else (args[0] if args else kwargs["input_ids"])
        return cross_entropy(y[:, :-1].reshape(-1, y.shape[-1]).float(), ids[:, 1:].reshape(-1))
    if s.task == "image_classifier":
        return cross_entropy(y.float(), torch.arange(y.shape[0], device=y.device) % y.shape[-1])
    generator = torch.Generator().manual_seed(99 + y.numel())
    target = torch.randn(tuple(y.shape), generator=generator).to(y.device)
    return (y.float() - target).pow(2).mean()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max over rows of |actual - expected| / |expected|`` (2-norms along the last dim: per token,
    or per example for classifier logits): the relative change the eps analysis predicts per token."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float(((actual - expected).norm(dim=-1) / expected.norm(dim=-1)).max())


def eps_bound(exact, args: tuple, kwargs: dict, eps: float) -> float:
    """Predicted relative difference between the default (convex) rewrite and the original model.

    ``exact`` is the model rewritten with ``preserve_scale=True``, whose aggregates reproduce the
    original stream ``h``. With zero-initialised pseudo-queries the default rewrite feeds each norm
    ``h / c`` instead (``c`` = the aggregation's number of sources), and a LayerNorm / RMSNorm of
    ``h / c`` is the norm of ``h`` with ``eps`` replaced by ``c^2 eps``: it scales the norm's output,
    per token, by ``sqrt((var + eps) / (var + c^2 eps))``. The bound adds, over every aggregation,
    one minus that factor at the token of smallest variance. ``var`` is the variance of ``h``, which
    is at most the mean square an RMSNorm divides by, so it is conservative for RMSNorm too. The final
    aggregation's term is exactly the relative change of a bias-free head's output; the others move
    the stream by at most their sublayer's share of it, so the sum bounds the output's change at first
    order.
    """
    variances: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs, output):
            variances[name] = output.detach().double().var(-1, unbiased=False).min()
        return record

    found = sites(exact)
    handles = [site.module.register_forward_hook(hook(site.name)) for site in found]
    try:
        with torch.no_grad():
            exact(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    bound = 0.0
    for site in found:
        var = float(variances[site.name])
        bound += 1.0 - math.sqrt((var + eps) / (var + site.num_sources ** 2 * eps))
    return bound
