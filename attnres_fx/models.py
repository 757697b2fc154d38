"""The small models the CLI and the benchmarks run: a built-in pre-norm Transformer, and tiny random-weight
Hugging Face models.

``TinyTransformer`` is an ordinary GPT-style model with a standard residual stream. Its ``norm`` option
selects how the pre-norms are written, so detection can be exercised on every form it must recognise:

- ``"layernorm"`` / ``"rmsnorm"``: ``nn.LayerNorm`` / ``nn.RMSNorm`` modules (fx leaves);
- ``"functional_layernorm"`` / ``"functional_rmsnorm"``: ``F.layer_norm`` / ``F.rms_norm`` calls;
- ``"manual_rmsnorm"``: ``x * rsqrt(mean(x**2) + eps) * w`` written out, with fp32 casts, as Llama does;
- ``"none"``: no pre-norm at all (sublayers read the raw stream).

``parallel=True`` gives GPT-J/NeoX style layers ``h + attn(ln1(h)) + mlp(ln2(h))``.

:data:`HF_MODELS` are tiny configs (2 layers, hidden 32) of Hugging Face architectures, built with random
(seeded) weights, so nothing is downloaded; ``transformers`` is imported only when one is built
(``pip install 'attnres-fx[hf]'``)::

    model = build_hf("llama")                           # LlamaForCausalLM, eval mode
    args, kwargs = hf_example_inputs("llama", batch=2, seq=16)
    logits = main_output("llama", model(*args, **kwargs))
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NORM_STYLES = ("layernorm", "rmsnorm", "functional_layernorm", "functional_rmsnorm", "manual_rmsnorm",
               "none")


@dataclass
class TinyConfig:
    vocab_size: int = 128
    dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    mlp_ratio: int = 4
    max_seq_len: int = 256
    norm: str = "layernorm"
    parallel: bool = False
    eps: float = 1e-5

    def __post_init__(self):
        if self.norm not in NORM_STYLES:
            raise ValueError(f"norm must be one of {NORM_STYLES}, got {self.norm!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")


class ScaledNorm(nn.Module):
    """What a norm written by hand keeps: its ``eps`` and a learned scale ``weight`` (ones at init)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


class FunctionalLayerNorm(ScaledNorm):
    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class FunctionalRMSNorm(ScaledNorm):
    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class ManualRMSNorm(ScaledNorm):
    """RMSNorm written out the way Llama-family code does, fp32 upcast included."""

    def forward(self, x):
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


