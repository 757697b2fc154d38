"""Plain-PyTorch Block AttnRes, written to follow the method's reference pseudo-code line by line.

This is the oracle the graph rewrite is tested against: it shares no code with the pass or with
:class:`attnres_fx.BlockAttnRes`. ``block_attn_res`` stacks the sources, RMS-normalises them as keys,
scores them with the pseudo-query and takes the softmax-weighted sum of the un-normalised values.

``AttnResTransformer`` is :class:`attnres_fx.models.TinyTransformer` with the residual stream replaced
natively: per layer ``attn_res_proj/attn_res_norm`` and ``mlp_res_proj/mlp_res_norm``, plus
``final_res_proj/final_res_norm`` before the final norm. Block boundaries are counted in sublayers
(residual sites): the aggregate for site ``j`` is read *before* the boundary, and if ``j % block_size
== 0`` the partial sum is committed as a block (site 0 commits the embedding). A parallel layer is one
site whose two branches have separate pseudo-queries.
"""

from __future__ import annotations

import torch
from torch import nn

from attnres_fx.models import TinyConfig, TinyTransformer


def block_attn_res(blocks: list[torch.Tensor], partial_block: torch.Tensor, proj: nn.Linear,
                   norm: nn.Module, *, preserve_scale: bool = False) -> torch.Tensor:
    """Attention over ``blocks + [partial_block]`` with the pseudo-query ``proj.weight`` ([1, D])."""
    values = torch.stack(blocks + [partial_block])                          # [N+1, B, T, D]
    keys = norm(values.float())
    logits = torch.einsum("d, n b t d -> n b t", proj.weight.squeeze(0).float(), keys)
    h = torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), values.float())
    if preserve_scale:
        h = h * values.shape[0]
    return h.to(partial_block.dtype)


class _ResidualQuery(nn.Module):
    """Only a container so that parameter names read ``blocks.3.attn_res_proj.weight``."""


class AttnResTransformer(nn.Module):
    def __init__(self, cfg: TinyConfig, block_size: int, *, eps: float = 1e-6,
                 preserve_scale: bool = False):
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.preserve_scale = preserve_scale
        base = TinyTransformer(cfg)
        self.config = cfg
        self.tok_emb, self.pos_emb, self.blocks = base.tok_emb, base.pos_emb, base.blocks
        self.ln_f, self.head = base.ln_f, base.head
        for block in self.blocks:
            for kind in ("attn", "mlp"):
                block.add_module(f"{kind}_res_proj", nn.Linear(cfg.dim, 1, bias=False))
                block.add_module(f"{kind}_res_norm", nn.RMSNorm(cfg.dim, eps=eps))
                nn.init.zeros_(getattr(block, f"{kind}_res_proj").weight)
        self.final_res_proj = nn.Linear(cfg.dim, 1, bias=False)
        self.final_res_norm = nn.RMSNorm(cfg.dim, eps=eps)
        nn.init.zeros_(self.final_res_proj.weight)

    @classmethod
    def from_standard(cls, model: TinyTransformer, block_size: int, **kwargs) -> "AttnResTransformer":
        """A native AttnRes model holding copies of ``model``'s weights (pseudo-queries at zero)."""
        native = cls(model.config, block_size, **kwargs)
        missing, unexpected = native.load_state_dict(model.state_dict(), strict=False)
        if unexpected or any("_res_" not in key for key in missing):
            raise RuntimeError(f"weights do not match: missing={missing}, unexpected={unexpected}")
        return native

    def _aggregate(self, blocks, partial, proj, norm):
        return block_attn_res(blocks, partial, proj, norm, preserve_scale=self.preserve_scale)

    def _site(self, blocks, partial, site, queries, branch):
        """One residual site: aggregate before the boundary, commit at a block start, add the output."""
        inputs = [self._aggregate(blocks, partial, proj, norm) for proj, norm in queries]
        if site % self.block_size == 0:
            blocks.append(partial)
            partial = None
        out = branch(*inputs)
        return out if partial is None else partial + out

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        partial = self.tok_emb(ids) + self.pos_emb(positions)
        blocks: list[torch.Tensor] = []
        site = 0
        for block in self.blocks:
            attn_query = (block.attn_res_proj, block.attn_res_norm)
            mlp_query = (block.mlp_res_proj, block.mlp_res_norm)

            def attn(h, block=block):
                return block.attn(block.ln1(h))

            def mlp(h, block=block):
                return block.mlp(block.ln2(h))

            if block.parallel:
                partial = self._site(blocks, partial, site, [attn_query, mlp_query],
                                     lambda h_attn, h_mlp: attn(h_attn) + mlp(h_mlp))
                site += 1
            else:
                partial = self._site(blocks, partial, site, [attn_query], attn)
                partial = self._site(blocks, partial, site + 1, [mlp_query], mlp)
                site += 2
        h = self._aggregate(blocks, partial, self.final_res_proj, self.final_res_norm)
        return self.head(self.ln_f(h))
