"""attnres::aggregate against the reference oracle: every implementation (the C++ kernel, the Triton kernel
in Triton's CPU interpreter, the PyTorch formulation the operator falls back to, the decomposition graph
captures see), forward and gradients, over source counts, widths, decoding and prefill shapes, dtypes;
opcheck; saved tensors; failures and the fallback warning."""

import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from attnres_fx.op import aggregation, ops
from attnres_fx.op.kernels import cpu
from attnres_fx.testing.reference import block_attn_res

EPS = 1e-6
needs_cpu_kernel = pytest.mark.skipif(not cpu.available(), reason=f"the C++ kernel: {cpu.unavailable_reason()}")


def _weights(dim, seed=0, dtype=torch.float32):
    """A pseudo-query with logits of order one at any width, and a key-norm weight away from one."""
    torch.manual_seed(seed)
    proj = nn.Linear(dim, 1, bias=False, dtype=dtype)
    nn.init.normal_(proj.weight, std=2.0 / dim ** 0.5)
    norm = nn.RMSNorm(dim, eps=EPS, dtype=dtype)
    nn.init.uniform_(norm.weight, 0.5, 1.5)
    return proj, norm


def _sources(shape, k, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * (1 + i % 3)).to(dtype).requires_grad_() for i in range(k)]


def _reference(sources, proj, norm, preserve_scale, grad):
    """The oracle's output and its gradients (sources, proj.weight, norm.weight), in fp32."""
    values = [s.detach().float().requires_grad_() for s in sources]
    out = block_attn_res(values[:-1], values[-1], proj, norm, preserve_scale=preserve_scale)
    grads = torch.autograd.grad(out, [*values, proj.weight, norm.weight], grad.float())
    return out, grads


def _kernel_call(aggregate, backward):
    """An implementation given as forward and backward functions, with the operator's signature."""
    def run(sources, proj, norm, preserve_scale, grad):
        detached = [s.detach() for s in sources]
        out = aggregate(detached, proj.weight.detach(), norm.weight.detach(), EPS, preserve_scale)
        source_grads, query_grad = backward(grad, detached, proj.weight.detach(), norm.weight.detach(), EPS,
                                            preserve_scale)
        return out, [*source_grads, (query_grad * norm.weight.detach().float()).unsqueeze(0),
                     query_grad * proj.weight.detach()[0].float()]
    return run


def _autograd_call(function):
    def run(sources, proj, norm, preserve_scale, grad):
        out = function(sources, proj, norm, preserve_scale)
        return out, torch.autograd.grad(out, [*sources, proj.weight, norm.weight], grad)
    return run


def _forward_without_gradient(function):
    """The forward as a call without gradients runs it (a decoding step's: for a few tokens the C++
    operator's loop for them), the gradients as with them."""
    def run(sources, proj, norm, preserve_scale, grad):
        with torch.no_grad():
            out = function(sources, proj, norm, preserve_scale)
        return out, _autograd_call(function)(sources, proj, norm, preserve_scale, grad)[1]
    return run


def _cpu_operator(s, p, n, ps):
    return torch.ops.attnres_cpu.aggregate(s, p.weight, n.weight, EPS, ps)


IMPLEMENTATIONS = {
    "operator": _autograd_call(lambda s, p, n, ps: ops.aggregate(s, p.weight, n.weight, eps=EPS, preserve_scale=ps)),
    # The C++ operator with its autograd registered in C++: what eager calls on the CPU run.
    "cpu operator": _autograd_call(_cpu_operator),
    "cpu operator, no gradient": _forward_without_gradient(_cpu_operator),
    "pytorch": _kernel_call(ops.reference_forward, aggregation.reference_backward),
    "decomposition": _autograd_call(lambda s, p, n, ps: aggregation.fusable(p.weight, n.weight, s, eps=EPS,
                                                                              preserve_scale=ps)),
}
KERNEL_IMPLEMENTATIONS = ("operator", "cpu operator", "cpu operator, no gradient")
# (count, shape): every count 1-9, widths 1, 7, 33, 1000 and 4096, decoding ([B, 1, D]) and prefill.
CASES = [(1, (2, 3, 1)), (2, (1, 1, 7)), (3, (8, 1, 33)), (4, (2, 5, 1000)), (5, (1, 1, 4096)),
         (6, (2, 64, 33)), (7, (1, 3, 7)), (8, (4, 1, 1000)), (9, (2, 16, 128)), (9, (1, 1, 4096)), (2, (1, 300, 1)),
         (1, (1, 5, 40)), (2, (1, 37, 100))]


