"""Tiny, randomly initialised Hugging Face models shared by the test-suite.

Nothing here downloads anything: every model is built from a config class
with random weights (seeded), in eval mode, with all dropout probabilities set
to zero.  ``transformers`` is imported lazily inside the builders, so importing
this module never fails; tests that need a model should skip when
:func:`transformers_available` is False (or use
``pytest.importorskip("transformers")`` themselves).

The module has no package-relative imports, so both
``from tests.hf_models import ...`` and ``import hf_models`` (with ``tests/`` on
``sys.path``) work.

Public API
----------
``ARCHITECTURES``            ordered dict name -> :class:`ArchSpec`
``ARCH_NAMES``               tuple of the names, in order
``build(name)``              fresh model (eval mode, seeded)
``example_inputs(name, batch=2, seq=16)``   ``(args, kwargs)``
``dynamic_shapes(name, args, kwargs)``      ``torch.export`` dynamic_shapes spec
``main_output(name, output)``               the main tensor of a model output
``lm_loss(name, output, inputs)``           scalar training loss
``expected_sites(name)``                    total number of residual sites
``site_owner_paths(name, stream=None)``     module paths owning each residual add
``layer_path(name, model)`` / ``layer_modules(name, model)``  the layer ModuleList
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional, Tuple

import torch

# Shared tiny dimensions.
VOCAB = 128
HIDDEN = 32
HEADS = 2
LAYERS = 2
INTERMEDIATE = 64
MAX_POS = 128  # enough for seq up to 128 (tests use <= 64)
IMAGE_SIZE = 32
PATCH_SIZE = 8
NUM_CHANNELS = 3
NUM_LABELS = 10
VIT_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 + 1  # patches + [CLS] = 17

SEED = 0


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


Inputs = Tuple[Tuple[Any, ...], Dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """Everything a test needs to know about one tiny architecture."""

    name: str
    builder: Callable[[], torch.nn.Module]
    make_inputs: Callable[[int, int], Inputs]
    # "causal_lm" | "seq2seq_lm" | "text_encoder" | "image_encoder" | "image_classifier"
    task: str
    num_layers: int  # layers per stream (T5: encoder == decoder layers)
    parallel_residual: bool
    # stream name -> number of residual sites (residual adds) in that stream
    streams: Dict[str, int]
    # stream name -> dotted module path of the nn.ModuleList holding the layers
    layer_paths: Dict[str, str]
    # "layernorm" | "rmsnorm" | "rmsnorm_gemma" (x * (1 + w)) | "rmsnorm_t5" (no bias/mean)
    norm: str
    # "pre" | "post" (BERT: add -> LayerNorm) | "sandwich" (Gemma2: pre + post norms)
    norm_position: str
    output_field: str  # attribute of the ModelOutput holding the main tensor
    # True when the example inputs are token ids (vs. pixel_values)
    token_inputs: bool = True
    # token count when ``seq`` of example_inputs is ignored (ViT: fixed image
    # size -> 17 tokens); None when ``seq`` is honoured
    fixed_seq: Optional[int] = None
    hf_class: str = ""
    # stream -> format strings (``{i}`` = layer index) of the module paths
    # whose ``nn_module_stack`` innermost entry owns the residual add(s),
    # in execution order within a layer.  None -> ``"<layer_path>.{i}"``.
    # (Empirical, torch.export on transformers 5.x; see site_owner_paths.)
    site_owners: Optional[Dict[str, Tuple[str, ...]]] = None

    @property
    def num_streams(self) -> int:
        return len(self.streams)

    @property
    def num_sites(self) -> int:
        return sum(self.streams.values())

    @property
    def sites_per_layer(self) -> Dict[str, int]:
        return {k: v // self.num_layers for k, v in self.streams.items()}

    @property
    def is_lm(self) -> bool:
        return self.task in ("causal_lm", "seq2seq_lm")


# ---------------------------------------------------------------------------
# input makers
# ---------------------------------------------------------------------------


def _ids(batch: int, seq: int, offset: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + offset + 7 * batch + seq)
    # avoid id 0 (pad token for T5/BERT/Gemma2) - keeps masks all-ones.
    return torch.randint(1, VOCAB, (batch, seq), generator=g, dtype=torch.long)


def _causal_inputs(batch: int, seq: int) -> Inputs:
    return (_ids(batch, seq),), {}


def _encoder_inputs(batch: int, seq: int) -> Inputs:
    return (_ids(batch, seq),), {}


def _seq2seq_inputs(batch: int, seq: int) -> Inputs:
    # decoder length = seq as well (same symbol is fine, export treats them
    # separately when both are marked dynamic).
    return (_ids(batch, seq),), {"decoder_input_ids": _ids(batch, seq, offset=99)}


def _image_inputs(batch: int, seq: int) -> Inputs:
    # ``seq`` is ignored: ViT has fixed-size position embeddings, so the token
    # count is always VIT_TOKENS (= 17) for a 32x32 image with 8x8 patches.
    g = torch.Generator().manual_seed(4321 + batch)
    px = torch.randn(batch, NUM_CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    return (px,), {}


# ---------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------


def _finish(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    return model


def _set_eager(cfg) -> None:
    # transformers >= 4.36 honours ``_attn_implementation``; passing
    # ``attn_implementation=`` to the config ctor works on 4.4x/5.x, but set
    # both to be robust across versions.
    try:
        cfg._attn_implementation = "eager"
    except Exception:  # pragma: no cover
        pass


def _build_gpt2():
    import transformers as T

    torch.manual_seed(SEED)
    cfg = T.GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS,
        n_head=HEADS, n_inner=INTERMEDIATE, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, summary_first_dropout=0.0, use_cache=False,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
        attn_implementation="eager",
    )
    _set_eager(cfg)
    return _finish(T.GPT2LMHeadModel(cfg))


def _llama_like_kwargs():
    return dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, max_position_embeddings=MAX_POS,
        attention_dropout=0.0, use_cache=False, attn_implementation="eager",
        tie_word_embeddings=False,
    )


def _build_llama():
    import transformers as T

    torch.manual_seed(SEED)
    cfg = T.LlamaConfig(head_dim=HIDDEN // HEADS, **_llama_like_kwargs())
    _set_eager(cfg)
    return _finish(T.LlamaForCausalLM(cfg))


def _build_qwen2():
    import transformers as T

    torch.manual_seed(SEED)
    cfg = T.Qwen2Config(**_llama_like_kwargs())
    _set_eager(cfg)
    return _finish(T.Qwen2ForCausalLM(cfg))


def _build_mistral():
    import transformers as T

    torch.manual_seed(SEED)
    kw = _llama_like_kwargs()
    kw["num_key_value_heads"] = 1  # exercise GQA
    cfg = T.MistralConfig(head_dim=HIDDEN // HEADS, sliding_window=None, **kw)
    _set_eager(cfg)
    return _finish(T.MistralForCausalLM(cfg))


def _build_gemma2():
    import transformers as T

    torch.manual_seed(SEED)
    kw = _llama_like_kwargs()
    kw["num_key_value_heads"] = 1
    kw["tie_word_embeddings"] = True
    cfg = T.Gemma2Config(
        head_dim=HIDDEN // HEADS, query_pre_attn_scalar=HIDDEN // HEADS,
        sliding_window=MAX_POS, **kw,
    )
    _set_eager(cfg)
    return _finish(T.Gemma2ForCausalLM(cfg))


def _build_phi():
    import transformers as T

    torch.manual_seed(SEED)
    cfg = T.PhiConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, max_position_embeddings=MAX_POS,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        use_cache=False, attn_implementation="eager",
    )
    _set_eager(cfg)
    return _finish(T.PhiForCausalLM(cfg))


def _build_gpt_neox():
    import transformers as T

    torch.manual_seed(SEED)
    cfg = T.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=MAX_POS, attention_dropout=0.0,
        hidden_dropout=0.0, classifier_dropout=0.0,
        use_parallel_residual=True, use_cache=False,
        attn_implementation="eager",
    )
    _set_eager(cfg)
    return _finish(T.GPTNeoXForCausalLM(cfg))


def _t5_config(**extra):
    import transformers as T

    cfg = T.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTERMEDIATE,
        num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
        relative_attention_num_buckets=8, relative_attention_max_distance=32,
        dropout_rate=0.0, classifier_dropout=0.0, feed_forward_proj="relu",
        use_cache=False, decoder_start_token_id=0, pad_token_id=0,
        attn_implementation="eager", **extra,
    )
    _set_eager(cfg)
    return cfg


def _build_t5_encoder():
    import transformers as T

    torch.manual_seed(SEED)
    return _finish(T.T5EncoderModel(_t5_config()))


def _build_t5():
    import transformers as T

    torch.manual_seed(SEED)
    return _finish(T.T5ForConditionalGeneration(_t5_config()))


def _vit_config(**extra):
    import transformers as T

    cfg = T.ViTConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE, num_channels=NUM_CHANNELS,
        attn_implementation="eager", **extra,
    )
    _set_eager(cfg)
    return cfg


def _build_vit():
    import transformers as T

    torch.manual_seed(SEED)
    return _finish(T.ViTModel(_vit_config(), add_pooling_layer=False))


def _build_vit_classifier():
    import transformers as T

    torch.manual_seed(SEED)
    cfg = _vit_config(num_labels=NUM_LABELS)
    return _finish(T.ViTForImageClassification(cfg))


def _build_bert():
    import transformers as T

    torch.manual_seed(SEED)
    cfg = T.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0, max_position_embeddings=MAX_POS,
        use_cache=False, attn_implementation="eager",
    )
    _set_eager(cfg)
    return _finish(T.BertModel(cfg, add_pooling_layer=False))


# ---------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------

L = LAYERS


def _seq(layers: int = L) -> int:
    return 2 * layers


ARCHITECTURES: "OrderedDict[str, ArchSpec]" = OrderedDict(
    (s.name, s)
    for s in [
        ArchSpec("gpt2", _build_gpt2, _causal_inputs, "causal_lm", L, False,
                 {"main": _seq()}, {"main": "transformer.h"}, "layernorm", "pre",
                 "logits", hf_class="GPT2LMHeadModel"),
        ArchSpec("llama", _build_llama, _causal_inputs, "causal_lm", L, False,
                 {"main": _seq()}, {"main": "model.layers"}, "rmsnorm", "pre",
                 "logits", hf_class="LlamaForCausalLM"),
        ArchSpec("qwen2", _build_qwen2, _causal_inputs, "causal_lm", L, False,
                 {"main": _seq()}, {"main": "model.layers"}, "rmsnorm", "pre",
                 "logits", hf_class="Qwen2ForCausalLM"),
        ArchSpec("mistral", _build_mistral, _causal_inputs, "causal_lm", L, False,
                 {"main": _seq()}, {"main": "model.layers"}, "rmsnorm", "pre",
                 "logits", hf_class="MistralForCausalLM"),
        ArchSpec("gemma2", _build_gemma2, _causal_inputs, "causal_lm", L, False,
                 {"main": _seq()}, {"main": "model.layers"}, "rmsnorm_gemma",
                 "sandwich", "logits", hf_class="Gemma2ForCausalLM"),
        ArchSpec("phi", _build_phi, _causal_inputs, "causal_lm", L, True,
                 {"main": L}, {"main": "model.layers"}, "layernorm", "pre",
                 "logits", hf_class="PhiForCausalLM"),
        ArchSpec("gpt_neox", _build_gpt_neox, _causal_inputs, "causal_lm", L, True,
                 {"main": L}, {"main": "gpt_neox.layers"}, "layernorm", "pre",
                 "logits", hf_class="GPTNeoXForCausalLM"),
        ArchSpec("t5_encoder", _build_t5_encoder, _encoder_inputs, "text_encoder",
                 L, False, {"encoder": _seq()}, {"encoder": "encoder.block"},
                 "rmsnorm_t5", "pre", "last_hidden_state",
                 hf_class="T5EncoderModel",
                 site_owners={"encoder": ("encoder.block.{i}.layer.0",
                                          "encoder.block.{i}.layer.1")}),
        ArchSpec("t5", _build_t5, _seq2seq_inputs, "seq2seq_lm", L, False,
                 {"encoder": 2 * L, "decoder": 3 * L},
                 {"encoder": "encoder.block", "decoder": "decoder.block"},
                 "rmsnorm_t5", "pre", "logits",
                 hf_class="T5ForConditionalGeneration",
                 site_owners={
                     "encoder": ("encoder.block.{i}.layer.0", "encoder.block.{i}.layer.1"),
                     "decoder": ("decoder.block.{i}.layer.0", "decoder.block.{i}.layer.1",
                                 "decoder.block.{i}.layer.2"),
                 }),
        ArchSpec("vit", _build_vit, _image_inputs, "image_encoder", L, False,
                 {"main": _seq()}, {"main": "layers"}, "layernorm", "pre",
                 "last_hidden_state", token_inputs=False, fixed_seq=VIT_TOKENS,
                 hf_class="ViTModel"),
        ArchSpec("vit_classifier", _build_vit_classifier, _image_inputs,
                 "image_classifier", L, False, {"main": _seq()},
                 {"main": "vit.layers"}, "layernorm", "pre", "logits",
                 token_inputs=False, fixed_seq=VIT_TOKENS,
                 hf_class="ViTForImageClassification"),
        ArchSpec("bert", _build_bert, _encoder_inputs, "text_encoder", L, False,
                 {"main": _seq()}, {"main": "encoder.layer"}, "layernorm", "post",
                 "last_hidden_state", hf_class="BertModel",
                 site_owners={"main": ("encoder.layer.{i}.attention.output",
                                       "encoder.layer.{i}.output")}),
    ]
)

# No timm entry: timm (1.0.x) imports torchvision unconditionally
# (timm/layers/create_norm.py), and the only torchvision wheels available here
# (0.28/0.29) are CUDA builds whose _C.so needs libtorch_cuda.so, so
# ``import torchvision`` fails next to the CPU torch 2.13 build.

ARCH_NAMES = tuple(ARCHITECTURES)
CAUSAL_LM_NAMES = tuple(n for n, s in ARCHITECTURES.items() if s.task == "causal_lm")
PARALLEL_NAMES = tuple(n for n, s in ARCHITECTURES.items() if s.parallel_residual)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def spec(name: str) -> ArchSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise KeyError(f"unknown architecture {name!r}; known: {list(ARCHITECTURES)}") from None


def build(name: str) -> torch.nn.Module:
    """A fresh, seeded, eval-mode model (identical weights on every call)."""
    return spec(name).builder()


def example_inputs(name: str, batch: int = 2, seq: int = 16) -> Inputs:
    """``(args, kwargs)`` for ``model(*args, **kwargs)``; deterministic."""
    return spec(name).make_inputs(batch, seq)


def expected_sites(name: str) -> int:
    return spec(name).num_sites


def site_owner_paths(name: str, stream: Optional[str] = None):
    """Module paths owning the residual adds of ``stream`` (all streams when
    None), in execution order, e.g. ``["model.layers.0", "model.layers.0",
    "model.layers.1", ...]`` for a pre-norm LM (two sites per layer share the
    layer's path) or ``["encoder.layer.0.attention.output",
    "encoder.layer.0.output", ...]`` for BERT.  Parallel-residual models
    (Phi, GPT-NeoX) list each layer once (one site per layer).
    """
    s = spec(name)
    out = []
    for st in ([stream] if stream else list(s.streams)):
        per_layer = s.streams[st] // s.num_layers
        pats = (s.site_owners or {}).get(st) or (s.layer_paths[st] + ".{i}",) * per_layer
        for i in range(s.num_layers):
            out.extend(p.format(i=i) for p in pats)
    return out


# Older transformers releases (< 5) named some layer lists differently.
_LAYER_PATH_FALLBACKS = {
    "layers": ("encoder.layer",),
    "vit.layers": ("vit.encoder.layer",),
}


def layer_path(name: str, model: torch.nn.Module, stream: Optional[str] = None) -> str:
    """Dotted path of the ModuleList holding ``stream``'s layers in ``model``."""
    s = spec(name)
    stream = stream or next(iter(s.layer_paths))
    primary = s.layer_paths[stream]
    for cand in (primary, *_LAYER_PATH_FALLBACKS.get(primary, ())):
        try:
            mod = model.get_submodule(cand)
        except AttributeError:
            continue
        if isinstance(mod, torch.nn.ModuleList):
            return cand
    raise AttributeError(f"{name}: no layer list for stream {stream!r} in {type(model).__name__}")


