"""What graph captures make of the aggregation: Inductor fuses its plain-op form with a neighbour (no call
of the opaque operator); torch.export and ONNX hold plain ops that onnxruntime runs, equal to eager."""


import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

from attnres_fx.op import ops
from test_aggregation import _module
from test_kernels import assert_kernels_and_full_size_buffers
from test_ops import EPS, SATURATING, SATURATING_IDS, _reference_float64, _sources, _weights

SHAPE = (2, 16, 64)


class SiteThenNorm(nn.Module):
    """An aggregation and the pre-norm that reads it: what a residual site looks like to Inductor."""

    def __init__(self, dim):
        super().__init__()
        self.res = _module(dim)
        self.norm = nn.RMSNorm(dim)

    def forward(self, a, b, c):
        return self.norm(self.res(a, b, c))


class CallsTheOperator(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.res = _module(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, a, b, c):
        return self.out(F.gelu(torch.ops.attnres.aggregate([a, b, c], self.res.proj.weight, self.res.norm.weight,
                                                           1e-6, True)))


@pytest.mark.slow
def test_inductor_fuses_the_aggregation_with_the_norm_after_it():
    module = SiteThenNorm(SHAPE[-1])
    sources = [torch.randn(SHAPE) for _ in range(3)]
    torch._dynamo.reset()
    with torch.no_grad():
        out, (code,) = run_and_get_code(torch.compile(module, fullgraph=True), *sources)
        torch.testing.assert_close(out, module(*sources), rtol=1e-5, atol=1e-5)
    # The aggregate itself is never written out: the only full-size buffer is the normalised output.
    call = assert_kernels_and_full_size_buffers(code, SHAPE, most_kernels=2, full_size_buffers=1)
    assert "attnres" not in call, "the opaque operator must not reach Inductor's graph"


def test_torch_export_keeps_the_operator_and_its_fake_implementation_traces_it():
    module = CallsTheOperator(8)
    inputs = tuple(torch.randn(2, 5, 8) for _ in range(3))
    program = torch.export.export(module, inputs)
    assert torch.ops.attnres.aggregate.default in [n.target for n in program.graph.nodes]
    torch.testing.assert_close(program.module()(*inputs), module(*inputs))
    plain = program.run_decompositions(ops.EXPORT_DECOMPOSITIONS)
    assert not [n for n in plain.graph.nodes if "attnres" in str(n.target)]
    torch.testing.assert_close(plain.module()(*inputs), module(*inputs), rtol=1e-5, atol=1e-6)


class Aggregation(nn.Module):
    def __init__(self, res):
        super().__init__()
        self.res = res

    def forward(self, *sources):
        return self.res(*sources)


@pytest.mark.slow
@pytest.mark.parametrize("query_std, magnitude", SATURATING, ids=SATURATING_IDS)
def test_onnx_zeroes_negligible_weights_of_a_saturated_softmax(tmp_path, query_std, magnitude):
    """The exported graph flushes exp(logit - max) below NEGLIGIBLE_WEIGHT to zero (an Exp, then Less and
    Where), as every implementation does, and onnxruntime's result stays within the round-off the float64
    reference allows (test_ops.check_no_subnormals: 1e-5 plus 2 eps per unit of the largest logit)."""
    import onnx
    import onnxruntime as ort

    from attnres_fx import BlockAttnRes, export

    k, shape = 9, (2, 8, 512)
    proj, norm = _weights(shape[-1])
    with torch.no_grad():
        proj.weight.normal_(0.0, query_std)
    module = BlockAttnRes(shape[-1], eps=EPS, preserve_scale=True)
    module.proj.weight.data.copy_(proj.weight.detach())
    module.norm.weight.data.copy_(norm.weight.detach())
    sources = tuple(s.detach() * magnitude for s in _sources(shape, k))
    want, _, weights, largest_logit = _reference_float64(sources, proj, norm, True, torch.zeros(shape))
    assert (weights < torch.finfo(torch.float32).tiny).any(), "the case does not saturate the softmax"
    path = export.to_onnx(Aggregation(module).eval(), sources, tmp_path / "aggregation.onnx", dynamic=False)
    kinds = [node.op_type for node in onnx.load(str(path)).graph.node]
    assert {"Exp", "Less", "Where"} <= set(kinds), kinds
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: s.numpy() for i, s in zip(session.get_inputs(), sources)})[0]
    tolerance = 1e-5 + 2 * torch.finfo(torch.float32).eps * largest_logit
    torch.testing.assert_close(torch.from_numpy(got).double(), want.detach(), rtol=tolerance,
                               atol=tolerance * want.abs().max().item())


@pytest.mark.slow
@pytest.mark.parametrize("model", ["operator", "module"])
def test_onnx_holds_plain_ops_that_onnxruntime_runs_equal_to_eager(tmp_path, model):
    import onnx

    from attnres_fx import export

    module = CallsTheOperator(16) if model == "operator" else SiteThenNorm(16)
    inputs = tuple(torch.randn(2, 6, 16) * (i + 1) for i in range(3))
    path = export.to_onnx(module.eval(), inputs, tmp_path / "model.onnx")
    domains = {node.domain for node in onnx.load(str(path)).graph.node}
    assert domains <= {"", "ai.onnx"}, domains
    report = export.verify(module, path, inputs, atol=1e-5, rtol=1e-5)
    assert report.ok, report
