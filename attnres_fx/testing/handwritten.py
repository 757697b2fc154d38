"""A Llama written by hand, as people write their own (after Meta's reference ``model.py``): one ``Block``
class calling attention and a SwiGLU MLP, rotary embeddings as complex numbers, a key/value cache the
attention writes at ``start_pos`` (a Python int that changes at every decoding step), and no
transformers. What the tests and the bench convert beside the transformers models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnres_fx.models import ScaledNorm


@dataclass(frozen=True)
class HandwrittenConfig:
    dim: int = 256
    layers: int = 8
    heads: int = 8
    vocab: int = 512
    hidden: int | None = None       # the MLP's width; None: 8/3 of dim, rounded up to a multiple of 32
    max_batch: int = 4
    max_seq: int = 256
    eps: float = 1e-5

    @property
    def mlp_width(self) -> int:
        return self.hidden or -(-(8 * self.dim // 3) // 32) * 32


class RMSNorm(ScaledNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_table(head_dim: int, length: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[:, None, :]).flatten(3).type_as(x)


class Attention(nn.Module):
    """Causal self-attention; in eval mode it keeps its keys and values in a cache, written at ``start_pos``."""

    def __init__(self, config: HandwrittenConfig):
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.dim // config.heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        shape = (config.max_batch, config.max_seq, config.heads, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x, start_pos: int, freqs, mask):
        batch, length, _ = x.shape
        q = rotate(self.wq(x).view(batch, length, self.heads, self.head_dim), freqs)
        k = rotate(self.wk(x).view(batch, length, self.heads, self.head_dim), freqs)
        v = self.wv(x).view(batch, length, self.heads, self.head_dim)
        if not self.training:
            self.cache_k[:batch, start_pos:start_pos + length] = k
            self.cache_v[:batch, start_pos:start_pos + length] = v
            k = self.cache_k[:batch, :start_pos + length]
            v = self.cache_v[:batch, :start_pos + length]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        out = F.softmax(scores.float(), dim=-1).type_as(q) @ v
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, config: HandwrittenConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.mlp_width, bias=False)
        self.w2 = nn.Linear(config.mlp_width, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.mlp_width, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: HandwrittenConfig):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.eps)
        self.ffn_norm = RMSNorm(config.dim, config.eps)

    def forward(self, x, start_pos: int, freqs, mask):
        h = x + self.attention(self.attention_norm(x), start_pos, freqs, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(tokens, start_pos=0)`` -> logits ``[batch, length, vocab]``."""

    def __init__(self, config: HandwrittenConfig = HandwrittenConfig()):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.dim, config.eps)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)
        self.register_buffer("freqs", rotary_table(config.dim // config.heads, 2 * config.max_seq), persistent=False)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0):
        length = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs = self.freqs[start_pos:start_pos + length]
        mask = None
        if length > 1:
            mask = torch.full((length, length), float("-inf"), device=tokens.device).triu(1)
            mask = torch.hstack([torch.zeros((length, start_pos), device=tokens.device), mask]).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, freqs, mask)
        return self.output(self.norm(h)).float()