def layer_modules(name: str, model: torch.nn.Module, stream: Optional[str] = None):
    """The ``nn.ModuleList`` of layers for ``stream`` (default: first stream)."""
    return model.get_submodule(layer_path(name, model, stream))


def dynamic_shapes(name: str, args, kwargs=None, model: Optional[torch.nn.Module] = None,
                   *, seq_dynamic: bool = True):
    """A ``dynamic_shapes`` spec for ``torch.export.export(model, args, kwargs)``.

    Batch (dim 0) of every tensor input is ``Dim.AUTO``; for token inputs the
    sequence dim (dim 1) is ``Dim.AUTO`` too (``seq_dynamic=False`` to keep it
    static).  ViT inputs only get a dynamic batch: image size / token count is
    fixed by the position embeddings.

    Without kwargs the spec is a tuple matching ``args``.  With kwargs it is a
    dict keyed by ``forward`` parameter names (taken from ``model.forward`` if
    given, else from the HF class), which is what torch.export expects for
    mixed positional/keyword inputs.
    """
    from torch.export import Dim

    s = spec(name)
    kwargs = kwargs or {}

    def one(t):
        if not isinstance(t, torch.Tensor):
            return None
        d = {0: Dim.AUTO}
        if s.token_inputs and seq_dynamic and t.dim() >= 2:
            d[1] = Dim.AUTO
        return d

    arg_spec = tuple(one(a) for a in args)
    if not kwargs:
        return arg_spec
    if model is not None:
        fwd = model.forward
    else:
        import transformers as T

        fwd = getattr(T, s.hf_class).forward
    params = [p for p in inspect.signature(fwd).parameters if p != "self"]
    out = dict(zip(params, arg_spec))
    out.update({k: one(v) for k, v in kwargs.items()})
    return out


