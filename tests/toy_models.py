"""Small hand-written models for detection tests: things that must and must not be found."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from attnres_fx.models import MLP, Block, CausalSelfAttention, ManualRMSNorm, TinyConfig


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
    """Python control flow on tensor values around a residual stream the model's own forward performs:
    neither torch.fx nor TorchDynamo (in one graph) can capture it."""

    def __init__(self, dim=32):
        super().__init__()
        self.lin, self.lin2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        if x.abs().sum() > 0:
            x = x + self.lin(x)
            return x + self.lin2(x)
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


class MaskedSelfAttention(nn.Module):
    """nanoGPT's attention without flash: the causal mask a buffer sliced to the sequence length
    (``self.bias[:, :, :T, :T]``), which torch.fx cannot trace without example inputs."""

    def __init__(self, dim, heads, block_size):
        super().__init__()
        self.c_attn, self.c_proj, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class NanoBlock(nn.Module):
    def __init__(self, dim, heads, dropout, checkpoint, mask_buffer=False, block_size=32):
        super().__init__()
        cfg = TinyConfig(dim=dim, num_heads=heads)
        attn = MaskedSelfAttention(dim, heads, block_size) if mask_buffer else CausalSelfAttention(cfg)
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(dim), attn, nn.LayerNorm(dim), MLP(cfg)
        self.drop = nn.Dropout(dropout)
        self.checkpoint = checkpoint

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class NanoGPT(nn.Module):
    """A nanoGPT-style model as people write them: ``forward(idx, targets=None)`` returning ``(logits,
    loss)``, dropout, a frozen positional table computed under ``no_grad``, the head under autocast
    (bf16 on CPU), optional activation checkpointing of every block, and a method of its own;
    ``mask_buffer``: attention with nanoGPT's causal-mask buffer instead of SDPA's ``is_causal``."""

    def __init__(self, vocab=64, dim=32, layers=2, heads=4, block_size=32, dropout=0.1, checkpoint=False,
                 autocast_head=False, mask_buffer=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(NanoBlock(dim, heads, dropout, checkpoint, mask_buffer, block_size)
                               for _ in range(layers))
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


# -- the shapes a residual stream takes in real code ------------------------------------------------------

DIM = 32
LENGTH = 8            # sequence length of make_inputs(); the scan mixers loop over exactly this many steps


class LayerStack(nn.Module):
    """Embedding, ``layers`` (each adds its own residuals), a final LayerNorm and a head."""

    def __init__(self, layers, dim=DIM, vocab=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def attention(dim=DIM):
    return CausalSelfAttention(TinyConfig(dim=dim, num_heads=4))


def mlp(dim=DIM):
    return MLP(TinyConfig(dim=dim, mlp_ratio=2))


class AttentionLayer(nn.Module):
    """A pre-norm layer, ``x + attn(ln1(x))`` then ``+ mlp(ln2(x))``; ``mlp_layer``: its MLP half (default:
    :func:`mlp`, built after the attention). The layers below that change its forward subclass it."""

    def __init__(self, mlp_layer=None, dim=DIM):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(dim), attention(dim), nn.LayerNorm(dim)
        self.mlp = mlp(dim) if mlp_layer is None else mlp_layer

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ReshapedMLPLayer(AttentionLayer):
    """The MLP half runs on the tokens flattened to ``[batch * seq, d]``, the stream itself reshaped
    there and back: ``spelling`` "reshape" (``reshape(-1, d)`` / ``view(b, t, d)``) or "flatten"
    (``flatten(0, 1)`` / ``unflatten(0, (b, t))`` then ``contiguous()``)."""

    def __init__(self, spelling, dim=DIM):
        super().__init__(dim=dim)
        self.spelling = spelling

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        b, t, d = x.shape
        h = x.reshape(-1, d) if self.spelling == "reshape" else x.flatten(0, 1)
        h = h + self.mlp(self.ln2(h))
        return h.view(b, t, d) if self.spelling == "reshape" else h.unflatten(0, (b, t)).contiguous()


class PreSummedLayer(nn.Module):
    """``x + (attn(u) + mlp(u))`` with one shared norm ``u``; ``in_place``: ``m = attn(u); m += mlp(u)``."""

    def __init__(self, in_place, dim=DIM):
        super().__init__()
        self.in_place = in_place
        self.ln, self.attn, self.mlp = nn.LayerNorm(dim), attention(dim), mlp(dim)

    def forward(self, x):
        u = self.ln(x)
        if self.in_place:
            m = self.attn(u)
            m += self.mlp(u)
        else:
            m = self.attn(u) + self.mlp(u)
        return x + m


class RoutedExperts(nn.Module):
    """Top-k routing as mixture-of-experts code writes it: a softmax router, top-k, every expert on every
    token (static shapes), the chosen outputs gathered and summed back per token with index_add."""

    def __init__(self, dim=DIM, experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(mlp(dim) for _ in range(experts))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        outputs = torch.stack([expert(tokens) for expert in self.experts], dim=1)
        picked = outputs.gather(1, chosen.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
        owner = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)
        routed = torch.zeros_like(tokens).index_add(0, owner, (picked * weights.unsqueeze(-1)).flatten(0, 1))
        return routed.view(x.shape)


class MoE(nn.Module):
    """Routed experts plus a shared expert, summed: one MLP sublayer."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.routed = RoutedExperts(dim)
        self.shared = mlp(dim)

    def forward(self, x):
        return self.routed(x) + self.shared(x)


