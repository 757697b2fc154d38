"""Residual-stream detection: what must be found, what must not, and why."""

import pytest
import torch

import attnres_fx
from attnres_fx.models import TinyTransformer
from conftest import converted
from toy_models import (ChunkedLinearAttention, EncoderDecoder, HalvingStack, InputSumLayer, LayerStack, MoE,
                        NestedModel, NoResidualModel, PostNormModel, RawBranchModel, RopeAttention, RopeModel,
                        ScaledAddLayer, SkipStack, make_inputs)


def detect(model, *inputs):
    return attnres_fx.detect(model, inputs or None, tracer="fx")


def reasons(detection):
    return {r.node: r.reason for r in detection.rejected}


def test_builtin_model_stream_table():
    detection = detect(TinyTransformer(num_layers=2, dim=32))
    assert [(s.owner, s.kind, s.normalised) for s in detection.streams[0].sites] == [
        ("blocks.0", "attn", True), ("blocks.0", "mlp", True), ("blocks.1", "attn", True), ("blocks.1", "mlp", True)]
    assert detection.streams[0].start.name == "add", "b_0 is the embedding sum tok + pos"
    table = str(detection)
    assert "4 residual sites in 1 stream(s)" in table and "blocks.1  mlp" in table


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "functional_layernorm", "functional_rmsnorm",
                                  "manual_rmsnorm"])
def test_every_pre_norm_form_is_recognised_as_normalised(norm):
    detection = detect(TinyTransformer(num_layers=2, dim=32, norm=norm))
    assert detection.num_sites == 4
    assert all(site.normalised for site in detection.streams[0].sites)


def test_raw_reads_are_classified_raw():
    detection = detect(RawBranchModel(), torch.randn(2, 4, 32))
    assert [s.normalised for s in detection.streams[0].sites] == [False, False]


def test_rope_mask_bias_gelu_and_embedding_adds_are_not_sites():
    model = RopeModel()
    detection = detect(model, make_inputs())
    sites = detection.streams[0].sites
    assert [s.kind for s in sites] == ["attn", "mlp", "attn", "mlp"]
    why = reasons(detection)
    by_owner = {}
    for rejected in detection.rejected:
        by_owner.setdefault(rejected.owner, []).append(rejected.reason)
    attn0 = by_owner["attns.0"]
    # q*cos + rotate(q)*sin (q and k) and scores + mask in layer 0: independent operands.
    assert sum("independent" in r for r in attn0) == 3
    # In layer 1 the mask also reached the scores through the stream: rejected as crossing it.
    assert any("linked only through the residual stream" in r for r in by_owner["attns.1"])
    mlp0 = by_owner["mlps.0"]
    assert sum("independent" in r for r in mlp0) == 2, "x @ W + b, twice"
    assert sum("no parameterised compute" in r for r in mlp0) == 1, "GELU's h + 0.044715 h**3"
    assert "operands are independent" in why["add"], "tok + pos embedding"


def test_two_independent_streams_encoder_and_decoder():
    detection = detect(EncoderDecoder(), make_inputs(), make_inputs(seed=1))
    encoder, decoder = detection.streams
    assert [s.owner for s in encoder.sites] == ["encoder.0", "encoder.0", "encoder.1", "encoder.1"]
    assert [s.kind for s in decoder.sites] == ["attn", "attn", "mlp"] * 2
    assert encoder.start.name == "src_emb" and decoder.start.name == "tgt_emb"


def test_encoder_final_aggregate_feeds_the_decoder_cross_attention():
    model = EncoderDecoder().eval()
    src, tgt = make_inputs(), make_inputs(seed=1)
    new = converted(model, src, tgt, block_size=2, preserve_scale=True)
    names = [s.name for s in attnres_fx.sites(new)]
    # ``encoder`` and ``decoder`` are ModuleLists, which iterate over their children: the final
    # aggregations go on the root instead.
    assert "encoder_final_res" in names and "decoder_final_res" in names
    assert len(new.encoder) == len(new.decoder) == 2
    graph = attnres_fx.rewrite(new, (src, tgt))
    final = next(n for n in graph.graph.nodes if n.target == "encoder_final_res")
    (enc_norm,) = final.users
    assert enc_norm.target == "enc_norm"
    assert sum(1 for u in enc_norm.users if "cross_attn" in str(u.target)) == 2, "both decoder layers"
    with torch.no_grad():
        torch.testing.assert_close(new(src, tgt), model(src, tgt), rtol=1e-5, atol=1e-5)


