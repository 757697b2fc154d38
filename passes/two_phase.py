"""The paper's two-phase schedule (docs/method.md, section 5) as an fx pass over a rewritten GraphModule.

Pseudo-queries do not depend on the input, so all the sites that read the same completed blocks can be
scored against those blocks at once:

- phase 1, once per block: read each completed block once; its key scale ``rsqrt(mean(b^2) + eps)`` is
  computed there, once for all S queries (in the per-site form every site recomputes it), and so are its
  logits for all S queries (pseudo-queries with their key-norm weights folded in). The result is one
  online-softmax state per query: running max ``m``, sum of exponentials ``l`` (``[..., 1]``) and the
  un-normalised weighted sum of the blocks ``acc`` (``[..., D]``), all fp32;
- phase 2, per site: score the intra-block partial sum with the site's own query and merge it into its
  phase-1 state with an online-softmax update::

      M = max(m, z);  a = exp(m - M);  c = exp(z - M)
      h = (a * acc + c * partial) / (a * l + c)        (* number of sources with preserve_scale)

  This is the softmax over ``blocks + [partial]`` regrouped, not an approximation.

Contract
    requires  a GraphModule in the per-site form that :func:`attnres_fx.rewrite` returns:
              ``call_module`` nodes of :class:`~attnres_fx.BlockAttnRes` modules that carry their
              :class:`~attnres_fx.Site` (``module.site``), with the sources ``(*completed_blocks, partial)``
              as positional arguments.
    ensures   no ``call_module`` of a BlockAttnRes is left; every site reads a ``attnres_phase2_<site>``
              node; the graph lints.
    modifies  the graph only, in place. The BlockAttnRes modules stay registered and are read through
              ``get_attr`` nodes (their ``proj.weight`` and ``norm.weight``), so parameter names, the
              ``state_dict`` and :func:`attnres_fx.sites` are those of the per-site form: a checkpoint
              loads into either form, and gradients reach the same pseudo-queries.
              ``preserves_computation`` is True: the result equals the per-site form up to fp32
              rounding (about 1e-6 relative).

:func:`apply_two_phase_to_site_calls` is the same schedule for a graph whose aggregations are
:func:`~attnres_fx.op.module.run_site` calls (a layer-route block graph, what Inductor compiles for calls
without gradients): its phase nodes take the sites' modules, read when the graph runs, and a site whose
module would not run as a plain ``BlockAttnRes`` then (hooks, another module in its place) runs per site.

A *group* is the set of sites whose sources minus the last (the partial) are the very same nodes: the
sites of one block (and the stream's final aggregation, which reads the last block's completed set).
A site with no completed block (the first one, whose only source is the embedding) gets phase 2 alone,
which is the partial itself.

Worked example: 2 layers (4 sites), ``block_size=2``; ``at0`` / ``at1`` are the attention outputs,
``emb`` is ``b_0``, ``p1 = at0 + mlp_out_0`` becomes ``b_1`` at site 2, and ``p2 = at1 + mlp_out_1``::

    per-site form                       two-phase form
    a0 = blocks.0.attn_res(emb)         a0 = attnres_phase2_blocks_0_attn_res(emb)
    a1 = blocks.0.mlp_res(emb, at0)     attnres_phase1_block1 = phase1((w1, w2), (g1, g2), (emb,))
    a2 = blocks.1.attn_res(emb, p1)     a1 = attnres_phase2_blocks_0_mlp_res(<query0>, w1, g1, at0)
    a3 = blocks.1.mlp_res(emb, p1, at1) a2 = attnres_phase2_blocks_1_attn_res(<query1>, w2, g2, p1)
    fin = final_res(emb, p1, p2)        attnres_phase1_block2 = phase1((w3, w4), (g3, g4), (emb, p1))
                                        a3 = attnres_phase2_blocks_1_mlp_res(<query0>, w3, g3, at1)
                                        fin = attnres_phase2_final_res(<query1>, w4, g4, p2)

(``w_k`` / ``g_k`` are ``get_attr`` nodes of the sites' ``proj.weight`` / ``norm.weight``;
``<query s>`` is the ``attnres_phase1_block<n>_query<s>`` item of the phase-1 result; each phase-2
call also gets the site's first source: its result takes the dtype of that source and the partial
sum promoted, the stream's. Both phases compute in fp32 under ``torch.autocast`` too.)

The schedule is meant for inference: it reads each completed block once per block instead of once per
site. Measured on a 2-core CPU (``make bench``, op section; 4 x 256 tokens, d=512, 3 sites over 8
blocks): eagerly with the C++ phase kernels it costs what the per-site form does (the blocks fit in
cache), compiled 11% less; for one token its extra calls make it about twice as slow as the per-site
kernels, so a decoding step is better served by the per-site form. It is differentiable, but autograd
then keeps each site's ``acc`` (one fp32 stream tensor per site) for the backward pass, which the per-site form does not
need; train in the per-site form.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from attnres_fx.op import ops
from attnres_fx.op.aggregation import (
    autocast_on,
    depth_logit,
    folded_query,
    in_fp32,
    key_scale,
    negligible_to_zero,
    softmax_parts,
    weighted_sum,
)
from attnres_fx import compat
from attnres_fx.op.module import BlockAttnRes, captured, run_site
from attnres_fx.errors import PassContractError
from attnres_fx.op.kernels import cpu

SCHEDULE_META = "two_phase"


@in_fp32
def phase1(proj_weights: tuple[torch.Tensor, ...], norm_weights: tuple[torch.Tensor, ...],
           blocks: tuple[torch.Tensor, ...], *, eps: float) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Score S pseudo-queries against the completed ``blocks`` at once.

    Returns one online-softmax state per query: ``(m, l, acc)``, the running max and sum of
    exponentials of its logits (``[..., 1]``) and the un-normalised weighted sum of the blocks
    (``[..., D]``), all fp32. Each block's key scale is computed once, for all S queries.

    Run eagerly on the CPU without a gradient, it is the C++ kernel ``attnres_cpu::phase1`` (per token,
    each block row read once from memory, its S logits taken while it is in L1); under a graph capture,
    per-query reductions Inductor fuses into one pass over each block; otherwise (autograd, other
    devices) one matrix product of each block with the S stacked queries.
    """
    if _runs_kernel(blocks, proj_weights, norm_weights):
        return tuple(zip(*torch.ops.attnres_cpu.phase1(list(blocks), list(proj_weights), list(norm_weights), eps)))
    queries = [folded_query(p, n) for p, n in zip(proj_weights, norm_weights)]
    if torch.compiler.is_exporting():
        return _phase1_batched(queries, blocks, eps)
    values = [block.float() for block in blocks]
    scales = [key_scale(value, eps) for value in values]
    if captured(blocks[0]):
        # One matrix-vector product per query and block: Inductor turns each into a reduction and fuses
        # them all, with the key scales, into one pass over each block (a [D, S] matmul would stay an
        # external GEMM call that reads the block on its own).
        logits = [[torch.matmul(value, query).unsqueeze(-1) * scale for value, scale in zip(values, scales)]
                  for query in queries]
    else:
        stacked = torch.stack(queries, dim=-1)                                     # [D, S]
        products = [torch.matmul(value, stacked) * scale for value, scale in zip(values, scales)]
        logits = [[product[..., s:s + 1] for product in products] for s in range(len(queries))]
    states = []
    for query_logits in logits:
        top, exps, total = softmax_parts(query_logits)
        states.append((top, total, weighted_sum(exps, blocks)))
    return tuple(states)