class MoELayer(nn.Module):
    """Attention then a mixture of experts; ``parallel``: ``x + attn(u) + routed(u) + shared(u)``."""

    def __init__(self, parallel, dim=DIM):
        super().__init__()
        self.parallel = parallel
        self.ln1, self.attn, self.ln2, self.moe = nn.LayerNorm(dim), attention(dim), nn.LayerNorm(dim), MoE(dim)

    def forward(self, x):
        if self.parallel:
            u = self.ln1(x)
            return x + self.attn(u) + self.moe.routed(u) + self.moe.shared(u)
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class DropoutLayer(AttentionLayer):
    """Dropout on a branch output and on the stream, a dtype round trip on a branch output and on the
    stream between the sites."""

    def __init__(self, dim=DIM, p=0.2):
        super().__init__(dim=dim)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        x = self.drop(x).double().to(torch.float32)
        return x + self.mlp(self.ln2(x)).double().to(x.dtype)


class ParallelManualNormLayer(nn.Module):
    """GPT-NeoX-style parallel layer whose two norms are RMSNorm written out with fp32 casts."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.ln1, self.ln2 = ManualRMSNorm(dim, 1e-6), ManualRMSNorm(dim, 1e-6)
        self.attn, self.mlp = attention(dim), mlp(dim)

    def forward(self, x):
        return x + self.attn(self.ln1(x)) + self.mlp(self.ln2(x))


class SelectiveScan(nn.Module):
    """A small Mamba-style selective scan: per-step decays and inputs from the data, a loop over time
    writing each step's output into a preallocated buffer (``y[:, t] = ...``)."""

    def __init__(self, dim=DIM, state=4, length=LENGTH):
        super().__init__()
        self.length = length
        self.in_proj = nn.Linear(dim, dim)
        self.delta, self.b, self.c = nn.Linear(dim, dim), nn.Linear(dim, state), nn.Linear(dim, state)
        self.a = nn.Parameter(-torch.rand(dim, state))
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        u = self.in_proj(x)
        delta, b_in, c_out = F.softplus(self.delta(u)), self.b(u), self.c(u)
        state = x.new_zeros(x.shape[0], x.shape[-1], self.a.shape[1])
        y = u.new_zeros(u.shape)
        for t in range(self.length):
            step = delta[:, t, :, None]
            state = torch.exp(step * self.a) * state + step * b_in[:, t, None, :] * u[:, t, :, None]
            y[:, t] = (state * c_out[:, t, None, :]).sum(-1)
        return self.out(y)


class RecurrentLinearAttention(nn.Module):
    """Linear attention as a recurrence: a state updated per step; ``collect`` "stack" gathers the steps'
    outputs in a list and stacks them, "copy" copies each into a preallocated buffer, "index_put"
    writes them with ``index_put_``."""

    def __init__(self, collect, dim=DIM, length=LENGTH):
        super().__init__()
        self.collect, self.length = collect, length
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = F.elu(self.qkv(x)).add(1).split(x.shape[-1], dim=-1)
        state = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        steps, buffer = [], x.new_zeros(x.shape)
        for t in range(self.length):
            state = state + k[:, t, :, None] * v[:, t, None, :]
            y = torch.bmm(q[:, t, None, :], state).squeeze(1)
            if self.collect == "stack":
                steps.append(y)
            elif self.collect == "copy":
                buffer.select(1, t).copy_(y)
            else:
                buffer.index_put_((torch.arange(x.shape[0], device=x.device), torch.tensor(t)), y)
        return self.out(torch.stack(steps, dim=1) if self.collect == "stack" else buffer)