def _check(implementation, k, shape, preserve_scale, dtype=torch.float32, tolerance=1e-5):
    proj, norm = _weights(shape[-1])
    sources = _sources(shape, k, dtype)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    want, want_grads = _reference(sources, proj, norm, preserve_scale, grad)
    got, got_grads = implementation(sources, proj, norm, preserve_scale, grad)
    assert got.dtype == dtype and got.shape == want.shape
    # Relative to each tensor's magnitude: fp32 sums taken in another order differ by round-off only.
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    assert len(got_grads) == len(want_grads)
    for index, (g, w) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(g.float(), w, rtol=tolerance, atol=tolerance * w.abs().max().item(),
                                   msg=lambda m, index=index: f"gradient {index}: {m}")


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("k, shape", CASES, ids=[f"{k}x{'x'.join(map(str, s))}" for k, s in CASES])
def test_matches_the_reference_fp32(name, k, shape):
    if name in KERNEL_IMPLEMENTATIONS and not cpu.available():
        pytest.skip(f"the C++ kernel: {cpu.unavailable_reason()}")
    _check(IMPLEMENTATIONS[name], k, shape, preserve_scale=k % 2 == 0)


# Saturated softmaxes (pseudo-queries of std 1 and 3, logits of order 20-70 at width 512, sources of
# magnitudes 1-3 and 1e4): weights such as e^-100 are subnormal floats unless flushed, and so are the
# gradients they scale. (query std, source magnitude)
SATURATING = [(1.0, 1.0), (3.0, 1.0), (3.0, 1e4)]
SATURATING_IDS = [f"std{std:g}-magnitude{magnitude:g}" for std, magnitude in SATURATING]


def _subnormals(tensor: torch.Tensor) -> int:
    tensor = tensor.detach()
    return int(((tensor != 0) & (tensor.abs() < torch.finfo(tensor.dtype).tiny)).sum())


def _reference_float64(sources, proj, norm, preserve_scale, grad):
    """The aggregation, its gradients (sources, proj.weight, norm.weight), its softmax weights and its
    largest logit magnitude in float64, where nothing is subnormal: what the flushed fp32 results must stay
    within round-off of."""
    values = [s.detach().double().requires_grad_() for s in sources]
    query = proj.weight.detach().double().requires_grad_()
    gain = norm.weight.detach().double().requires_grad_()
    stacked = torch.stack(values)
    keys = stacked * torch.rsqrt(stacked.square().mean(-1, keepdim=True) + EPS) * gain
    logits = keys @ query[0]
    weights = torch.softmax(logits, dim=0).unsqueeze(-1)
    out = (weights * stacked).sum(0) * (len(values) if preserve_scale else 1)
    grads = torch.autograd.grad(out, [*values, query, gain], grad.double())
    return out, grads, weights.detach(), logits.detach().abs().max().item()