def test_a_residual_chain_inside_a_branch_is_left_alone():
    detection = detect(NestedModel(), make_inputs())
    (stream,) = detection.streams
    assert len(stream.sites) == 2 and stream.start.name == "emb"
    nested = [r for r in detection.rejected if "nested inside the branch" in r.reason]
    assert sorted(r.owner for r in nested) == ["mlps.0", "mlps.0", "mlps.1", "mlps.1"]


class NormLinearLayers(torch.nn.Module):
    """``layers`` (LayerNorm, Linear) pairs of width 16; subclasses write the residual adds."""

    def __init__(self, layers):
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(16) for _ in range(layers))
        self.lins = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(layers))


def test_add_forms_are_all_recognised():
    class Forms(NormLinearLayers):
        def __init__(self):
            super().__init__(5)

        def forward(self, x):
            x = self.lins[0](self.norms[0](x)) + x           # branch first
            x = torch.add(x, self.lins[1](self.norms[1](x)))
            x = x.add(self.lins[2](self.norms[2](x)))
            y = self.lins[3](self.norms[3](x))
            x += y                                            # operator.iadd
            x = x.add_(self.lins[4](self.norms[4](x)))        # Tensor.add_
            return x

    detection = detect(Forms(), torch.randn(2, 3, 16))
    assert detection.num_sites == 5
    model = Forms()
    x = torch.randn(2, 3, 16)
    new = converted(model, x, block_size=1, preserve_scale=True)
    torch.testing.assert_close(new(x), model(x), rtol=1e-5, atol=1e-5)


def test_post_norm_is_reported_not_rewritten():
    detection = detect(PostNormModel(), make_inputs())
    assert not detection.streams
    assert len(detection.post_norm) == 4


def test_no_residual_lists_every_add_and_why():
    detection = detect(NoResidualModel(), make_inputs())
    assert not detection.streams
    assert len(detection.rejected) == 4
    assert all(r.reason for r in detection.rejected)


def test_an_unused_in_place_add_is_rejected_with_a_rewrite_hint():
    class InPlace(NormLinearLayers):
        def forward(self, x):
            x = x * 2
            for norm, lin in zip(self.norms, self.lins):
                x.add_(lin(norm(x)))
            return x

    with pytest.raises(attnres_fx.NoResidualStreamError, match=r"in-place add whose result is never used"):
        attnres_fx.attnresify(InPlace(2))


# -- what the data flow follows ---------------------------------------------------------------------------

def test_writes_into_buffers_carry_values():
    """``buffer.select(1, t).copy_(v)``, ``y[:, t] = v`` and ``index_put_`` leave no graph edge from ``v`` to
    later reads of the buffer; the data flow adds one (and a buffer made ``new_zeros`` from ``x`` reads
    only ``x``'s shape)."""
    from attnres_fx.passes import dataflow

    def scan(x, v):
        buffer = x.new_zeros(x.shape)
        buffer.select(1, 0).copy_(v)
        buffer.index_put_((torch.tensor([1]),), v[:, None])
        return buffer.sum()

    graph = torch.fx.symbolic_trace(scan).graph
    flow = dataflow.DataFlow(graph)
    nodes = {n.name: n for n in graph.nodes}
    reached, todo = set(), [nodes["sum_1"]]
    while todo:
        for parent in flow.parents(todo.pop()):
            if parent not in reached:
                reached.add(parent)
                todo.append(parent)
    assert nodes["v"] in reached and nodes["copy_"] in reached and nodes["index_put_"] in reached
    assert nodes["x"] not in reached, "new_zeros reads only the shape of x"


# -- adds that continue a stream but are no site: never converted around silently -------------------------

