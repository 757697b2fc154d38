"""What Inductor makes of one BlockAttnRes: at most two kernels, and no full-size temporary."""

import math
import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from attnres_fx import BlockAttnRes

SHAPE = (2, 16, 64)


@pytest.mark.slow
def test_one_site_compiles_to_at_most_two_kernels():
    torch.manual_seed(0)
    module = BlockAttnRes(SHAPE[-1])
    nn.init.normal_(module.proj.weight, std=0.5)
    nn.init.uniform_(module.norm.weight, 0.5, 1.5)
    sources = [torch.randn(SHAPE) for _ in range(3)]
    torch._dynamo.reset()
    with torch.no_grad():
        out, (code,) = run_and_get_code(torch.compile(module, fullgraph=True), *sources)
        torch.testing.assert_close(out, module(*sources), rtol=1e-5, atol=1e-6)
    # The sources are read in place (no stacked copy): the only buffer as large as a source is the output.
    assert_kernels_and_full_size_buffers(code, SHAPE, most_kernels=2, full_size_buffers=1)


def assert_kernels_and_full_size_buffers(code: str, shape, most_kernels: int, full_size_buffers: int) -> str:
    """Check Inductor's generated CPU code: at most ``most_kernels`` kernels launched (generated C++
    kernels, ``cpp_fused_*`` or ``kernel``, and library calls), exactly ``full_size_buffers`` buffers
    allocated as large as ``shape``. Returns the code of its ``call``."""
    call = code[code.index("def call("):]
    defined = re.findall(r"^(\w+) = async_compile\.cpp", code, flags=re.M)
    launched = [name for name in defined if f"{name}(" in call] + re.findall(r"extern_kernels\.\w+\(", call)
    assert defined and len(launched) <= most_kernels, f"kernels: {launched}"
    sizes = [math.prod(int(d) for d in dims.split(",") if d.strip())
             for dims in re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", call)]
    assert sum(size >= math.prod(shape) for size in sizes) == full_size_buffers, call
    return call