class ChunkedLinearAttention(nn.Module):
    """Linear attention in parallel form: the running state is a cumulative sum over positions."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = F.elu(self.qkv(x)).add(1).split(x.shape[-1], dim=-1)
        states = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=1)
        return self.out((q.unsqueeze(-2) @ states).squeeze(-2))


@torch.library.custom_op("attnres_tests::decay_scan", mutates_args=())
def decay_scan(x: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``y_t = decay * y_{t-1} + x_t`` over dim 1: a scan kernel as a custom op."""
    steps, y = [], torch.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        y = decay * y + x[:, t]
        steps.append(y)
    return torch.stack(steps, dim=1)


@decay_scan.register_fake
def _(x, decay):
    return torch.empty_like(x)


class CustomScanMixer(nn.Module):
    """A mixer whose scan is a custom op: data flows through it only via its inputs."""

    def __init__(self, dim=DIM):
        super().__init__()
        self.in_proj, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.decay = nn.Parameter(torch.full((dim,), 0.9))

    def forward(self, x):
        return self.out(decay_scan(self.in_proj(x), self.decay))


class MixerLayer(nn.Module):
    """``x + mixer(norm(x))`` (state-space style: no MLP) or, with ``mlp``, followed by an MLP or MoE."""

    def __init__(self, mixer, mlp_layer=None, dim=DIM):
        super().__init__()
        self.norm, self.mixer = nn.RMSNorm(dim), mixer
        self.ln2, self.mlp = (nn.RMSNorm(dim), mlp_layer) if mlp_layer is not None else (None, None)

    def forward(self, x):
        x = x + self.mixer(self.norm(x))
        if self.mlp is not None:
            x = x + self.mlp(self.ln2(x))
        return x


class CastResidualLayer(nn.Module):
    """``residual = x.to(float32); x = residual + mixer(norm(x))``: the residual operand is a cast of
    the value the branch reads (Mamba's ``residual_in_fp32``), so neither operand is computed from the
    other."""

    def __init__(self, mixer, dim=DIM):
        super().__init__()
        self.norm, self.mixer = nn.RMSNorm(dim), mixer

    def forward(self, x):
        residual = x.to(torch.float32)
        return residual + self.mixer(self.norm(x))


class InputSumLayer(AttentionLayer):
    """``h + mlp(norm(h + attn(ln(h))))``: an attention output added to the stream only as the input of
    the MLP that follows, one residual add per layer (Zamba2's hybrid layers)."""

    def forward(self, x):
        return x + self.mlp(self.ln2(x + self.attn(self.ln1(x))))


class HalvingStack(LayerStack):
    """Layers whose stream is halved after layer 1 (an fp16 range guard, as RWKV's ``rescale_every``):
    an op on the whole stream between two layers."""

    def __init__(self, layers=4):
        super().__init__([AttentionLayer(mlp()) for _ in range(layers)])

    def forward(self, ids):
        x = self.emb(ids)
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index == 1:
                x = x / 2
        return self.head(self.norm(x))


class SkipStack(LayerStack):
    """Layers with an extra add on the stream that is no residual site: ``kind`` "long_skip" adds the
    stream after layer 0 back after the last layer, "unet" before layer 2, "bias" adds a learned bias
    before layer 2."""

    def __init__(self, kind, layers=4):
        super().__init__([AttentionLayer(mlp()) for _ in range(layers)])
        self.kind = kind
        self.bias = nn.Parameter(torch.randn(DIM) * 0.1)

    def forward(self, ids):
        x = self.layers[0](self.emb(ids))
        skip = x
        for index, layer in enumerate(self.layers[1:], start=1):
            if index == 2 and self.kind != "long_skip":
                x = x + (skip if self.kind == "unet" else self.bias)
            x = layer(x)
        if self.kind == "long_skip":
            x = x + skip
        return self.head(self.norm(x))


class ScaledAddLayer(AttentionLayer):
    """``torch.add(x, f(x), alpha=alpha)``: a residual add whose branch is scaled by ``alpha``."""

    def __init__(self, alpha, dim=DIM):
        super().__init__(dim=dim)
        self.alpha = alpha

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return torch.add(x, self.mlp(self.ln2(x)), alpha=self.alpha)


class TorchTransformerEncoder(nn.Module):
    """``torch.nn.TransformerEncoder`` (pre-norm): every residual add is inside torch.nn's modules."""

    def __init__(self, dim=DIM, layers=2, vocab=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.head(self.encoder(self.emb(ids)))