def _phase1_batched(queries: list[torch.Tensor], blocks, eps: float):
    """Phase 1 as two batched matrix products over the blocks stacked along ``-2`` (``[..., N, D]``):
    logits ``B Q`` (``[..., N, S]``), then ``exp(...)^T B`` (``[..., S, D]``). The export form: ONNX
    runtimes run a MatMul as one kernel and each elementwise op as a pass over memory of its own."""
    values = torch.stack(blocks, dim=-2).float()
    scales = key_scale(values, eps)                                                   # [..., N, 1]
    logits = torch.matmul(values, torch.stack(queries, dim=-1)) * scales             # [..., N, S]
    top = logits.amax(dim=-2, keepdim=True)
    exps = negligible_to_zero(torch.exp(logits - top))
    total = exps.sum(dim=-2, keepdim=True)
    acc = torch.matmul(exps.transpose(-1, -2), values)                               # [..., S, D]
    return tuple((top[..., 0, s:s + 1], total[..., 0, s:s + 1], acc[..., s, :]) for s in range(len(queries)))


def phase2(state: tuple[torch.Tensor, torch.Tensor, torch.Tensor], proj_weight: torch.Tensor,
           norm_weight: torch.Tensor, partial: torch.Tensor, first: torch.Tensor, *, eps: float,
           scale: float) -> torch.Tensor:
    """Merge the partial sum into one query's phase-1 state; the result has the stream's dtype (``first``'s
    and ``partial``'s promoted).

    Eagerly on the CPU without a gradient, the C++ kernel ``attnres_cpu::phase2`` (one look at the
    partial and the state per token); otherwise PyTorch ops (fused by Inductor under a capture)."""
    if autocast_on(partial.device.type):
        with torch.autocast(partial.device.type, enabled=False):
            return phase2(state, proj_weight, norm_weight, partial, first, eps=eps, scale=scale)
    running_max, sum_exp, acc = state
    if (partial.dtype == first.dtype and acc.shape == partial.shape
            and _runs_kernel((partial,), (proj_weight,), (norm_weight,), state)):
        return torch.ops.attnres_cpu.phase2(acc, running_max, sum_exp, partial, proj_weight, norm_weight, eps,
                                            scale, first.dtype)
    value = partial.float()
    logit = depth_logit(value, folded_query(proj_weight, norm_weight), eps)
    top = torch.maximum(running_max, logit)
    # Negligible weights zero (Note [negligible weights] in attnres_fx/op/aggregation.py), as in phase 1.
    old = negligible_to_zero(torch.exp(running_max - top))
    new = negligible_to_zero(torch.exp(logit - top))
    inverse = scale / (old * sum_exp + new)
    # Normalised last: onnxruntime fuses an Add followed by a LayerNormalization into its
    # SkipLayerNormalization, which ran some 15x slower than the two apart (3.3 ms vs 0.2 ms per site).
    return (torch.addcmul(old * acc, new, partial) * inverse).to(torch.promote_types(first.dtype, partial.dtype))


