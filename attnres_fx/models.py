"""Built-in small pre-norm Transformers: the demo model and the test bed.

``TinyTransformer`` is an ordinary GPT-style model with a standard residual stream. Its ``norm`` option
selects how the pre-norms are written, so detection can be exercised on every form it must recognise:

- ``"layernorm"`` / ``"rmsnorm"``: ``nn.LayerNorm`` / ``nn.RMSNorm`` modules (fx leaves);
- ``"functional_layernorm"`` / ``"functional_rmsnorm"``: ``F.layer_norm`` / ``F.rms_norm`` calls;
- ``"manual_rmsnorm"``: ``x * rsqrt(mean(x**2) + eps) * w`` written out, with fp32 casts, as Llama does;
- ``"none"``: no pre-norm at all (sublayers read the raw stream).

``parallel=True`` gives GPT-J/NeoX style layers ``h + attn(ln1(h)) + mlp(ln2(h))``.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class FunctionalLayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class FunctionalRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class ManualRMSNorm(nn.Module):
    """RMSNorm written out the way Llama-family code does, fp32 upcast included."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

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