def check_no_subnormals(implementation, query_std, magnitude, k=9, shape=(2, 32, 512)):
    """The aggregation's output and the gradients of its sources, pseudo-query and key-norm weight hold no
    subnormal float, and match the float64 reference as every implementation does (``_check``)."""
    proj, norm = _weights(shape[-1])
    with torch.no_grad():
        proj.weight.normal_(0.0, query_std)
    sources = [(s.detach() * magnitude).requires_grad_() for s in _sources(shape, k)]
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    want, want_grads, weights, largest_logit = _reference_float64(sources, proj, norm, True, grad)
    assert (weights < torch.finfo(torch.float32).tiny).any(), "the case does not saturate the softmax"
    got, got_grads = implementation(sources, proj, norm, True, grad)
    names = [*(f"source {i}" for i in range(k)), "proj.weight", "norm.weight"]
    counts = {name: _subnormals(g) for name, g in zip(["output", *names], [got, *got_grads])}
    assert not any(counts.values()), f"subnormal values: {counts}"
    # An fp32 logit of magnitude L is off by about eps * L, and exp turns that absolute error into the same
    # relative error of its weight: saturating logits (L ~ 200 at std 3) loosen round-off past 1e-5.
    tolerance = 1e-5 + 2 * torch.finfo(torch.float32).eps * largest_logit
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    # A source's gradient within round-off of the largest source gradient: a flushed weight drops a term
    # under 2^-32 of its token's largest, and a source negligible at every token has a gradient of zero
    # where float64 gives one of order 1e-20.
    source_scale = max(w.abs().max().item() for w in want_grads[:k])
    for index, (name, g, w) in enumerate(zip(names, got_grads, want_grads)):
        scale = source_scale if index < k else w.abs().max().item()
        torch.testing.assert_close(g.double(), w, rtol=tolerance, atol=tolerance * scale,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


SATURATED_IMPLEMENTATIONS = {
    **IMPLEMENTATIONS,
    "stacked": _autograd_call(lambda s, p, n, ps: aggregation.stacked(p.weight, n.weight, s, eps=EPS,
                                                                        preserve_scale=ps)),
    "batched": _autograd_call(lambda s, p, n, ps: aggregation.batched(p.weight, n.weight, s, eps=EPS,
                                                                        preserve_scale=ps)),
}


@pytest.mark.parametrize("name", SATURATED_IMPLEMENTATIONS)
@pytest.mark.parametrize("query_std, magnitude", SATURATING, ids=SATURATING_IDS)
def test_saturated_softmax_leaves_no_subnormal_value(name, query_std, magnitude):
    if name in KERNEL_IMPLEMENTATIONS and not cpu.available():
        pytest.skip(f"the C++ kernel: {cpu.unavailable_reason()}")
    check_no_subnormals(SATURATED_IMPLEMENTATIONS[name], query_std, magnitude)


@needs_cpu_kernel
@pytest.mark.parametrize("query_std, magnitude", SATURATING, ids=SATURATING_IDS)
def test_saturated_softmax_leaves_no_subnormal_value_at_a_few_tokens(query_std, magnitude):
    check_no_subnormals(IMPLEMENTATIONS["cpu operator, no gradient"], query_std, magnitude, shape=(8, 1, 512))


@needs_cpu_kernel
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2 ** -8)])
@pytest.mark.parametrize("width", [7, 64, 1000])
def test_a_few_tokens_give_the_rows_of_a_call_of_many(dtype, tolerance, width):
    """A call of a few tokens (its own loop) gives what a call of many (tiles, vectorised softmax) gives for
    the same rows, to round-off: the sums are taken in another order."""
    proj, norm = _weights(width)
    sources = [s.detach() for s in _sources((12, 1, width), 6, dtype)]
    with torch.no_grad():
        many = _cpu_operator(sources, proj.to(dtype), norm.to(dtype), True)
        few = torch.cat([_cpu_operator([s[t:t + 1] for s in sources], proj.to(dtype), norm.to(dtype), True)
                         for t in range(12)])
    torch.testing.assert_close(few.float(), many.float(), rtol=tolerance, atol=tolerance * many.abs().max().item())


@needs_cpu_kernel
@pytest.mark.parametrize("tokens", [3, 12], ids=["a few tokens", "many tokens"])
def test_a_weight_under_the_threshold_is_zero_in_the_forward(tokens):
    """A source whose logit lies 30 under the other's (weight e^-30, a normal float, but under
    NEGLIGIBLE_WEIGHT) counts as zero: the output is the other source exactly, however large this one."""
    width = 64
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randn(width, generator=generator) for _ in range(2)]
    keys = [row * torch.rsqrt(row.square().mean() + EPS) for row in rows]
    query = 15.0 * (keys[0] - keys[1]) / width
    gap = (query @ (keys[0] - keys[1])).item()
    assert math.log(1 / aggregation.NEGLIGIBLE_WEIGHT) < gap < 60
    sources = [rows[0].expand(tokens, 1, width).contiguous(), 1e9 * rows[1].expand(tokens, 1, width).contiguous()]
    with torch.no_grad():
        out = torch.ops.attnres_cpu.aggregate(sources, query[None], torch.ones(width), EPS, False)
    assert torch.equal(out, sources[0])


@needs_cpu_kernel
def test_the_cpu_kernel_flushes_at_the_threshold_of_the_formulation():
    literal = re.search(r"kNegligibleWeight = (0x[0-9a-fp.+-]+)f;", cpu.SOURCE.read_text()).group(1)
    assert float.fromhex(literal) == aggregation.NEGLIGIBLE_WEIGHT


# bf16 / fp16 sources, fp32 inside: the output is one rounding to the storage type away from the fp32
# result (bf16 keeps 8 bits, fp16 11), the gradients as well.
@needs_cpu_kernel
@pytest.mark.parametrize("name", KERNEL_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2 ** -7), (torch.float16, 2 ** -10)])
@pytest.mark.parametrize("k, shape", [(2, (1, 19, 48)), (3, (2, 1, 1000)), (5, (2, 32, 64)), (9, (1, 4, 33))])
def test_reduced_precision(name, dtype, tolerance, k, shape):
    _check(IMPLEMENTATIONS[name], k, shape, preserve_scale=False, dtype=dtype, tolerance=tolerance)


@needs_cpu_kernel
def test_the_operator_equals_the_pytorch_formulation_on_the_same_bf16_inputs():
    proj, norm = _weights(64)
    sources = [s.detach() for s in _sources((4, 16, 64), 5, torch.bfloat16)]
    got = torch.ops.attnres_cpu.aggregate(sources, proj.weight, norm.weight, EPS, True)
    want = ops.reference_forward(sources, proj.weight, norm.weight, EPS, True)
    # Both fp32 inside, then one rounding to bf16: at most one bf16 step apart.
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.float().abs().max().item())