def main_output(name: str, output) -> torch.Tensor:
    """The main tensor of ``output`` (ModelOutput, tuple, dict or tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    field = spec(name).output_field
    if field and hasattr(output, field) and getattr(output, field) is not None:
        return getattr(output, field)
    if isinstance(output, dict):
        if field in output:
            return output[field]
        return next(iter(output.values()))
    if isinstance(output, (tuple, list)):
        return output[0]
    raise TypeError(f"cannot find main output {field!r} in {type(output)}")


def lm_loss(name: str, output, inputs: Inputs) -> torch.Tensor:
    """Scalar training loss for one optimiser step.

    * causal LMs: next-token cross-entropy of ``logits`` against ``input_ids``;
    * T5 seq2seq: cross-entropy of ``logits`` against ``decoder_input_ids``
      shifted by one;
    * image classifiers: cross-entropy against fixed labels ``arange % C``;
    * encoders: ``mean((last_hidden_state - target) ** 2)`` with a fixed,
      seeded random ``target``.  (Plain ``mean(h ** 2)`` is useless here: every
      encoder ends in a LayerNorm/RMSNorm with unit weight, so ``mean(h**2)``
      is ~1.0 regardless of the inputs and nothing before the final norm
      gets a gradient.)
    """
    s = spec(name)
    y = main_output(name, output)
    args, kwargs = inputs
    F = torch.nn.functional
    if s.task == "causal_lm":
        ids = args[0] if args else kwargs["input_ids"]
        return F.cross_entropy(
            y[:, :-1].reshape(-1, y.shape[-1]).float(), ids[:, 1:].reshape(-1)
        )
    if s.task == "seq2seq_lm":
        ids = kwargs["decoder_input_ids"]
        return F.cross_entropy(
            y[:, :-1].reshape(-1, y.shape[-1]).float(), ids[:, 1:].reshape(-1)
        )
    if s.task == "image_classifier":
        labels = torch.arange(y.shape[0], device=y.device) % y.shape[-1]
        return F.cross_entropy(y.float(), labels)
    return (y.float() - _target_like(y)).pow(2).mean()


def _target_like(y: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(99 + y.numel())
    return torch.randn(tuple(y.shape), generator=g).to(device=y.device)


loss = lm_loss  # alias


__all__ = [
    "ARCHITECTURES", "ARCH_NAMES", "CAUSAL_LM_NAMES",
    "PARALLEL_NAMES", "ArchSpec", "build", "example_inputs", "expected_sites",
    "dynamic_shapes", "main_output", "lm_loss", "loss", "spec", "layer_path",
    "layer_modules", "site_owner_paths",
    "transformers_available", "VIT_TOKENS",
]
