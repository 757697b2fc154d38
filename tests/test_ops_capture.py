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
