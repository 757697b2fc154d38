"""A family of random pre-norm architectures, each with a native Block AttnRes forward: the oracle of the
property tests.

An :class:`Architecture` picks, for one model, how its norms are written, how the residual adds are
spelled, whether layers are sequential or parallel, whether branch outputs are normalised again
(post-branch norms), learned positions, tied embeddings, each layer's token mixer and MLP, and whether
the stream is reshaped to ``[batch * seq, d]`` around some sites. :class:`FamilyModel` is that model, as
people write it. :func:`attnres_forward` runs the same weights with the residual stream replaced by
Block AttnRes, written from the method's pseudo-code (docs/method.md, section 3) and sharing no code with
the passes: sources are the committed blocks and the partial sum, read before the block boundary; a
block start commits the partial sum; each branch of a parallel layer has its own query and reads the
aggregate taken before the site; the final aggregation comes before the final norm.

    arch = Architecture(depth=2, norm="layernorm", residual="plus", parallel=False, post_norm=False,
                        learned_positions=True, tied_embeddings=False, mixers=("sdpa", "scan"),
                        mlps=("gelu", "moe"), reshape="none")
    model = FamilyModel(arch)
    logits = model(ids)                                             # ids: [batch, arch.length]
    # one (pseudo-query [1, D], key-norm weight [D]) per aggregation, e.g. zero queries (the mean):
    native = attnres_forward(model, ids, lambda site, kind: (torch.zeros(1, 16), torch.ones(16)),
                             block_size=2)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .reference import block_attn_res

NORMS = ("layernorm", "rmsnorm", "nn_rmsnorm", "functional", "cast_rmsnorm")
RESIDUALS = ("plus", "iadd", "torch_add", "branch_first", "pre_summed")
MIXERS = ("sdpa", "masked_attention", "scan")
MLPS = ("gelu", "gated", "moe")
RESHAPES = ("none", "reshape", "flatten")
MIXER_KINDS = {"sdpa": "attn", "masked_attention": "attn", "scan": "mixer"}


@dataclass(frozen=True)
class Architecture:
    """One model of the family.

    ``residual``: ``x = x + f`` ("plus"), ``x += f`` ("iadd"), ``torch.add(x, f)``, ``x = f + x``
    ("branch_first"), or for parallel layers ``x + (mixer + mlp)`` ("pre_summed"; "iadd" there sums the
    branches in place: ``m = mixer; m += mlp; x = x + m``). ``reshape``: the MLP site of a sequential
    layer (a parallel layer's whole site) runs on the stream reshaped to ``[batch * seq, d]``, by
    ``reshape``/``view`` or ``flatten``/``unflatten``; "none" keeps ``[batch, seq, d]``.
    """

    depth: int
    norm: str
    residual: str
    parallel: bool
    post_norm: bool
    learned_positions: bool
    tied_embeddings: bool
    mixers: tuple[str, ...]
    mlps: tuple[str, ...]
    reshape: str
    dim: int = 16
    heads: int = 2
    vocab: int = 32
    length: int = 6

    @property
    def num_sites(self) -> int:
        return self.depth if self.parallel else 2 * self.depth

    def site_kinds(self) -> list[str]:
        """The kind of each residual site, as detection reports it (``attn+mlp`` for a parallel layer)."""
        kinds = []
        for mixer in self.mixers:
            mixing = MIXER_KINDS[mixer]
            kinds.extend([f"{mixing}+mlp"] if self.parallel else [mixing, "mlp"])
        return kinds


# -- norms ----------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """RMSNorm written out; ``casts``: in fp32 and back, as Llama-family code does."""

    def __init__(self, dim: int, casts: bool, eps: float = 1e-6):
        super().__init__()
        self.casts, self.eps = casts, eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        dtype = x.dtype
        h = x.float() if self.casts else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (h.to(dtype) if self.casts else h)


class FunctionalLayerNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))
        self.bias = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-5)


def make_norm(kind: str, dim: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(dim)
    if kind == "nn_rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6)
    if kind == "functional":
        return FunctionalLayerNorm(dim)
    return RMSNorm(dim, casts=kind == "cast_rmsnorm")


# -- token mixers ---------------------------------------------------------------------------------------

class SDPAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class MaskedAttention(nn.Module):
    """Attention written out: ``softmax(q k^T / sqrt(d) + mask) v`` with an additive causal mask (for
    ``length`` positions)."""

    def __init__(self, dim: int, heads: int, length: int):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.register_buffer("mask", torch.full((length, length), float("-inf")).triu(1), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + self.mask
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class SelectiveScan(nn.Module):
    """A small selective scan: decays and inputs computed from the data, a loop over the positions whose
    outputs are stacked."""

    def __init__(self, dim: int, length: int, state: int = 4):
        super().__init__()
        self.length = length
        self.in_proj, self.delta = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.b, self.c = nn.Linear(dim, state), nn.Linear(dim, state)
        self.a = nn.Parameter(-torch.rand(dim, state) - 0.1)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        u = self.in_proj(x)
        delta, b_in, c_out = F.softplus(self.delta(u)), self.b(u), self.c(u)
        state = x.new_zeros(x.shape[0], x.shape[-1], self.a.shape[1])
        steps = []
        for t in range(self.length):
            step = delta[:, t, :, None]
            state = torch.exp(step * self.a) * state + step * b_in[:, t, None, :] * u[:, t, :, None]
            steps.append((state * c_out[:, t, None, :]).sum(-1))
        return self.out(torch.stack(steps, dim=1))


def make_mixer(kind: str, arch: Architecture) -> nn.Module:
    if kind == "sdpa":
        return SDPAttention(arch.dim, arch.heads)
    if kind == "masked_attention":
        return MaskedAttention(arch.dim, arch.heads, arch.length)
    return SelectiveScan(arch.dim, arch.length)


# -- MLPs -------------------------------------------------------------------------------------------------

class GeluMLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class GatedMLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoEMLP(nn.Module):
    """A shared expert plus top-2 of 3 routed experts, gated by the router's renormalised softmax
    weights (every expert runs on every token: static shapes)."""

    def __init__(self, dim: int, experts: int = 3, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(dim) for _ in range(experts))
        self.shared = GeluMLP(dim)

    def forward(self, x):
        logits = self.router(x)
        weights, chosen = logits.softmax(-1).topk(self.top_k, dim=-1)
        gates = torch.zeros_like(logits).scatter(-1, chosen, weights / weights.sum(-1, keepdim=True))
        routed = sum(gates[..., e, None] * expert(x) for e, expert in enumerate(self.experts))
        return self.shared(x) + routed


def make_mlp(kind: str, dim: int) -> nn.Module:
    return {"gelu": GeluMLP, "gated": GatedMLP, "moe": MoEMLP}[kind](dim)


# -- layers and the model -------------------------------------------------------------------------------

class FamilyLayer(nn.Module):
    """One layer: a token mixer and an MLP, each behind its pre-norm (and post-norm), added to the
    stream as the architecture spells it."""

    def __init__(self, arch: Architecture, index: int):
        super().__init__()
        self.arch = arch
        self.mixer_kind = MIXER_KINDS[arch.mixers[index]]
        dim = arch.dim
        self.mixer_norm, self.mixer = make_norm(arch.norm, dim), make_mixer(arch.mixers[index], arch)
        self.mlp_norm, self.mlp = make_norm(arch.norm, dim), make_mlp(arch.mlps[index], dim)
        if arch.post_norm:
            self.mixer_post, self.mlp_post = make_norm(arch.norm, dim), make_norm(arch.norm, dim)

    def mixer_branch(self, h):
        """The token-mixing sublayer on a ``[batch, seq, d]`` stream value."""
        out = self.mixer(self.mixer_norm(h))
        return self.mixer_post(out) if self.arch.post_norm else out

    def mlp_branch(self, h):
        """The MLP sublayer (position-wise: any leading shape)."""
        out = self.mlp(self.mlp_norm(h))
        return self.mlp_post(out) if self.arch.post_norm else out

    def sites(self) -> list[list[tuple[str, Callable]]]:
        """The residual sites of this layer for :func:`attnres_forward`: per site, its branches as
        ``(kind, function)``, each function mapping a ``[batch, seq, d]`` value to its output."""
        mixer = (self.mixer_kind, self.mixer_branch)
        mlp = ("mlp", self.mlp_branch)
        return [[mixer, mlp]] if self.arch.parallel else [[mixer], [mlp]]

    def forward(self, x):
        b, t, d = x.shape
        if self.arch.parallel:
            h = self._flatten(x)
            h = self._parallel_site(h, lambda u: self.mixer_branch(u.reshape(b, t, d)).reshape(u.shape))
            return self._unflatten(h, b, t)
        x = self._add(x, self.mixer_branch(x))
        h = self._flatten(x)
        h = self._add(h, self.mlp_branch(h))
        return self._unflatten(h, b, t)

    def _flatten(self, x):
        return {"none": x, "reshape": x.reshape(-1, x.shape[-1]), "flatten": x.flatten(0, 1)}[self.arch.reshape]

    def _unflatten(self, h, b, t):
        if self.arch.reshape == "reshape":
            return h.view(b, t, h.shape[-1])
        return h.unflatten(0, (b, t)) if self.arch.reshape == "flatten" else h

    def _add(self, x, out):
        spelling = self.arch.residual
        if spelling == "iadd":
            x += out
            return x
        if spelling == "torch_add":
            return torch.add(x, out)
        if spelling == "branch_first":
            return out + x
        return x + out

    def _parallel_site(self, h, mixer):
        spelling = self.arch.residual
        if spelling == "pre_summed":
            return h + (mixer(h) + self.mlp_branch(h))
        if spelling == "iadd":
            summed = mixer(h)
            summed += self.mlp_branch(h)
            return h + summed
        if spelling == "torch_add":
            return torch.add(torch.add(h, mixer(h)), self.mlp_branch(h))
        if spelling == "branch_first":
            return mixer(h) + self.mlp_branch(h) + h
        return h + mixer(h) + self.mlp_branch(h)


class FamilyModel(nn.Module):
    """Token (and position) embeddings, the layers, a final norm and the head (tied to the token
    embedding or not): ``ids [batch, length] -> logits``."""

    def __init__(self, arch: Architecture):
        super().__init__()
        self.arch = arch
        self.tok = nn.Embedding(arch.vocab, arch.dim)
        if arch.learned_positions:
            self.pos = nn.Embedding(arch.length, arch.dim)
        self.layers = nn.ModuleList(FamilyLayer(arch, i) for i in range(arch.depth))
        self.final_norm = make_norm(arch.norm, arch.dim)
        if not arch.tied_embeddings:
            self.head = nn.Linear(arch.dim, arch.vocab, bias=False)

    def embed(self, ids):
        x = self.tok(ids)
        if self.arch.learned_positions:
            x = x + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return x

    def logits(self, h):
        h = self.final_norm(h)
        return F.linear(h, self.tok.weight) if self.arch.tied_embeddings else self.head(h)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.logits(x)


# -- the oracle -------------------------------------------------------------------------------------------

Query = tuple[torch.Tensor, torch.Tensor]          # (pseudo-query [1, D], key-norm weight [D])


def attnres_forward(model: FamilyModel, ids: torch.Tensor, query: Callable[[int | None, str], Query], *,
                    block_size: int, preserve_scale: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """``model`` with its residual stream replaced by Block AttnRes (see the module docstring).

    ``query(site, kind)`` gives the weights of the aggregation for branch ``kind`` (``"attn"``,
    ``"mixer"``, ``"mlp"``) of residual site ``site`` (counted over the model), and ``query(None,
    "final")`` those of the final aggregation.
    """
    def aggregate(blocks, partial, weights):
        proj = nn.Linear(model.arch.dim, 1, bias=False)
        norm = nn.RMSNorm(model.arch.dim, eps=eps)
        with torch.no_grad():
            proj.weight.copy_(weights[0])
            norm.weight.copy_(weights[1])
        return block_attn_res(blocks, partial, proj, norm, preserve_scale=preserve_scale)

    partial, blocks = model.embed(ids), []
    site = 0
    for layer in model.layers:
        for branches in layer.sites():
            inputs = [aggregate(blocks, partial, query(site, kind)) for kind, _ in branches]
            if site % block_size == 0:
                blocks.append(partial)
                partial = None
            out = sum(function(h) for (_, function), h in zip(branches, inputs))
            partial = out if partial is None else partial + out
            site += 1
    return model.logits(aggregate(blocks, partial, query(None, "final")))