@needs_cpu_kernel
@pytest.mark.parametrize("k", [1, 3])
def test_opcheck(k):
    proj, norm = _weights(33)
    sources = _sources((2, 5, 33), k)
    torch.library.opcheck(torch.ops.attnres.aggregate.default, (sources, proj.weight, norm.weight, EPS, True))
    grad = torch.randn(2, 5, 33)
    torch.library.opcheck(torch.ops.attnres.aggregate_backward.default,
                          (grad, [s.detach() for s in sources], proj.weight.detach(), norm.weight.detach(), EPS, False))


@needs_cpu_kernel
@pytest.mark.parametrize("k", [1, 3])
def test_opcheck_of_the_cpu_operator(k):
    """The C++ operator: its C++ autograd (gradients against finite differences in float64 are out of its
    dtypes' reach: opcheck's autograd registration, schema and fake (meta) checks) and its backward."""
    proj, norm = _weights(33)
    sources = _sources((2, 5, 33), k)
    torch.library.opcheck(torch.ops.attnres_cpu.aggregate.default, (sources, proj.weight, norm.weight, EPS, True))
    torch.library.opcheck(torch.ops.attnres_cpu.aggregate_backward.default,
                          (torch.randn(2, 5, 33), [s.detach() for s in sources], proj.weight.detach(),
                           norm.weight.detach(), EPS, False))


@needs_cpu_kernel
def test_the_cpu_operators_backward_is_a_cpp_node_and_eager_calls_use_it():
    """Eager calls on the CPU record the C++ operator's autograd node: no Python runs in its backward."""
    from attnres_fx import BlockAttnRes

    module = BlockAttnRes(16)
    out = module(*_sources((2, 4, 16), 3))
    assert "attnres_cpu::AggregateFunction" in out.grad_fn.name()
    with torch.no_grad():
        assert module(*_sources((2, 4, 16), 3)).grad_fn is None


def _gradients_of_gradients(call, leaves):
    """Second derivatives of a gradient penalty: ``d/dleaves sum(grad(out^2)^2)``."""
    grads = torch.autograd.grad(call().square().sum(), leaves, create_graph=True)
    return torch.autograd.grad(sum(grad.square().sum() for grad in grads), leaves)


@pytest.mark.parametrize("caller", ["cpu operator", "operator"])
@pytest.mark.parametrize("preserve_scale", [False, True])
@pytest.mark.parametrize("k,shape", [(3, (2, 5, 16)), (5, (2, 7, 33))])
def test_gradients_of_gradients_equal_the_pytorch_formulations(caller, preserve_scale, k, shape):
    """A backward recording its graph (``create_graph=True``: a gradient penalty) differentiates the PyTorch
    formulation, as the kernels' backward has no derivative (taken through it, every second derivative
    was silently zero); each source's own, where sources are built from each other. fp32 second
    derivatives through a softmax and two rsqrt: bound 2e-5 (relative_error)."""
    from attnres_fx.checks import relative_error

    if caller == "cpu operator" and not cpu.available():
        pytest.skip(f"the C++ kernel: {cpu.unavailable_reason()}")
    proj, norm = _weights(shape[-1])
    branches = _sources(shape, k)
    leaves = [*branches, proj.weight, norm.weight]

    def stream():  # each source the sum of the branches so far, as a stream's blocks are
        return [sum(branches[:i + 1]) for i in range(k)]

    run = torch.ops.attnres_cpu.aggregate if caller == "cpu operator" else torch.ops.attnres.aggregate
    got = _gradients_of_gradients(lambda: run(stream(), proj.weight, norm.weight, EPS, preserve_scale), leaves)
    want = _gradients_of_gradients(
        lambda: aggregation.fusable(proj.weight, norm.weight, stream(), eps=EPS, preserve_scale=preserve_scale),
        leaves)
    assert proj.weight.grad is None and want[-2].abs().max() > 0
    for got_grad, want_grad in zip(got, want, strict=True):
        assert relative_error(got_grad, want_grad) < 2e-5


