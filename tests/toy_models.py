"""Small hand-written models for detection tests: things that must and must not be found."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnres_fx.models import MLP, Block, CausalSelfAttention, TinyConfig


class EncoderDecoder(nn.Module):
    """Two independent streams; every decoder layer cross-attends to the encoder's final output."""

    def __init__(self, dim=32, layers=2, vocab=64):
        super().__init__()
        cfg = TinyConfig(dim=dim, num_heads=4, vocab_size=vocab)
        self.src_emb = nn.Embedding(vocab, dim)
        self.tgt_emb = nn.Embedding(vocab, dim)
        self.encoder = nn.ModuleList(Block(cfg) for _ in range(layers))
        self.enc_norm = nn.LayerNorm(dim)
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(layers))
        self.dec_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, src, tgt):
        memory = self.src_emb(src)
        for layer in self.encoder:
            memory = layer(memory)
        memory = self.enc_norm(memory)
        x = self.tgt_emb(tgt)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.head(self.dec_norm(x))


class CrossAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.out = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x, memory):
        k, v = self.kv(memory).chunk(2, dim=-1)
        scores = self.q(x) @ k.transpose(-1, -2) / math.sqrt(x.shape[-1])
        return self.out(scores.softmax(-1) @ v)


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(cfg.dim) for _ in range(3))
        self.self_attn = CausalSelfAttention(cfg)
        self.cross_attn = CrossAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, memory):
        x = x + self.self_attn(self.ln1(x))
        x = x + self.cross_attn(self.ln2(x), memory)
        return x + self.mlp(self.ln3(x))


class ResidualMLP(nn.Module):
    """An MLP with its own inner residual chain: nested inside the outer stream's branch."""

    def __init__(self, dim):
        super().__init__()
        self.inner = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
                                   for _ in range(2))

    def forward(self, x):
        for layer in self.inner:
            x = x + layer(x)
        return x


class NestedModel(nn.Module):
    def __init__(self, dim=32, layers=2, vocab=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.mlps = nn.ModuleList(ResidualMLP(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return self.head(x)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RopeAttention(nn.Module):
    """Attention with RoPE (``q*cos + rotate(q)*sin``) and an additive mask: adds that are no sites."""

    HEADS = 4

    def __init__(self, dim):
        super().__init__()
        self.heads = self.HEADS
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q = q.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + mask
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class BiasMLP(nn.Module):
    """``x @ W + b`` written out, and GELU's ``x + 0.044715 * x**3`` by hand."""

    def __init__(self, dim):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(dim, 2 * dim) * 0.1)
        self.b1 = nn.Parameter(torch.zeros(2 * dim))
        self.w2 = nn.Parameter(torch.randn(2 * dim, dim) * 0.1)
        self.b2 = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        h = x @ self.w1 + self.b1
        h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        return h @ self.w2 + self.b2


class RopeModel(nn.Module):
    """Llama-like: RMSNorm, RoPE, additive causal mask, hand-written MLP; tok + pos embedding too."""

    def __init__(self, dim=32, layers=2, vocab=64, max_len=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.attn_norms = nn.ModuleList(nn.RMSNorm(dim) for _ in range(layers))
        self.attns = nn.ModuleList(RopeAttention(dim) for _ in range(layers))
        self.mlp_norms = nn.ModuleList(nn.RMSNorm(dim) for _ in range(layers))
        self.mlps = nn.ModuleList(BiasMLP(dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        half = dim // RopeAttention.HEADS // 2
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half)),
                             persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        mask = torch.full((t, t), float("-inf"), device=ids.device).triu(1)
        angles = torch.arange(t, device=ids.device).float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        for attn_norm, attn, mlp_norm, mlp in zip(self.attn_norms, self.attns, self.mlp_norms, self.mlps):
            x = x + attn(attn_norm(x), cos, sin, mask)
            x = x + mlp(mlp_norm(x))
        return self.head(self.norm(x))


class PostNormLayer(nn.Module):
    """BERT-style: ``norm(x + f(x))``."""

    def __init__(self, dim):
        super().__init__()
        self.attn = CausalSelfAttention(TinyConfig(dim=dim, num_heads=4))
        self.ln1 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ln2 = nn.LayerNorm(dim)

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ff(x))


class PostNormModel(nn.Module):
    def __init__(self, dim=32, layers=2, vocab=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.emb_norm = nn.LayerNorm(dim)
        self.layers = nn.ModuleList(PostNormLayer(dim) for _ in range(layers))

    def forward(self, ids):
        x = self.emb_norm(self.emb(ids))
        for layer in self.layers:
            x = layer(x)
        return x


class NoResidualModel(nn.Module):
    """Adds, but none of them residual: tok + pos, a bias add, GELU's cubic term."""

    def __init__(self, dim=32, vocab=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.mlp = BiasMLP(dim)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.mlp(x)


class DataDependentModel(nn.Module):
    """Python control flow on tensor values: torch.fx cannot trace it."""

    def __init__(self, dim=32):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        if x.sum() > 0:
            return x + self.lin(x)
        return x


class RawBranchModel(nn.Module):
    """Sublayers read the stream raw (no pre-norm)."""

    def __init__(self, dim=32, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
                                    for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def make_inputs(vocab=64, batch=2, seq=8, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


__all__ = ["EncoderDecoder", "NestedModel", "RopeModel", "PostNormModel", "NoResidualModel",
           "DataDependentModel", "RawBranchModel", "make_inputs", "F"]


class NanoBlock(nn.Module):
    def __init__(self, dim, heads, dropout, checkpoint):
        super().__init__()
        cfg = TinyConfig(dim=dim, num_heads=heads)
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(dim), CausalSelfAttention(cfg), nn.LayerNorm(dim), MLP(cfg)
        self.drop = nn.Dropout(dropout)
        self.checkpoint = checkpoint

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class NanoGPT(nn.Module):
    """A nanoGPT-style model as people write them: ``forward(idx, targets=None)`` returning ``(logits,
    loss)``, dropout, a frozen positional table computed under ``no_grad``, the head under autocast
    (bf16 on CPU), optional activation checkpointing of every block, and a method of its own."""

    def __init__(self, vocab=64, dim=32, layers=2, heads=4, block_size=32, dropout=0.1, checkpoint=False,
                 autocast_head=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(NanoBlock(dim, heads, dropout, checkpoint) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.checkpoint = checkpoint
        self.autocast_head = autocast_head
        self.note = "a plain attribute"

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        with torch.no_grad():                      # positions are frozen: no gradient reaches wpe
            pos = self.wpe(torch.arange(t, device=idx.device))
        x = self.drop(self.wte(idx) + pos)
        for block in self.h:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        if self.autocast_head:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = self.lm_head(x)
        else:
            logits = self.lm_head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
