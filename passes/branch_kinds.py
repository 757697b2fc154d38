"""Branch kinds: what a site's sublayer does, from data flow ('attn', 'mixer', 'mlp', 'branch'), so that
renamed modules keep their kinds and no architecture is recognised by class name."""

from __future__ import annotations

from torch import fx

from . import node_kinds as nk
from . import provenance
from .dataflow import DataFlow

# The kinds that mix positions: a sublayer of their own, never merged with a channel mixer.
TOKEN_MIXING = ("attn", "mixer")


def branch_kind(region: frozenset[fx.Node], gm: fx.GraphModule, flow: DataFlow, param_derived: set[fx.Node]) -> str:
    """What a branch does, from data flow: 'attn' if it attends (SDPA, or a softmax over products of
    activations such as ``q @ k^T``), 'mlp' if it routes tokens to experts (top-k) or is position-wise
    with a nonlinearity, 'mixer' if it otherwise mixes positions (a scan, a cumulative sum, a
    linear-attention product, a loop over positions, a convolution over them). Module names only
    label a branch the data flow leaves undecided."""
    if any(nk.is_attention_op(n, gm) or (nk.is_softmax(n) and _scores_products(n, region, flow, param_derived))
           for n in region):
        return "attn"
    if any(nk.is_routing(n) for n in region):
        return "mlp"
    if _mixes_positions(region, gm, param_derived):
        return "mixer"
    if any(nk.is_activation(n, gm) for n in region):
        return "mlp"
    names = " ".join(provenance.node_module_path(n) for n in region if n.op != "get_attr").lower()
    if any(hint in names for hint in ("self_attn", "attention", ".attn")):
        return "attn"
    if any(hint in names for hint in ("mixer", "ssm", "mamba")):
        return "mixer"
    if any(hint in names for hint in ("mlp", "ffn", "feed_forward", "feedforward")):
        return "mlp"
    return "branch"

def _scores_products(softmax: fx.Node, region: frozenset[fx.Node], flow: DataFlow, param_derived: set[fx.Node]) -> bool:
    """Whether the softmax normalises scores computed by a product of two activations."""
    seen, todo = {softmax}, [softmax]
    while todo:
        for parent in flow.parents(todo.pop()):
            if parent in region and parent not in seen:
                if nk.is_activation_product(parent, param_derived):
                    return True
                seen.add(parent)
                todo.append(parent)
    return False

def _mixes_positions(region: frozenset[fx.Node], gm: fx.GraphModule, param_derived: set[fx.Node]) -> bool:
    if any(nk.is_scan(n, gm) or nk.is_activation_product(n, param_derived) for n in region):
        return True
    steps: dict[tuple[fx.Node, int], set] = {}
    for node in region:
        step = nk.position_index(node)
        if step is not None:
            steps.setdefault(step[:2], set()).add(str(step[2]))
    return any(len(indices) > 1 for indices in steps.values())