@pytest.mark.parametrize("kind,add,reason", [
    ("long_skip", "add_8", "long skip"),
    ("unet", "add_4", "long skip"),
    ("bias", "add_4", "operands are independent"),
])
def test_an_add_on_the_stream_that_is_no_site_is_refused_unless_allowed(kind, add, reason, untouched):
    """A long skip after the last layer or in the middle (U-Net), or a bias added between layers: the
    stream continues through an add that is no residual site. Detection lists it, conversion refuses;
    with ``allow_partial=True`` the add stays, reading the aggregate that stands for the stream value it
    read, and ``preserve_scale=True`` still reproduces the original exactly."""
    torch.manual_seed(0)
    model = SkipStack(kind).eval()
    ids = make_inputs()
    detection = detect(model, ids)
    assert [(r.node, reason in r.reason) for r in detection.unconverted] == [(add, True)]
    assert f"{add}: " in str(detection) and "no residual site" in str(detection)
    check = untouched(model, ids)
    refusal = rf"(?s)no residual site:\n  - \w+: [^\n]*{reason}.*allow_partial=True"
    with pytest.raises(attnres_fx.UnsupportedArchitectureError, match=refusal):
        attnres_fx.attnresify(model, (ids,))
    check()
    new = converted(model, ids, allow_partial=True, preserve_scale=True)
    assert sum(s.kind != "final" for s in attnres_fx.sites(new)) == 8
    with torch.no_grad():
        torch.testing.assert_close(new(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_an_op_on_the_whole_stream_between_layers_is_refused_unless_allowed(untouched):
    """``x = x / 2`` between two layers (RWKV's rescaling): formerly two streams, converted silently, each
    attending over its own blocks only."""
    torch.manual_seed(0)
    model = HalvingStack().eval()
    ids = make_inputs()
    detection = detect(model, ids)
    assert [len(s.sites) for s in detection.streams] == [4, 4]
    assert [r.node for r in detection.unconverted] == [detection.streams[1].start.name]
    check = untouched(model, ids)
    refusal = (r"(?s)adds or ops that are no residual site:\n  - (\w+): the residual stream that ends at \w+ "
               r"continues through \1 \(an op on the whole stream.*rescale_every.*allow_partial=True")
    with pytest.raises(attnres_fx.UnsupportedArchitectureError, match=refusal):
        attnres_fx.attnresify(model, (ids,))
    check()
    new = converted(model, ids, allow_partial=True, preserve_scale=True)
    assert len(attnres_fx.plan_of(new).streams) == 2
    with torch.no_grad():
        torch.testing.assert_close(new(ids), model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_a_branch_output_added_to_the_stream_as_the_next_sublayers_input_is_part_of_that_branch(tracer):
    """``h + mlp(norm(h + attn(h)))``: formerly ``h + attn(h)`` was taken for a site and the residual add
    itself refused as linked only through the stream (a mask's reason); converted with allow_partial, the
    layer route and the model route then computed different functions."""
    torch.manual_seed(0)
    model = LayerStack([InputSumLayer() for _ in range(3)]).eval()
    ids = make_inputs()
    detection = (attnres_fx.detect(model, (ids,)) if tracer == "auto" else detect(model, ids))
    assert [[s.owner for s in stream.sites] for stream in detection.streams] == [["layers.0", "layers.1", "layers.2"]]
    assert not detection.unconverted
    assert len([r for r in detection.rejected if "as the input of that site's sublayer" in r.reason]) == 3
    new = converted(model, ids, preserve_scale=True)
    with torch.no_grad():
        torch.testing.assert_close(new(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_a_fork_is_reported():
    """Two residual sites reading one sum: the stream ends there; the sites after it are rejected and,
    as they continue the stream, listed."""
    class Fork(NormLinearLayers):
        def forward(self, x):
            for norm, lin in zip(self.norms[:2], self.lins[:2]):
                x = x + lin(norm(x))
            a = x + self.lins[2](self.norms[2](x))
            b = x + self.lins[3](self.norms[3](x))
            return a * b

    detection = detect(Fork(4), torch.randn(2, 3, 16))
    assert [len(s.sites) for s in detection.streams] == [2]
    assert {r.node for r in detection.unconverted} == {"add_2", "add_3"}
    assert all("forks at add_1" in r.reason for r in detection.unconverted)


# -- labels and messages ----------------------------------------------------------------------------------

def test_a_scaled_torch_add_is_named_in_the_error(untouched):
    model = LayerStack([ScaledAddLayer(0.5), ScaledAddLayer(0.5)])
    check = untouched(model, make_inputs())
    with pytest.raises(attnres_fx.NoResidualStreamError, match=r"torch\.add\(a, b, alpha=0\.5\)"):
        attnres_fx.attnresify(model, (make_inputs(),))
    check()
    detection = detect(LayerStack([ScaledAddLayer(1), ScaledAddLayer(1)]), make_inputs())
    assert detection.num_sites == 4, "alpha=1 is a plain add"


def test_kinds_come_from_data_flow_not_names():
    """Renamed modules keep their kinds: softmax over q @ k^T is attention, a router's softmax and top-k
    make an MLP, a scan is a mixer."""
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2, self.n3 = (torch.nn.LayerNorm(32) for _ in range(3))
            self.a, self.b, self.c = RopeAttention(32), MoE(), ChunkedLinearAttention()

        def forward(self, x, cos, sin, mask):
            x = x + self.a(self.n1(x), cos, sin, mask)
            x = x + self.b(self.n2(x))
            return x + self.c(self.n3(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(64, 32)
            self.x, self.y = Layer(), Layer()

        def forward(self, ids):
            t = 8                                  # make_inputs() has 8 positions
            mask = torch.full((t, t), float("-inf")).triu(1)
            cos = sin = torch.ones(t, 4)
            return self.y(self.x(self.emb(ids), cos, sin, mask), cos, sin, mask)

    detection = detect(Model(), make_inputs())
    assert [s.kind for s in detection.streams[0].sites] == ["attn", "mlp", "mixer"] * 2


class _TransposeAttention(torch.nn.Module):
    """Attention whose scores read the keys through a property: ``q @ k.mT``."""
    def __init__(self, d=32):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.mT / 32 ** 0.5, dim=-1) @ v)


class _InPlaceParallelLayer(torch.nn.Module):
    """A parallel layer that sums its branches in place before the residual add (Falcon's form)."""
    def __init__(self, d=32, in_place=True):
        super().__init__()
        self.norm, self.attn = torch.nn.LayerNorm(d), _TransposeAttention(d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.drop, self.in_place = torch.nn.Dropout(0.1), in_place

    def forward(self, x):
        h = self.norm(x)
        attn_out, mlp_out = self.attn(h), self.mlp(h)
        if self.in_place:
            mlp_out += attn_out
        else:
            mlp_out = mlp_out + attn_out
        return x + self.drop(mlp_out)


class _ParallelStack(torch.nn.Module):
    def __init__(self, in_place=True):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(_InPlaceParallelLayer(in_place=in_place) for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_attention_through_a_transpose_property_and_in_place_branch_sums(tracer):
    """``k.mT`` carries data (a ``getattr`` of a property is no shape query), so the scores' softmax is
    attention; a layer that sums its branches in place gets one site branch per sublayer, as the same
    layer written out of place does."""
    ids = make_inputs()
    found = {}
    for in_place in (True, False):
        model = _ParallelStack(in_place).eval()
        detection = attnres_fx.detect(model, (ids,), tracer=tracer)
        found[in_place] = [sorted(b.kind for b in s.branches) for s in detection.streams[0].sites]
    assert found[True] == found[False] == [["attn", "mlp"]] * 2


class _ClampedStack(torch.nn.Module):
    """Pre-norm layers whose stream is clamped after every sublayer with bounds computed from itself."""
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(32) for _ in range(4))
        self.fs = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))

    def forward(self, ids):
        h = self.emb(ids)
        for norm, f in zip(self.norms, self.fs):
            h = h + f(norm(h))
            bound = torch.where(torch.isinf(h).any(), torch.tensor(6.0e4), torch.tensor(6.5e4))
            h = torch.clamp(h, min=-bound, max=bound)
        return h


def test_a_clamp_bounded_by_the_stream_is_a_stream_op(untouched):
    """The stream passes through a clamp whose bounds it computes itself: one stream of 4 sites, the
    conversion exact."""
    model = _ClampedStack().eval()
    ids = make_inputs()
    detection = attnres_fx.detect(model, (ids,), tracer="fx")
    assert len(detection.streams) == 1 and detection.num_sites == 4
    want = model(ids)
    converted_ = converted(model, ids, preserve_scale=True)
    torch.testing.assert_close(converted_(ids), want, rtol=1e-5, atol=1e-6)


def test_a_failed_match_is_falsy_and_formats_its_reason_only_when_read():
    """Most adds of a graph are no site: their reasons are built only when a dry run or an error reads them."""
    from attnres_fx.passes.matching import FailedMatch

    calls = []
    failed = FailedMatch(lambda: calls.append(1) or "operands are independent")
    assert not failed and not calls
    assert failed.reason == "operands are independent" and calls == [1]