def phase2_alone(partial: torch.Tensor, *, scale: float) -> torch.Tensor:
    """A site whose only source is the partial: the softmax over one source is 1."""
    return (partial.float() * scale).to(partial.dtype)


def _runs_kernel(sources, proj_weights, norm_weights, state=()) -> bool:
    """Whether the C++ phase kernels take this call: eager, CPU, no gradient wanted, uniform sources."""
    if sources[0].device.type != "cpu" or (torch.is_grad_enabled() and any(
            t.requires_grad for t in (*sources, *proj_weights, *norm_weights, *state))):
        return False
    return ops.uniform(sources) and not captured(sources[0]) and cpu.available()


@dataclass
class _AggregationCall:
    node: fx.Node
    module: BlockAttnRes

    @property
    def completed(self) -> tuple[fx.Node, ...]:
        return tuple(self.node.args[:-1])

    @property
    def scale(self) -> float:
        return float(len(self.node.args)) if self.module.preserve_scale else 1.0


class TwoPhaseSchedule(PassBase):
    """Rewrite the per-site aggregations of a GraphModule into the two-phase schedule, in place."""

    preserves_computation = True

    def requires(self, graph_module: fx.GraphModule) -> None:
        if not isinstance(graph_module, fx.GraphModule):
            raise ValueError(f"the two-phase schedule applies to a torch.fx.GraphModule, got "
                             f"{type(graph_module).__name__}")
        if graph_module.meta.get("attnres", {}).get("schedule") == SCHEDULE_META:
            raise ValueError("this GraphModule already uses the two-phase schedule")
        if not _sites(graph_module):
            raise ValueError("no BlockAttnRes aggregation is called in this graph: the two-phase schedule "
                             "applies to the GraphModule that attnres_fx.rewrite returns")

    def ensures(self, graph_module: fx.GraphModule) -> None:
        graph_module.graph.lint()
        left = [site.node.name for site in _sites(graph_module)]
        if left:
            raise PassContractError(f"per-site aggregations left after the two-phase rewrite: {left}")

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        groups: dict[tuple, list[_AggregationCall]] = {}
        for site in _sites(graph_module):
            if site.completed:
                groups.setdefault((site.completed, site.module.eps), []).append(site)
            else:
                _replace(graph, site, "call_function", phase2_alone, (site.node.args[-1],),
                         {"scale": site.scale}, "phase2")
        for (completed, eps), members in groups.items():
            _rewrite_group(graph, completed, eps, members)
        graph_module.meta.setdefault("attnres", {})["schedule"] = SCHEDULE_META
        graph_module.recompile()
        return PassResult(graph_module, True)


def apply_two_phase(gm: fx.GraphModule) -> fx.GraphModule:
    """Switch a rewritten GraphModule to the two-phase schedule, in place, and return it.

    ``gm`` is what :func:`attnres_fx.rewrite` returned. Parameters, ``state_dict`` and
    ``attnres_fx.sites(gm)`` are unchanged; only the graph is. To keep the per-site form as well, pass
    ``copy.deepcopy(gm)`` (its parameters are then copies). Raises ``ValueError`` (leaving ``gm``
    untouched) on a module without BlockAttnRes aggregations, or one already switched.
    """
    return TwoPhaseSchedule()(gm).graph_module