def make_norm(style: str, dim: int, eps: float) -> nn.Module:
    if style == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    if style == "rmsnorm":
        return nn.RMSNorm(dim, eps=eps)
    if style == "functional_layernorm":
        return FunctionalLayerNorm(dim, eps)
    if style == "functional_rmsnorm":
        return FunctionalRMSNorm(dim, eps)
    if style == "manual_rmsnorm":
        return ManualRMSNorm(dim, eps)
    if style == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm style {style!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        heads = (batch, seq, self.num_heads, dim // self.num_heads)
        q, k, v = (t.reshape(heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.parallel = cfg.parallel
        self.ln1 = make_norm(cfg.norm, cfg.dim, cfg.eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = make_norm(cfg.norm, cfg.dim, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        if self.parallel:
            return x + self.attn(self.ln1(x)) + self.mlp(self.ln2(x))
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class TinyTransformer(nn.Module):
    """A GPT-style pre-norm language model: ``ids [B, T] -> logits [B, T, vocab]``."""

    def __init__(self, cfg: TinyConfig | None = None, **overrides):
        super().__init__()
        cfg = cfg or TinyConfig(**overrides)
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = make_norm(cfg.norm, cfg.dim, cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def embed(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tok_emb(ids) + self.pos_emb(positions)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def example_ids(cfg: TinyConfig, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)


# -- tiny Hugging Face models ----------------------------------------------------------------------------

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


@dataclass(frozen=True)
class HFModel:
    """How to build one tiny architecture and feed it."""

    name: str
    hf_class: str                   # transformers model class
    config_class: str               # transformers config class
    config: dict[str, Any]          # config fields (overridable by ``build_hf(name, **config)``)
    inputs: str                     # "tokens" | "seq2seq" (ids + decoder ids) | "image"
    # "causal_lm" | "seq2seq_lm" | "text_encoder" | "image_encoder" | "image_classifier"
    task: str
    output_field: str               # the ModelOutput field holding the main tensor
    eps_field: str                  # the config field holding the norms' epsilon
    model_kwargs: dict[str, Any] = field(default_factory=dict)

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
_VIT = dict(
    hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
    num_channels=NUM_CHANNELS, attn_implementation="eager",
)
_GPT2 = dict(vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
             n_inner=INTERMEDIATE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
             use_cache=False, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, attn_implementation="eager")
_PHI = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=MAX_POS,
            resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, use_cache=False, attn_implementation="eager")
_NEOX = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
             num_attention_heads=HEADS, max_position_embeddings=MAX_POS, attention_dropout=0.0,
             hidden_dropout=0.0, classifier_dropout=0.0, use_parallel_residual=True, use_cache=False,
             attn_implementation="eager")
_BERT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
             intermediate_size=INTERMEDIATE, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             classifier_dropout=0.0, max_position_embeddings=MAX_POS, use_cache=False,
             attn_implementation="eager")
_LM = dict(inputs="tokens", task="causal_lm", output_field="logits")

HF_MODELS: dict[str, HFModel] = {m.name: m for m in (
    HFModel("gpt2", "GPT2LMHeadModel", "GPT2Config", _GPT2, eps_field="layer_norm_epsilon", **_LM),
    HFModel("llama", "LlamaForCausalLM", "LlamaConfig", _LLAMA_LIKE, eps_field="rms_norm_eps", **_LM),
    HFModel("qwen2", "Qwen2ForCausalLM", "Qwen2Config", _LLAMA_LIKE, eps_field="rms_norm_eps", **_LM),
    # One key/value head: grouped-query attention.
    HFModel("mistral", "MistralForCausalLM", "MistralConfig",
            {**_LLAMA_LIKE, "num_key_value_heads": 1, "sliding_window": None}, eps_field="rms_norm_eps", **_LM),
    # Pre and post norms around each sublayer, embeddings scaled by sqrt(hidden), tied head.
    HFModel("gemma2", "Gemma2ForCausalLM", "Gemma2Config",
            {**_LLAMA_LIKE, "num_key_value_heads": 1, "tie_word_embeddings": True,
             "query_pre_attn_scalar": HIDDEN // HEADS, "sliding_window": MAX_POS}, eps_field="rms_norm_eps", **_LM),
    # Parallel layers; Phi's attention and MLP share one LayerNorm.
    HFModel("phi", "PhiForCausalLM", "PhiConfig", _PHI, eps_field="layer_norm_eps", **_LM),
    HFModel("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", _NEOX, eps_field="layer_norm_eps", **_LM),
    HFModel("t5_encoder", "T5EncoderModel", "T5Config", _T5, inputs="tokens", task="text_encoder",
            output_field="last_hidden_state", eps_field="layer_norm_epsilon"),
    # Two streams: the decoder's layers have self-attention, cross-attention and MLP sites.
    HFModel("t5", "T5ForConditionalGeneration", "T5Config", _T5, inputs="seq2seq", task="seq2seq_lm",
            output_field="logits", eps_field="layer_norm_epsilon"),
    HFModel("vit", "ViTModel", "ViTConfig", _VIT, inputs="image", task="image_encoder",
            output_field="last_hidden_state", eps_field="layer_norm_eps", model_kwargs={"add_pooling_layer": False}),
    HFModel("vit_classifier", "ViTForImageClassification", "ViTConfig", {**_VIT, "num_labels": NUM_LABELS},
            inputs="image", task="image_classifier", output_field="logits", eps_field="layer_norm_eps"),
    # Post-norm: not convertible (UnsupportedArchitectureError).
    HFModel("bert", "BertModel", "BertConfig", _BERT, inputs="tokens", task="text_encoder",
            output_field="last_hidden_state", eps_field="layer_norm_eps", model_kwargs={"add_pooling_layer": False}),
)}
HF_NAMES = tuple(HF_MODELS)


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("the tiny Hugging Face models need transformers: pip install 'attnres-fx[hf]'") from err
    return transformers


def hf_model(name: str) -> HFModel:
    try:
        return HF_MODELS[name]
    except KeyError:
        raise KeyError(f"unknown architecture {name!r}; known: {list(HF_MODELS)}") from None


def build_hf(name: str, **config: Any) -> nn.Module:
    """A fresh, eval-mode model; the same weights on every call (``config`` overrides config fields,
    e.g. ``build_hf("gpt2", layer_norm_epsilon=1e-12)``)."""
    spec = hf_model(name)
    transformers = _transformers()
    torch.manual_seed(SEED)
    cfg = getattr(transformers, spec.config_class)(**{**spec.config, **config})
    return getattr(transformers, spec.hf_class)(cfg, **spec.model_kwargs).eval()


def _ids(batch: int, seq: int, offset: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234 + offset + 7 * batch + seq)
    # No id 0: it is the pad token of T5 / BERT / Gemma2, and padding would make the masks matter.
    return torch.randint(1, VOCAB, (batch, seq), generator=generator, dtype=torch.long)


def hf_example_inputs(name: str, batch: int = 2, seq: int = 16) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)``, deterministic. ViT ignores ``seq``: its
    position embeddings fix the image size, hence the token count (16 patches and [CLS])."""
    kind = hf_model(name).inputs
    if kind == "image":
        generator = torch.Generator().manual_seed(4321 + batch)
        return (torch.randn(batch, NUM_CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=generator),), {}
    if kind == "seq2seq":
        return (_ids(batch, seq),), {"decoder_input_ids": _ids(batch, seq, offset=99)}
    return (_ids(batch, seq),), {}


def main_output(name: str, output) -> torch.Tensor:
    """The main tensor of a model's output (ModelOutput, tuple, dict or tensor); ``name`` is a key of
    :data:`HF_MODELS` (anything else reads a tensor or the first item)."""
    if isinstance(output, torch.Tensor):
        return output
    output_field = HF_MODELS[name].output_field if name in HF_MODELS else None
    if output_field and getattr(output, output_field, None) is not None:
        return getattr(output, output_field)
    if isinstance(output, dict):
        return output[output_field] if output_field in output else next(iter(output.values()))
    if isinstance(output, (tuple, list)):
        return output[0]
    raise TypeError(f"cannot find the main output {output_field!r} in {type(output).__name__}")