@needs_cpu_kernel
@pytest.mark.parametrize("name", KERNEL_IMPLEMENTATIONS)
def test_saved_tensors_go_through_saved_tensors_hooks(name):
    proj, norm = _weights(16)
    sources = _sources((2, 4, 16), 3)
    packed = []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if name == "operator":
            out = ops.aggregate(sources, proj.weight, norm.weight, eps=EPS, preserve_scale=False)
        else:
            out = torch.ops.attnres_cpu.aggregate(sources, proj.weight, norm.weight, EPS, False)
    # The inputs (both weights, every source) and, for the C++ operator, the logits' parts its backward
    # would otherwise recompute: 2 floats per token and source, [2, K, T].
    logits = [] if name == "operator" else [torch.Size([2, 3, 8])]
    assert sorted(packed) == sorted([proj.weight.shape, norm.weight.shape, *(s.shape for s in sources), *logits])
    grads = torch.autograd.grad(out.square().sum(), sources)
    want = torch.autograd.grad(aggregation.fusable(proj.weight, norm.weight, sources, eps=EPS,
                                                   preserve_scale=False).square().sum(), sources)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# Calls without gradients: more sources and a wider row than the forward's scratch holds inline (17 > 16,
# 5000 > 4096: it takes the heap), more tokens than one chunk of work (at::parallel_for), a few tokens.
NO_GRAD_CASES = [(17, (1, 1, 5000)), (2, (1, 600, 64)), (3, (2, 2, 7))]


@needs_cpu_kernel
@pytest.mark.parametrize("k, shape", NO_GRAD_CASES, ids=["past-the-inline-scratch", "over-a-chunk", "few-tokens"])
def test_a_call_without_gradients_matches_the_reference(k, shape):
    proj, norm = _weights(shape[-1])
    sources = [s.detach() for s in _sources(shape, k)]
    with torch.no_grad():
        got = torch.ops.attnres_cpu.aggregate(sources, proj.weight, norm.weight, EPS, True)
        want = block_attn_res(sources[:-1], sources[-1], proj, norm, preserve_scale=True)
    # fp32 sums taken in another order: round-off only, relative to the output's magnitude.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_cpu_kernel
def test_a_call_without_gradients_runs_no_other_operator():
    """A decoding step's call allocates its output below the dispatcher and keeps its scratch on the stack:
    no ATen operator runs inside it (each costs microseconds when the step has pushed it out of the caches)."""
    proj, norm = _weights(64)
    sources = [s.detach() for s in _sources((1, 1, 64), 5)]
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.ops.attnres_cpu.aggregate(sources, proj.weight, norm.weight, EPS, False)
    assert [event.name for event in profile.events()] == ["attnres_cpu::aggregate"]


