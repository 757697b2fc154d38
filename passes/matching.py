"""Site matching: whether an add is a residual site (its operand computed from the other through
parameterised compute, in any of the forms a model writes it: ``h + f(h)``, parallel ``h + f(h) + g(h)``,
a pre-summed branch, a residual cast apart from the branch input), and the site's sublayers.

A failed match is a :class:`FailedMatch`: falsy, its reason formatted only when read (most adds of a
graph are no site, and their reasons are printed only by a dry run or an error).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from . import node_kinds as nk
from . import norms, provenance
from .branch_kinds import TOKEN_MIXING, branch_kind
from .dataflow import Ancestry, parameter_derived_nodes
from .streams import Branch, ResidualSite


@dataclass(frozen=True)
class FailedMatch:
    """Why an add is no residual site; falsy, so ``if not (site := matcher.match(...))`` reads."""

    describe: Callable[[], str]

    def __bool__(self) -> bool:
        return False

    @property
    def reason(self) -> str:
        return self.describe()


@dataclass(frozen=True, eq=False)
class _Summand:
    """One summand a site adds to the stream, before summands are grouped into sublayers."""

    output: fx.Node
    region: frozenset[fx.Node]
    kind: str
    reads: frozenset            # what it reads the stream through (keys of the stream's readers)

    @property
    def mixes_tokens(self) -> bool:
        return self.kind in TOKEN_MIXING


class SiteMatcher:
    """Decides whether an add is a residual site, and splits a site into sublayers."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.ancestry = Ancestry(gm.graph)
        self.param_derived = parameter_derived_nodes(gm.graph)

    def match(self, node: fx.Node, operands: tuple[fx.Node, fx.Node]) -> ResidualSite | FailedMatch:
        if nk.op_name(node).endswith("_") and not node.users:
            # ``x.add_(f(x))`` with ``x`` used afterwards: the graph reads the mutated ``x`` through the
            # operand's node, so the sum's own node carries no data flow to rewrite.
            return FailedMatch(
                lambda: "in-place add whose result is never used; write x = x + f(x) (or x = x.add_(...))")
        a, b = operands
        adds = [node]
        reaches = self.ancestry.reaches
        if reaches(a, b):
            stream_in, outputs = a, [b]
        elif reaches(b, a):
            stream_in, outputs = b, [a]
        else:
            parallel = self._parallel_form(a, b)
            cast = None if parallel is not None else self._cast_residual_form(a, b)
            if parallel is not None:
                stream_in, outputs, inner = parallel
                adds.extend(inner)
            elif cast is not None:
                stream_in, outputs = cast
            else:
                scaled = self._scaled_residual(a, b)
                if scaled is not None:
                    product, scale = scaled
                    return FailedMatch(lambda: (
                        f"the stream is scaled before it is added: {product.name} multiplies it by the learned "
                        f"{_weight_name(scale)} (a learned residual scale, h' = a * h + f(h)); Block AttnRes "
                        "attends over the unscaled sources of a plain sum h' = h + f(h), so such a stream "
                        "cannot be converted"))
                return FailedMatch(lambda: "operands are independent: neither is computed from the other")
        for output in outputs:
            if not self._has_parameterised_compute(stream_in, output):
                return FailedMatch(lambda: f"the branch {stream_in.name} -> {output.name} has no parameterised "
                                   "compute (Linear, matmul or conv with weights)")
        before, after = nk.shape_of(stream_in), nk.shape_of(node)
        if before is not None and after is not None and str(before) != str(after):
            return FailedMatch(
                lambda: f"the branch output broadcasts the stream {stream_in.name} from {before} to {after}")
        summands: list[_Summand] = []
        for output in outputs:
            summands.extend(self._summands(stream_in, output, adds))
        branches = [self._branch(stream_in, group) for group in _sublayers(summands)]
        _, inbound = stream_source(stream_in, self.gm)
        return ResidualSite(node, tuple(adds), stream_in, inbound, tuple(branches),
                            _site_owner(node, branches), layout="")

    def _has_parameterised_compute(self, stream_in: fx.Node, output: fx.Node) -> bool:
        return any(nk.is_parameterised_compute(n, self.gm, self.param_derived)
                   for n in self.ancestry.region(stream_in, output))

    def _cast_residual_form(self, a: fx.Node, b: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
        """``residual = h.to(torch.float32); residual + f(norm(h))`` (Mamba's ``residual_in_fp32``): the
        residual operand is a cast of the value the branch reads, so the two are siblings. The site reads
        ``h``; the cast, an identity on values, is left behind with the add it fed."""
        for residual, branch in ((a, b), (b, a)):
            origin = residual
            while nk.is_transparent(origin, self.gm) and len(origin.all_input_nodes) == 1:
                origin = origin.all_input_nodes[0]
            if origin is not residual and self.ancestry.reaches(origin, branch):
                return origin, [branch]
        return None

    def _scaled_residual(self, a: fx.Node, b: fx.Node) -> tuple[fx.Node, fx.Node] | None:
        """``scale * h + f(h)`` with ``scale`` a weight (Doge's ``input_residual``): the operand that
        multiplies the value the other is computed from by a parameter, and that parameter."""
        for product, other in ((a, b), (b, a)):
            if nk.op_name(product) not in nk.MUL_OPS:
                continue
            factors = product.all_input_nodes
            weights = [f for f in factors if f in self.param_derived]
            values = [f for f in factors if f not in self.param_derived]
            if weights and len(values) == 1 and self.ancestry.reaches(values[0], other):
                return product, weights[0]
        return None

    def _parallel_form(self, a: fx.Node, b: fx.Node):
        """``(h + f) + g``, ``((h + f) + g) + k``, ... with every summand computed from ``h``: returns
        (h, [f, g, ...], the inner adds)."""
        reaches = self.ancestry.reaches
        for inner, other in ((a, b), (b, a)):
            inner_operands = nk.add_operands(inner)
            if inner_operands is None or len(inner.users) != 1:
                continue
            x, y = inner_operands
            for h, f in ((x, y), (y, x)):
                if reaches(h, f) and reaches(h, other):
                    return h, [f, other], [inner]
            deeper = self._parallel_form(x, y)
            if deeper is not None and reaches(deeper[0], other):
                h, outputs, inners = deeper
                return h, [*outputs, other], [*inners, inner]
        return None

    def _summands(self, stream_in: fx.Node, output: fx.Node, split: list[fx.Node]) -> list[_Summand]:
        """``output`` as the summands a pre-summed branch ``h + (f + g)`` adds, recursively; a sum whose
        summands are one sublayer stays whole. Adds taken apart are appended to ``split``, and so are the
        identities on values (an inactive dropout, a cast) between such an add and the stream: the
        branches' sum may pass through them on its way (Falcon's ``mlp_output += attention_output``
        then ``residual + dropout(mlp_output)``)."""
        passed = []
        while (nk.is_transparent(output, self.gm) and len(output.all_input_nodes) == 1 and len(output.users) == 1
               and nk.add_operands(output.all_input_nodes[0]) is not None):
            passed.append(output)
            output = output.all_input_nodes[0]
        if passed:
            parts = self._summands(stream_in, output, split)
            if len(parts) > 1:
                split.extend(passed)
                return parts
            return [self._summand(stream_in, passed[0])]
        operands = nk.add_operands(output)
        if (operands is None or len(output.users) != 1
                or self.ancestry.reaches(operands[0], operands[1]) or self.ancestry.reaches(operands[1], operands[0])
                or not all(self.ancestry.reaches(stream_in, o) and self._has_parameterised_compute(stream_in, o)
                           for o in operands)):
            return [self._summand(stream_in, output)]
        parts = self._summands(stream_in, operands[0], split) + self._summands(stream_in, operands[1], split)
        if len(parts) == 2 and _one_sublayer(*parts):
            return [self._summand(stream_in, output)]
        split.append(output)
        return parts

    def _summand(self, stream_in: fx.Node, output: fx.Node) -> _Summand:
        region = self.ancestry.region(stream_in, output)
        reads = frozenset(_computation_key(u) for u in stream_in.users if u in region)
        return _Summand(output, region, branch_kind(region, self.gm, self.ancestry.flow, self.param_derived), reads)

    def _branch(self, stream_in: fx.Node, group: list[_Summand]) -> Branch:
        region = frozenset().union(*(s.region for s in group))
        readers = [u for u in stream_in.users if u in region]
        kinds = {s.kind for s in group}
        kind = "mlp" if len(group) > 1 and "mlp" in kinds else group[0].kind
        paths = [provenance.node_module_path(n) for n in region if n.op != "get_attr"]
        return Branch(outputs=tuple(s.output for s in group), region=region, kind=kind,
                      module_path=".".join(provenance.common_parts(p for p in paths if p)),
                      normalised=norms.reads_normalised(stream_in, readers, self.gm))

def _one_sublayer(first: _Summand, second: _Summand) -> bool:
    """Channel-mixing summands that read the stream the same way make one sublayer."""
    return not first.mixes_tokens and not second.mixes_tokens and first.reads == second.reads


def _sublayers(summands: list[_Summand]) -> list[list[_Summand]]:
    """Group a site's summands into sublayers, in order: token mixers alone, channel mixers by input."""
    groups: list[list[_Summand]] = []
    for summand in summands:
        group = next((g for g in groups if _one_sublayer(g[0], summand)), None)
        if group is None:
            groups.append([summand])
        else:
            group.append(summand)
    return groups


def _computation_key(node: fx.Node) -> tuple:
    """Nodes with equal keys compute the same value (same op on the same arguments): two calls of one
    norm on the stream are one input."""
    return node.op, str(node.target), repr(node.args), repr(node.kwargs)


def _site_owner(node: fx.Node, branches: list[Branch]) -> str:
    owner = provenance.owner_path(node)
    if owner:
        return owner
    # An add written in the root's forward (``x = x + blk.attn(...)``): the layer the branches share,
    # not the branch's own sublayer (``blocks.0``, not ``blocks.0.attn``).
    common = ".".join(provenance.common_parts(b.module_path for b in branches if b.module_path))
    if len(branches) == 1 and common == branches[0].module_path and "." in common \
            and not common.rsplit(".", 1)[1].isdigit():
        common = common.rsplit(".", 1)[0]
    return common


def stream_source(stream_in: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node, tuple[fx.Node, ...]]:
    """Walk back from a site's input through stream ops: (origin, the ops passed, in graph order)."""
    passed = []
    node = stream_in
    while nk.is_stream_op(node, gm) and node.all_input_nodes:
        passed.append(node)
        node = node.all_input_nodes[0]
    return node, tuple(reversed(passed))


def _weight_name(node: fx.Node) -> str:
    """A weight's name as the model spells it (``model.layers.0.input_residual``) where the graph holds it
    by name (``get_attr``), else its node's."""
    while node.op != "get_attr" and len(node.all_input_nodes) == 1:
        node = node.all_input_nodes[0]
    return f"parameter {node.target}" if node.op == "get_attr" else f"weight {node.name}"
