"""Contract of :class:`~attnres_fx.passes.signature.LayerGraphSignature`, per path: a block's graph traced by
torch.fx and the same block's graph captured by TorchDynamo (where fx cannot trace it) carry one signature,
built by the rewrite and stored with the graph, with the same layout of the stream's state: the stream
entering by one of the call's inputs, the completed blocks (one list in the fx graph, which serves every
depth; one input each in the Dynamo graph) and the partial sum as real graph inputs, the carrier, the
partial sum and the committed blocks as real outputs after the block's own, the carrier at the same place
in the result, the same next residual site. In the Dynamo graph the state inputs are Dynamo's own
placeholders (its example values, taken from the call's tensors) and no slot of the capture is left.
Numerical: the two compute the same (fp32 sums in another order: 1e-6).
"""

import copy

import torch

import attnres_fx
from attnres_fx import routing
from attnres_fx.errors import TraceError
from attnres_fx.models import TinyTransformer, example_ids
from attnres_fx.passes.signature import (BLOCK, BLOCKS, CARRIER, INPUT, OUTPUT, PARTIAL, SIGNATURE, STREAM,
                                         LayerGraphSignature, StateLayout, state_slots)
from attnres_fx.routing import graphs
from attnres_fx.testing import randomise_pseudo_queries


def tiny():
    torch.manual_seed(0)
    return TinyTransformer(dim=32, num_layers=4, num_heads=4).eval()


def signatures(model, ids) -> list[LayerGraphSignature]:
    with torch.no_grad():
        out = model(ids)
    return out, [router.rewritten[-1].meta[SIGNATURE] for router in routing.routers(model)]


def state_placeholders(graph_module, signature: LayerGraphSignature) -> list:
    placeholders = list(graph_module.graph.find_nodes(op="placeholder"))
    return [node for node, kind in zip(placeholders, signature.inputs) if kind in (BLOCK, BLOCKS, PARTIAL)]


def state_inputs(signature: LayerGraphSignature) -> tuple:
    return tuple(kind for kind in signature.inputs if kind not in (INPUT, STREAM))


def test_fx_traced_and_dynamo_captured_blocks_carry_one_signature_layout(monkeypatch):
    ids = example_ids(tiny().config)
    model = randomise_pseudo_queries(attnres_fx.attnresify(tiny(), (ids,), block_size=3))
    fx_out, by_fx = signatures(model, ids)

    captured = copy.deepcopy(model)

    def refuse(*args, **kwargs):
        raise TraceError("refused for this test: the block runs on TorchDynamo")
    monkeypatch.setattr(graphs, "routable_trace", refuse)
    dynamo_out, by_dynamo = signatures(captured, ids)
    assert attnres_fx.conversion.conversion_of(captured).stats.captures == 4, "every block captured by Dynamo"
    # The fx graphs' eager code runs each site with the layer norm that reads it as one operator, the Dynamo
    # graphs ATen's layer_norm after the aggregation: the norm's sums in another order (4e-6 seen here).
    torch.testing.assert_close(dynamo_out, fx_out, rtol=1e-5, atol=2e-5)

    planned = attnres_fx.conversion.conversion_of(model).plan.streams[0]
    for router, fx_signature, dynamo_signature in zip(routing.routers(model), by_fx, by_dynamo):
        first, last = router.span.start == 0, router.span.stop == planned.num_positions
        completed = planned.completed_before(router.span.start)
        for signature in (fx_signature, dynamo_signature):
            assert signature.inputs.count(STREAM) == 1 and signature.stream_input is not None
            assert signature.next_offset == router.span.stop - router.span.start
        # The state each graph was rewritten for, in its signature: the layout the route made of the state.
        layout = None if first else StateLayout(router.span.start, completed, True, as_list=True)
        assert fx_signature.layout == layout
        assert dynamo_signature.layout == (layout and layout._replace(as_list=False))
        # The state inputs: none at the stream's start; else the blocks (a list / one each), the partial sum.
        assert state_inputs(fx_signature) == (() if first else (BLOCKS, PARTIAL))
        assert state_inputs(dynamo_signature) == (() if first else (BLOCK,) * completed + (PARTIAL,))
        # The outputs: the block's own, then the state it hands on (nothing where it ends the stream).
        assert fx_signature.outputs[:1] == (OUTPUT,) and fx_signature.results == 1
        fx_state = fx_signature.outputs[fx_signature.results:]
        assert fx_state == dynamo_signature.outputs[dynamo_signature.results:]
        assert fx_state == (() if last else (CARRIER, PARTIAL) + (BLOCK,) * (len(fx_state) - 2))
        assert fx_signature.carrier == dynamo_signature.carrier == (None if last else (0,))

    for router in routing.routers(captured):
        graph = router.rewritten[-1]
        assert not list(graph.graph.find_nodes(op="call_function", target=state_slots)), "no slot left"
        # Dynamo's placeholders, with Dynamo's example values of the call's own state tensors.
        for node in state_placeholders(graph, graph.meta[SIGNATURE]):
            assert "grapharg" in node.meta and node.meta["example_value"].shape == (*ids.shape, 32)


def test_the_routing_modules_import_each_other_without_a_circle():
    """Structural: the imports between ``attnres_fx/routing/`` modules a module runs when it is loaded (at
    its top level, not those for type checking only) form no circle, so that each one can be read, and
    loaded, after those it uses."""
    import ast
    import pathlib

    folder = pathlib.Path(attnres_fx.__file__).parent / "routing"
    names = {path.stem for path in folder.glob("*.py")}
    uses: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        found = set()
        for node in ast.parse(path.read_text()).body:          # the top level only: no TYPE_CHECKING block
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module} if node.module else {alias.name for alias in node.names}
        uses[path.stem] = found & names - {path.stem}
    assert uses["router"] >= {"graphs", "state"} and "router" not in uses["graphs"], "what the check reads"

    def circle_from(name: str, path: tuple) -> tuple | None:
        if name in path:
            return path[path.index(name):] + (name,)
        for used in sorted(uses[name]):
            found = circle_from(used, path + (name,))
            if found:
                return found
        return None
    circles = [found for name in sorted(uses) if (found := circle_from(name, ()))]
    assert not circles, f"import circles between routing modules: {circles}"