class _Seen:
    """What a torch-function or dispatch mode sees called."""
    def __init__(self):
        super().__init__()
        self.seen = []

    def _record(self, func, args, kwargs):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class _FunctionMode(_Seen, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._record(func, args, kwargs)


class _DispatchMode(_Seen, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._record(func, args, kwargs)


@needs_cpu_kernel
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_a_blocks_call_through_the_operators_python_entry_matches_the_module(grad):
    """run_site calls the C++ operator through its own Python entry (no schema conversion of the arguments):
    the module's result, and with gradients the operator's C++ autograd node."""
    from attnres_fx import BlockAttnRes
    from attnres_fx.op.module import run_site

    module = BlockAttnRes(33)
    nn.init.normal_(module.proj.weight)
    sources = [s if grad else s.detach() for s in _sources((2, 3, 33), 4)]
    with torch.set_grad_enabled(grad):
        got = run_site(module, sources[:3], sources[3])
        want = block_attn_res(sources[:3], sources[3], module.proj, module.norm)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert (got.grad_fn is not None and "attnres_cpu::AggregateFunction" in got.grad_fn.name()) == grad


@needs_cpu_kernel
@pytest.mark.parametrize("caller", ["run_site", "module"])
def test_a_call_is_seen_by_torch_function_and_dispatch_modes(caller):
    """The operator's Python entry skips __torch_function__, so run_site and eager calls take it only without
    a torch-function mode (or subclass); dispatch modes see the operator either way (the entry calls the
    dispatcher)."""
    from attnres_fx import BlockAttnRes
    from attnres_fx.op.module import run_site

    module = BlockAttnRes(8)
    sources = [s.detach() for s in _sources((1, 1, 8), 3)]
    call = (lambda: run_site(module, sources[:2], sources[2])) if caller == "run_site" else (lambda: module(*sources))
    with torch.no_grad():
        with _FunctionMode() as function_mode:
            call()
        with _DispatchMode() as dispatch_mode:
            call()
    assert "attnres_cpu.aggregate" in function_mode.seen
    assert dispatch_mode.seen == ["attnres_cpu.aggregate.default"]


@needs_cpu_kernel
@pytest.mark.parametrize("caller", ["run_site", "module"])
def test_a_call_without_gradients_is_seen_by_the_profiler(caller):
    """Without gradients, a call the dispatcher would send straight to the CPU kernel goes there itself, but
    not while the profiler records operators: it still lists the operator."""
    from attnres_fx import BlockAttnRes
    from attnres_fx.op.module import run_site

    module = BlockAttnRes(8)
    sources = [s.detach() for s in _sources((1, 1, 8), 3)]
    call = (lambda: run_site(module, sources[:2], sources[2])) if caller == "run_site" else (lambda: module(*sources))
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        call()
    assert "attnres_cpu::aggregate" in [event.name for event in profile.events()]


@needs_cpu_kernel
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_call_without_gradients_gives_the_operators_result(mode):
    """The kernel called without the dispatcher gives what the dispatcher's call gives, bit for bit, and under
    torch.inference_mode() an inference tensor, as an operator's result there is."""
    from attnres_fx import BlockAttnRes
    from attnres_fx.op.module import run_site

    module = BlockAttnRes(40)
    nn.init.normal_(module.proj.weight)
    sources = [s.detach() for s in _sources((2, 1, 40), 5)]
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        got = run_site(module, sources[:4], sources[4])
        with _DispatchMode():       # a dispatch mode: the dispatcher's path
            want = run_site(module, sources[:4], sources[4])
    assert torch.equal(got, want)
    assert got.is_inference() == (mode == "inference_mode") == want.is_inference()


def _declines(case, module, sources):
    """Set up ``case`` on ``module`` / ``sources`` (undone on exit): a call the C site entry must leave to
    run_site's Python path."""
    import contextlib
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, weight):
            return weight * 2

    stack = contextlib.ExitStack()
    if case == "forward hook":
        stack.callback(module.register_forward_hook(lambda m, a, o: None).remove)
    elif case == "forward pre-hook":
        stack.callback(module.register_forward_pre_hook(lambda m, a: None).remove)
    elif case == "global forward hook":
        stack.callback(nn.modules.module.register_module_forward_hook(lambda m, a, o: None).remove)
    elif case == "instance forward":
        module.forward = module.forward
        stack.callback(lambda: module.__dict__.pop("forward"))
    elif case == "parametrized weight":
        parametrize.register_parametrization(module.proj, "weight", Doubled())
        stack.callback(lambda: parametrize.remove_parametrizations(module.proj, "weight"))
    elif case == "torch-function mode":
        stack.enter_context(_FunctionMode())
    elif case == "tensor subclass":
        sources[-1] = sources[-1].as_subclass(_Subclass)
    elif case == "meta source":
        sources[:] = [s.to("meta") for s in sources]
    elif case == "mixed shapes":
        sources[-1] = sources[-1][..., :1, :]
    return stack


class _Subclass(torch.Tensor):
    pass


@needs_cpu_kernel
@pytest.mark.parametrize("case", ["plain", "subclass module", "forward hook", "forward pre-hook",
                                  "global forward hook", "instance forward", "parametrized weight",
                                  "torch-function mode", "tensor subclass", "meta source", "mixed shapes"])
def test_the_c_site_entry_runs_the_operator_only_where_run_site_would_need_nothing_else(case):
    """``cpu.Entries.run_site`` (run_site's checks in C) gives the operator's result for a plain BlockAttnRes
    on plain CPU tensors, and ``None`` (run_site's Python path decides) wherever anything else may apply;
    run_site's result is the module's either way."""
    from attnres_fx import BlockAttnRes
    from attnres_fx.op.module import run_site

    site_class = BlockAttnRes if case != "subclass module" else type("Subclassed", (BlockAttnRes,), {})
    module = site_class(8)
    nn.init.normal_(module.proj.weight)
    sources = [s.detach() for s in _sources((2, 3, 8), 4)]
    with torch.no_grad(), _declines(case, module, sources):
        entered, rest = tuple(sources[:3]), tuple(sources[3:])
        got = cpu.Entries.run_site(BlockAttnRes, module, entered, rest)
        if case == "plain":
            want = torch.ops.attnres_cpu.aggregate(sources, module.proj.weight, module.norm.weight, module.eps, False)
            assert torch.equal(got, want)
        else:
            assert got is None
        if case not in ("meta source", "torch-function mode"):
            torch.testing.assert_close(run_site(module, entered, *rest), module(*sources))


@needs_cpu_kernel
def test_non_contiguous_sources():
    proj, norm = _weights(8)
    sources = [s.detach().transpose(0, 1) for s in _sources((6, 2, 8), 3)]
    got = torch.ops.attnres_cpu.aggregate(sources, proj.weight, norm.weight, EPS, False)
    torch.testing.assert_close(got, aggregation.fusable(proj.weight, norm.weight, sources, eps=EPS,
                                                        preserve_scale=False), rtol=1e-5, atol=1e-6)


@needs_cpu_kernel
def test_weights_of_another_dtype_than_the_sources_and_of_each_other():
    proj, norm = _weights(24)
    sources = [s.detach() for s in _sources((3, 4, 24), 4, torch.bfloat16)]
    norm_bf16 = norm.weight.detach().to(torch.bfloat16)
    got = torch.ops.attnres_cpu.aggregate(sources, proj.weight, norm_bf16, EPS, False)
    want = aggregation.fusable(proj.weight, norm_bf16, sources, eps=EPS, preserve_scale=False)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.float().abs().max().item())


