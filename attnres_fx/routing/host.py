"""Host captures: another program's compiler traces a converted model's call whole, as one TorchDynamo graph
that it compiles with its own backend (an inference engine's: vLLM's ``torch.compile`` capture of a
decoder's forward), and the AttnRes rewrite is applied to that graph before its backend sees it.

A host is named on the conversion (:func:`host`). While a host's capture traces the model:

- every routed module reached runs its forward as written, so the graph is the original model's, and
  declares the AttnRes parameters of its sites with ``attnres::site_parameters(proj_weight, norm_weight,
  site)``: Dynamo then takes them as inputs of the graph like every other parameter (the compiled code
  reads them at every call, and an artifact the host saves to disk holds none of them);
- the host's backend is wrapped (:func:`rewriting_backend`): a copy of each graph is rewritten by the plan,
  as the model route rewrites its graphs (every stream matched by the modules performing its sites, so
  vLLM's replacement of linear layers and norms changes nothing), the aggregations as plain ops on the
  declared parameters (:func:`attnres_fx.op.aggregation.fusable`: the host's compiler fuses them with their
  neighbours), the declarations removed; the host's own backend compiles the result.

``attnres::site_parameters`` has no implementation that runs: a graph that reaches a backend without the
rewrite raises when it is called, so a converted model is never served as its plain model.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import fx, nn

from .. import compat
from ..op.aggregation import fusable
from ..capture.tracers import copy_graph_module
from ..conversion import conversion_of, require
from ..errors import PassContractError, RoutingError
from ..passes.pipeline import rewrite_captured
from ..passes.plan import Plan
from ..passes.rewrite import Emitter

LOG = logging.getLogger("attnres_fx")


@torch.library.custom_op("attnres::site_parameters", mutates_args=())
def site_parameters(proj_weight: torch.Tensor, norm_weight: torch.Tensor, site: str) -> None:
    raise RoutingError(f"attnres::site_parameters ({site}) ran: a host's graph of a converted model was compiled "
                       "without the AttnRes rewrite (attnres_fx.routing.host.rewriting_backend must wrap the "
                       "host's backend)")


@site_parameters.register_fake
def _(proj_weight, norm_weight, site):
    return None


def host(model: nn.Module, name: str) -> None:
    """Let ``name``'s captures trace the converted ``model`` whole (see the module docstring); their graphs must
    go through :func:`rewriting_backend`."""
    require(model, "routing.host.host").host = name


def declare(root: nn.Module, sites) -> None:
    """In a host's capture: declare the AttnRes parameters of ``sites`` (what a routed module computes)."""
    for site in sites:
        module = root.get_submodule(site.name)
        torch.ops.attnres.site_parameters(module.proj.weight, module.norm.weight, site.name)


class DeclaredParameters(Emitter):
    """Aggregations as :func:`~attnres_fx.op.aggregation.fusable` on the parameters declared in the graph."""

    def __init__(self, declared: dict[str, tuple[fx.Node, fx.Node]], eps: float, preserve_scale: bool):
        self.declared = declared
        self.eps = eps
        self.preserve_scale = preserve_scale

    def emit(self, graph, site, sources, entered=None):
        self._no_list(entered)
        if site.name not in self.declared:
            raise PassContractError(f"{site.name}: no module of the host's graph declared its parameters")
        proj, norm = self.declared[site.name]
        return graph.call_function(fusable, (proj, norm, list(sources)),
                                   {"eps": self.eps, "preserve_scale": self.preserve_scale})


def rewritten(model: nn.Module, graph_module: fx.GraphModule) -> fx.GraphModule:
    """A copy of the host's graph ``graph_module`` of a call of ``model`` with the AttnRes rewrite applied."""
    conversion = conversion_of(model)
    return rewritten_by(conversion.plan, graph_module, type(model).__name__,
                        f"{type(model).__name__} ({conversion.host}'s graph)")


def rewritten_by(plan: Plan, graph_module: fx.GraphModule, name: str, where: str, *,
                 in_order: bool = False) -> fx.GraphModule:
    """A copy of a host's graph ``graph_module`` of a call of a model of class ``name`` rewritten by
    ``plan`` (``where``: how errors name the graph). ``in_order``: the graph is another
    implementation's of the converted model (an inference engine's own classes, whose modules the plan does
    not name), its stream matched to the plan by the order of its sites, and rewritten whole."""
    copied = copy_graph_module(graph_module, name)
    declared = {}
    for node in list(copied.graph.nodes):
        if node.op == "call_function" and node.target in (torch.ops.attnres.site_parameters,
                                                           torch.ops.attnres.site_parameters.default):
            proj, norm, site = node.args
            declared.setdefault(site, (proj, norm))
            copied.graph.erase_node(node)
    name_written_values(copied.graph)
    rewrite_captured(copied, plan, lambda gm: DeclaredParameters(declared, plan.eps, plan.preserve_scale),
                     where=where, carriers=not in_order, in_order=in_order)
    copied.recompile()
    return copied


def written(buffer: torch.Tensor, write) -> torch.Tensor:
    """``buffer`` once ``write`` (an operator's call that wrote into it and returned nothing) wrote it."""
    return buffer


def name_written_values(graph: fx.Graph) -> None:
    """Give every value an operator writes into one of its arguments a node (:func:`written`) that the later
    readers of that argument read instead: an inference engine's operators write their results into
    tensors allocated for them (vLLM's CPU GEMM ``_C::onednn_mm(out, x, bias, weight)``, its attention
    ``unified_attention_with_output(q, k, v, out, layer)``), so the value a residual add reads has no node
    of its own, and the add's operand (the allocation) is computed from nothing."""
    order = {node: k for k, node in enumerate(graph.nodes)}
    for node in list(order):
        target = node.target if node.op == "call_function" else None
        overload = getattr(target, "default", target)
        if not isinstance(overload, compat.OpOverload) or overload._schema.returns:
            continue
        values = dict(zip((a.name for a in overload._schema.arguments), node.args))
        values.update(node.kwargs)
        for argument in overload._schema.arguments:
            buffer = values.get(argument.name)
            if argument.alias_info is None or not argument.alias_info.is_write or not isinstance(buffer, fx.Node):
                continue
            later = [user for user in buffer.users if order.get(user, -1) > order[node]]
            if not later:
                continue
            with graph.inserting_after(node):
                value = graph.call_function(written, (buffer, node))
            value.meta = dict(buffer.meta)
            for user in later:
                user.replace_input_with(buffer, value)


def rewriting_backend(model: Callable[[], nn.Module], backend: Callable) -> Callable:
    """A Dynamo backend that compiles with ``backend`` what :func:`rewritten` makes of each graph of the converted
    model ``model()`` (the model as it is when a graph is compiled)."""
    def rewriting(graph_module: fx.GraphModule, example_inputs: list):
        start = time.perf_counter()
        converted = model()
        graph = rewritten(converted, graph_module)
        conversion_of(converted).host_graphs += 1
        LOG.info("rewrote %s's graph of %s in %.2f s", conversion_of(converted).host, type(converted).__name__,
                 time.perf_counter() - start)
        return backend(graph, example_inputs)
    return rewriting