def apply_two_phase_to_site_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """The two-phase schedule for a graph whose aggregations are :func:`~attnres_fx.op.module.run_site` calls
    (a layer-route block graph: ``run_site(module, entered, *sources)``, ``entered`` the completed blocks the
    graph received as one list), in place; returns ``gm``. The sites that read the same completed blocks
    (the same ``entered`` and the same sources before the partial) share one :func:`phase1_at`; each site
    becomes a :func:`phase2_at`. The modules stay arguments, resolved when the graph runs: a site whose module
    has hooks or was replaced runs as :func:`run_site` does. A site with no completed block is left as it is.
    """
    graph = gm.graph
    groups: dict[tuple, list[fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=run_site):
        _, entered, *sources = node.args
        if entered or len(sources) > 1:
            groups.setdefault((entered, tuple(sources[:-1])), []).append(node)
    order = {node: index for index, node in enumerate(graph.nodes)}
    for number, ((entered, completed), members) in enumerate(groups.items()):
        for member in members[1:]:
            # A later site's module (a get_attr, no inputs) is read where phase 1 now reads it.
            if order[member.args[0]] > order[members[0]]:
                members[0].prepend(member.args[0])
                order[member.args[0]] = order[members[0]]
        with graph.inserting_before(members[0]):
            state = graph.create_node("call_function", phase1_at,
                                      (tuple(member.args[0] for member in members), entered, *completed),
                                      name=f"attnres_phase1_{number}")
        for index, member in enumerate(members):
            member.target = phase2_at
            member.args = (member.args[0], state, index, *member.args[1:])
    graph.lint()
    gm.meta.setdefault("attnres", {})["schedule"] = SCHEDULE_META
    gm.recompile()
    return gm


def phase1_at(modules: tuple, entered, *completed: torch.Tensor) -> tuple | None:
    """:func:`phase1` for the sites of ``modules`` (their AttnRes modules now) over the completed blocks
    ``(*entered, *completed)``; ``None`` where one of them would not run as a plain ``BlockAttnRes`` (hooks on
    it, another module in its place) or their ``eps`` differ: each site then runs :func:`run_site`."""
    if any(type(module) is not BlockAttnRes or compat.module_hooks(module) for module in modules):
        return None
    eps = modules[0].eps
    if any(module.eps != eps for module in modules):
        return None
    return phase1(tuple(module.proj.weight for module in modules), tuple(module.norm.weight for module in modules),
                  (*entered, *completed), eps=eps)


def phase2_at(module, states: tuple | None, index: int, entered, *sources: torch.Tensor) -> torch.Tensor:
    """The site of ``module``: :func:`phase2` of the partial (the last source) with its query's phase-1 state
    (``states[index]``), or ``run_site(module, entered, *sources)`` where :func:`phase1_at` gave none."""
    if states is None:
        return run_site(module, entered, *sources)
    first = entered[0] if entered else sources[0]
    scale = float(len(entered) + len(sources)) if module.preserve_scale else 1.0
    return phase2(states[index], module.proj.weight, module.norm.weight, sources[-1], first, eps=module.eps,
                  scale=scale)


def can_apply_two_phase(module) -> bool:
    """Whether :func:`apply_two_phase` applies: a GraphModule with per-site BlockAttnRes calls."""
    return isinstance(module, fx.GraphModule) and bool(_sites(module))


def _sites(gm: fx.GraphModule) -> list[_AggregationCall]:
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, BlockAttnRes) and getattr(module, "site", None) is not None:
            found.append(_AggregationCall(node, module))
    return found


def _rewrite_group(graph: fx.Graph, completed: tuple[fx.Node, ...], eps: float,
                   members: list[_AggregationCall]) -> None:
    stream = members[0].module.site.stream
    name = f"attnres_phase1_{f'stream{stream}_' if stream else ''}block{len(completed)}"
    weights = []
    with graph.inserting_before(members[0].node):
        for site in members:
            weights.append((graph.get_attr(f"{site.node.target}.proj.weight"),
                            graph.get_attr(f"{site.node.target}.norm.weight")))
        state = graph.create_node("call_function", phase1,
                                  (tuple(p for p, _ in weights), tuple(g for _, g in weights), completed),
                                  {"eps": eps}, name=name)
        state.meta["attnres"] = {"name": name, "role": "phase1", "block": len(completed),
                                 "sites": [site.node.target for site in members]}
        states = [graph.create_node("call_function", operator.getitem, (state, s), name=f"{name}_query{s}")
                  for s in range(len(members))]
    for site, (proj, norm), query_state in zip(members, weights, states):
        args = (query_state, proj, norm, site.node.args[-1], site.node.args[0])
        _replace(graph, site, "call_function", phase2, args, {"eps": eps, "scale": site.scale}, "phase2")


def _replace(graph: fx.Graph, site: _AggregationCall, op: str, target, args: tuple, kwargs: dict, role: str) -> None:
    """Put a phase node where the site's call was, with the site's provenance, and drop the call."""
    old = site.node
    with graph.inserting_before(old):
        new = graph.create_node(op, target, args, kwargs, name=f"attnres_{role}_{old.target.replace('.', '_')}")
    for key in ("nn_module_stack", "stack_trace"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    new.meta["attnres"] = {**old.meta.get("attnres", {}), "role": role}
    old.replace_all_uses_with(new)
    graph.erase_node(old)