@pytest.mark.parametrize("sources, message", [
    ([], "at least one source"),
    ([torch.randn(2, 8), torch.randn(3, 8)], "shape, dtype and device"),
    ([torch.randn(2, 8), torch.randn(2, 8, dtype=torch.bfloat16)], "shape, dtype and device"),
    ([torch.randn(2, 8, dtype=torch.float64)], "float32, bfloat16 or float16"),
    ([torch.randn(2, 0)], "D > 0"),
    ([torch.randn(2, 7)], "D = 7 elements"),
], ids=["empty", "shapes", "dtypes", "float64", "zero-width", "weights"])
def test_bad_inputs_raise_a_clear_error(sources, message):
    proj, norm = _weights(8)
    with pytest.raises(ValueError, match=message):
        ops.aggregate(sources, proj.weight, norm.weight, eps=EPS, preserve_scale=False)


@needs_cpu_kernel
def test_the_cpu_kernel_checks_its_inputs_too():
    proj, norm = _weights(8)
    with pytest.raises(RuntimeError, match="every source must have the shape of the first"):
        torch.ops.attnres_cpu.aggregate([torch.randn(2, 8), torch.randn(3, 8)], proj.weight, norm.weight, EPS, False)
    with pytest.raises(RuntimeError, match="must have D = 8 elements"):
        torch.ops.attnres_cpu.aggregate([torch.randn(2, 8)], torch.ones(1, 7), norm.weight, EPS, False)


@pytest.mark.slow
def test_without_a_compiler_one_warning_and_the_same_result(tmp_path):
    """A fresh cache and a compiler that does not exist: the PyTorch formulation, with one warning."""
    script = textwrap.dedent("""
        import warnings
        import torch
        from attnres_fx import BlockAttnRes
        from attnres_fx.op import aggregation
        from attnres_fx.op.kernels import cpu
        torch.manual_seed(0)
        module = BlockAttnRes(16)
        torch.nn.init.normal_(module.proj.weight)
        sources = [torch.randn(2, 40, 16) for _ in range(3)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = [module(*sources), module(*sources)]
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1, messages
        print(messages[0])
        want = aggregation.fusable(module.proj.weight, module.norm.weight, sources, eps=module.eps,
                                   preserve_scale=False)
        for o in out:
            torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-6)
        assert not cpu.available() and "no C++ compiler" in cpu.unavailable_reason()
    """)
    env = {**os.environ, "CXX": str(tmp_path / "missing-compiler"), cpu.CACHE_ENV: str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "C++ CPU kernel is not available (no C++ compiler" in done.stdout
    assert "PyTorch ops" in done.stdout


@needs_cpu_kernel
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.float16)], ids=["fp32", "bf16-proj", "fp16-norm"])
def test_the_cpu_nodes_weight_gradients_in_each_weights_dtype(dtypes):
    """The C++ node's dL/dproj and dL/dnorm (one loop, ``attnres_cpu::weight_grads``) against autograd
    through the PyTorch formulation: each in its weight's dtype and shape, equal to that dtype's rounding
    (1e-5 relative in fp32, where only the order of the fp32 sums differs; one unit of the weight's dtype
    otherwise); and only the gradients asked for."""
    proj, norm = _weights(37)
    proj_weight = proj.weight.detach().to(dtypes[0]).requires_grad_()
    norm_weight = norm.weight.detach().to(dtypes[1]).requires_grad_()
    sources = _sources((3, 5, 37), 6)
    grad = torch.randn(3, 5, 37)
    got = torch.autograd.grad(torch.ops.attnres_cpu.aggregate(sources, proj_weight, norm_weight, EPS, False),
                              [proj_weight, norm_weight], grad)
    want = torch.autograd.grad(aggregation.fusable(proj_weight, norm_weight, sources, eps=EPS, preserve_scale=False),
                               [proj_weight, norm_weight], grad)
    for g, w, weight in zip(got, want, (proj_weight, norm_weight)):
        assert g.dtype == weight.dtype and g.shape == weight.shape
        tolerance = 1e-5 if weight.dtype == torch.float32 else torch.finfo(weight.dtype).eps
        torch.testing.assert_close(g.float(), w.float(), rtol=tolerance, atol=tolerance * w.float().abs().max().item())
    only_norm = torch.autograd.grad(torch.ops.attnres_cpu.aggregate(sources, proj_weight.detach(), norm_weight, EPS,
                                                                    False), [norm_weight], grad)
    torch.testing.assert_close(only_norm[0].float(), got[1].float(), rtol=0, atol=0)


@needs_cpu_kernel
def test_opcheck_of_the_weight_gradients():
    proj, norm = _weights(33)
    torch.library.opcheck(torch.ops.attnres_cpu.weight_grads.default,
                          (torch.randn(33), proj.weight.detach(), norm.weight.detach()))
    with pytest.raises(RuntimeError, match="weights of as many elements"):
        torch.ops.attnres_cpu.weight_grads(torch.randn(33), proj.weight.detach(), torch.ones(32))


CPU_KERNEL_CASES = [(1, (2, 3, 1), torch.float32), (2, (1, 1, 7), torch.float32), (5, (2, 64, 33), torch.bfloat16),
                    (9, (2, 16, 128), torch.float32), (3, (4, 50, 1000), torch.float16)]


@needs_cpu_kernel
@pytest.mark.parametrize("k, shape, dtype", CPU_KERNEL_CASES, ids=[f"{k}x{'x'.join(map(str, s))}-{str(d)[6:]}"
                                                                   for k, s, d in CPU_KERNEL_CASES])
def test_the_backward_from_the_forwards_logits_equals_the_one_that_recomputes_them(k, shape, dtype):
    """``aggregate_saving_logits`` gives ``aggregate``'s result bit for bit and the logits' parts (q . v and
    the key scale per token and source); the backward given them equals the one that recomputes them up to
    the order of g . v's fp32 sum (two accumulator chains instead of one): 1e-6 relative in fp32, where
    the rest is bitwise the same arithmetic; one unit of the storage dtype otherwise."""
    generator = torch.Generator().manual_seed(k)
    sources = [torch.randn(shape, generator=generator).to(dtype) for _ in range(k)]
    proj = torch.randn(1, shape[-1], generator=generator) * 0.3
    norm = torch.rand(shape[-1], generator=generator) + 0.5
    grad = torch.randn(shape, generator=generator).to(dtype)
    out, saved = torch.ops.attnres_cpu.aggregate_saving_logits(sources, proj, norm, EPS, k % 2 == 0)
    assert torch.equal(out, torch.ops.attnres_cpu.aggregate(sources, proj, norm, EPS, k % 2 == 0))
    tokens = out.numel() // shape[-1]
    assert saved.shape == (2, k, tokens) and saved.dtype == torch.float32
    values = torch.stack([s.float().reshape(tokens, -1) for s in sources])
    torch.testing.assert_close(saved[0], values @ (proj[0] * norm), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(saved[1], torch.rsqrt(values.square().mean(-1) + EPS), rtol=1e-5, atol=0)
    want = torch.ops.attnres_cpu.aggregate_backward(grad, sources, proj, norm, EPS, k % 2 == 0)
    got = torch.ops.attnres_cpu.aggregate_backward_saved(grad, sources, saved, proj, norm, EPS, k % 2 == 0)
    tolerance = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
    for g, w in zip([*got[0], got[1]], [*want[0], want[1]]):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=tolerance, atol=tolerance * w.float().abs().max().item())


@needs_cpu_kernel
def test_the_backward_refuses_saved_logits_of_another_shape():
    sources = [torch.randn(2, 3, 8) for _ in range(2)]
    proj, norm = torch.randn(1, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match=r"saved logits must be float32 \[2, K, T\] = \[2, 2, 6\]"):
        torch.ops.attnres_cpu.aggregate_backward_saved(torch.randn(2, 3, 8), sources, torch.zeros(2, 3, 6), proj,
                                                       norm, EPS, False)


@needs_cpu_kernel
def test_opcheck_of_the_operators_that_save_and_take_the_logits():
    proj, norm = _weights(33)
    sources = [s.detach() for s in _sources((2, 5, 33), 3)]
    out, saved = torch.ops.attnres_cpu.aggregate_saving_logits(sources, proj.weight.detach(), norm.weight.detach(),
                                                                EPS, False)
    torch.library.opcheck(torch.ops.attnres_cpu.aggregate_saving_logits.default,
                          (sources, proj.weight.detach(), norm.weight.detach(), EPS, False))
    torch.library.opcheck(torch.ops.attnres_cpu.aggregate_backward_saved.default,
                          (torch.randn(2, 5, 33), sources, saved, proj.weight.detach(), norm.weight.detach(), EPS,
                           False))
