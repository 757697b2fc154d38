"""The fusion of a site's aggregation with the RMS norm that alone reads it (attnres_fx/passes/fuse_norms.py).

Numerical: the fused call against ``norm(run_site(...))`` on the same inputs, values and gradients: the same
aggregate, then the norm's sums (mean of squares; the backward's ``u . x`` and the weight's gradient over
rows) in another order and ``1 / sqrt`` for ``rsqrt``: a few units in the last place of fp32 (rtol 1e-5,
atol 1e-6). A converted model's outputs and gradients against the same model's with a global forward hook
registered (which every fused call declines): those differences carried through the layers, 1e-5 relative
with the pseudo-queries the conversion makes (zero) and with small random ones.
Structural: which norms match, which calls the block code makes, the count in ``stats``; with gradients, one
node that keeps no copy of the aggregate (its backward recomputes it: gradients as the two nodes give, the same
few units in the last place).
Failure: every call the fused entry must not take runs as the two modules would (hooks, a replaced norm,
a replaced forward, bf16, subclasses); an eps changed after conversion is read. Gradients of gradients
(``create_graph=True``) are the PyTorch formulation's.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import attnres_fx
from attnres_fx import models, routing
from attnres_fx.checks import relative_error
from attnres_fx.conversion import conversion_of
from attnres_fx.op.kernels import cpu
from attnres_fx.op import aggregation
from attnres_fx.op.module import BlockAttnRes, run_site, site_normed
from attnres_fx.capture.block_tracer import module_graph
from attnres_fx.passes import fuse_norms
from attnres_fx.testing import family, handwritten, randomise_pseudo_queries
from hf_models import needs_hf

needs_cpu_kernel = pytest.mark.skipif(not cpu.available(), reason=f"the C++ kernel: {cpu.unavailable_reason()}")

RTOL, ATOL = 1e-5, 1e-6


class Squared(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.epsilon = eps

    def forward(self, x):
        return self.scale * (x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + self.epsilon))


class OnePlusWeight(models.ScaledNorm):
    """Gemma's form: ``x * rsqrt(...) * (1 + weight)``."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class WeightPlusBuffer(models.ScaledNorm):
    """``weight + shift`` with ``shift`` a buffer, not a constant: not the matched function."""

    def __init__(self, dim, eps):
        super().__init__(dim, eps)
        self.register_buffer("shift", torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (self.weight + self.shift)


class BufferBias(models.ScaledNorm):
    """A layer norm whose bias is a buffer, not a parameter: not the matched function."""

    def __init__(self, dim):
        super().__init__(dim, 1e-5)
        self.register_buffer("bias", torch.zeros(dim))

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class ConstantEps(models.ScaledNorm):
    """Its eps a literal, not the attribute (which holds another value)."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class HalfCast(models.ManualRMSNorm):
    def forward(self, x):
        x = x.to(torch.float32)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(torch.bfloat16)


class OverDim0(handwritten.RMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + self.eps) * self.weight


MATCHED = {
    "hand-written": lambda d: handwritten.RMSNorm(d, 1e-5),
    "torch RMSNorm": lambda d: nn.RMSNorm(d, eps=1e-6),
    "x * x, other names": lambda d: Squared(d),
    "F.rms_norm, shape read off x": lambda d: models.FunctionalRMSNorm(d, 1e-5),
    "upcast written out": lambda d: models.ManualRMSNorm(d, 1e-5),
    "1 + weight": lambda d: OnePlusWeight(d, 1e-6),
    "torch LayerNorm": lambda d: nn.LayerNorm(d),
    "torch LayerNorm, no bias": lambda d: nn.LayerNorm(d, bias=False),
    "F.layer_norm, shape read off x": lambda d: models.FunctionalLayerNorm(d, 1e-5),
}
CENTRED = {"torch LayerNorm", "torch LayerNorm, no bias", "F.layer_norm, shape read off x"}
UNMATCHED = {
    "layer norm without weight": (lambda d: nn.LayerNorm(d, elementwise_affine=False), "computes no RMS norm"),
    "layer norm, bias a buffer": (lambda d: BufferBias(d), "its bias is no [D] parameter"),
    "layer norm, eps a constant": (lambda d: family.FunctionalLayerNorm(d), "no float attribute"),
    "weight + a tensor": (lambda d: WeightPlusBuffer(d, 1e-6), "computes no RMS norm"),
    "eps a constant": (lambda d: ConstantEps(d, 0.5), "no float attribute"),
    "no weight": (lambda d: nn.RMSNorm(d, eps=1e-6, elementwise_affine=False), "computes no RMS norm"),
    "eps None": (lambda d: nn.RMSNorm(d), "computes no RMS norm"),
    "bf16 cast": (lambda d: HalfCast(d, 1e-6), "computes no RMS norm"),
    "over another dim": (lambda d: OverDim0(d, 1e-5), "computes no RMS norm"),
}


def matched(norm):
    return fuse_norms.match_norm(norm, module_graph(norm))


def _randomised(norm):
    with torch.no_grad():
        for parameter in norm.parameters():
            parameter.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    return norm


def _site(dim, preserve_scale=False):
    module = BlockAttnRes(dim, preserve_scale=preserve_scale)
    with torch.no_grad():
        module.proj.weight.normal_(0, 1, generator=torch.Generator().manual_seed(1))
    return module


def _sources(shape, count):
    generator = torch.Generator().manual_seed(count)
    return [torch.randn(shape, generator=generator) for _ in range(count)]


@pytest.mark.parametrize("name", MATCHED)
def test_rms_norms_written_in_each_form_match(name):
    norm = MATCHED[name](16)
    match = matched(norm)
    assert match, match.reason
    assert match.norm_class is type(norm) and match.forward is type(norm).forward
    assert isinstance(norm._parameters[match.weight], nn.Parameter) and type(getattr(norm, match.eps)) is float
    assert ("training", norm.training) in match.constants and match.eps not in dict(match.constants)
    assert match.weight_offset == (1.0 if name == "1 + weight" else 0.0)
    assert match.centred == (name in CENTRED)
    assert match.bias == ("bias" if name in CENTRED and name != "torch LayerNorm, no bias" else None)


@needs_hf
def test_transformers_rms_norms_match():
    """transformers' own (Llama's, which Qwen, Mistral and others copy): fp32 upcast, eps as
    ``variance_epsilon``, ``weight * x.to(input_dtype)``."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = _randomised(LlamaRMSNorm(16, eps=1e-6))
    match = matched(norm)
    assert match and (match.weight, match.eps) == ("weight", "variance_epsilon")
    module, entered, partial = _site(16), _sources((2, 5, 16), 3), torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(site_normed(match)(module, norm, entered, partial),
                                   norm(run_site(module, entered, partial)), rtol=RTOL, atol=ATOL)


@needs_hf
def test_gemma_rms_norms_match_with_their_one_plus_weight():
    """Gemma 2's and Gemma 3's: ``(x.float() * rsqrt(...)) * (1.0 + weight.float())``, cast back to the input's
    dtype."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    for norm_class in (Gemma2RMSNorm, Gemma3RMSNorm):
        norm = _randomised(norm_class(16, eps=1e-6))
        match = matched(norm)
        assert match and (match.weight, match.eps, match.weight_offset) == ("weight", "eps", 1.0)
        module, entered, partial = _site(16), _sources((2, 5, 16), 3), torch.randn(2, 5, 16)
        with torch.no_grad():
            torch.testing.assert_close(site_normed(match)(module, norm, entered, partial),
                                       norm(run_site(module, entered, partial)), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", UNMATCHED)
def test_other_norms_do_not_match_and_say_why(name):
    build, reason = UNMATCHED[name]
    match = matched(build(16))
    assert not match and reason in match.reason


@needs_cpu_kernel
@pytest.mark.parametrize("name", MATCHED)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 37, 64), (3, 5, 100)], ids=["one token", "many", "odd width"])
@pytest.mark.parametrize("preserve_scale", [False, True])
def test_the_fused_call_is_the_norm_of_the_aggregate(name, shape, preserve_scale):
    norm = _randomised(MATCHED[name](shape[-1]))
    module = _site(shape[-1], preserve_scale)
    entered, partial = _sources(shape, 3), torch.randn(shape)
    fused = site_normed(matched(norm))
    with torch.no_grad():
        want = norm(run_site(module, entered, partial))
        match = matched(norm)
        got = cpu.Entries.run_site_normed(BlockAttnRes, module, entered, (partial,), norm, match.norm_class,
                                          match.forward, match.weight, match.eps, match.weight_offset,
                                          match.bias, match.centred)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(fused(module, norm, entered, partial), want, rtol=RTOL, atol=ATOL)


def _declines(case, module, norm, sources):
    """Set up ``case`` (undone on exit): a call the fused entry must leave to ``norm(run_site(...))``."""
    stack = contextlib.ExitStack()
    if case == "norm forward hook":
        stack.callback(norm.register_forward_hook(lambda m, a, o: o * 2).remove)
    elif case == "norm pre-hook":
        stack.callback(norm.register_forward_pre_hook(lambda m, a: (a[0] * 3,)).remove)
    elif case == "global hook":
        stack.callback(nn.modules.module.register_module_forward_hook(lambda m, a, o: None).remove)
    elif case == "site hook":
        stack.callback(module.register_forward_hook(lambda m, a, o: o + 1).remove)
    elif case == "instance forward":
        norm.forward = lambda x: x
        stack.callback(lambda: norm.__dict__.pop("forward"))
    elif case == "class forward replaced":
        original = type(norm).forward
        type(norm).forward = lambda self, x: original(self, x) + 1
        stack.callback(lambda: setattr(type(norm), "forward", original))
    elif case == "bf16":
        sources[:] = [s.bfloat16() for s in sources]
    elif case == "tensor subclass":
        sources[-1] = sources[-1].as_subclass(_Subclass)
    return stack


class _Subclass(torch.Tensor):
    pass


class _Norm(handwritten.RMSNorm):
    pass


@needs_cpu_kernel
@pytest.mark.parametrize("case", ["plain", "norm forward hook", "norm pre-hook", "global hook",
                                  "site hook", "instance forward", "class forward replaced", "bf16",
                                  "tensor subclass", "another norm class", "eps changed"])
def test_calls_the_fused_entry_cannot_take_run_as_the_two_modules_would(case):
    norm = _randomised(_Norm(32, 1e-5))
    match = matched(norm)
    fused = site_normed(match)
    module = _site(32)
    sources = _sources((2, 3, 32), 4)
    if case == "another norm class":
        norm = _randomised(nn.LayerNorm(32))
    if case == "eps changed":
        norm.eps = 0.5
    if case == "bf16":
        module, norm = module.bfloat16(), norm.bfloat16()
    with torch.no_grad(), _declines(case, module, norm, sources):
        entered, rest = sources[:3], sources[3:]
        entry = cpu.Entries.run_site_normed(BlockAttnRes, module, entered, tuple(rest), norm, match.norm_class,
                                            match.forward, match.weight, match.eps, match.weight_offset,
                                            match.bias, match.centred)
        assert (entry is None) == (case not in ("plain", "eps changed"))
        want = norm(module(*entered, *rest))
        got = fused(module, norm, entered, *rest)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@needs_cpu_kernel
@pytest.mark.parametrize("name", MATCHED)
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 37, 64), (3, 5, 100)], ids=["one token", "many", "odd width"])
def test_with_gradients_the_fused_call_gives_the_two_modules_gradients(name, shape):
    norm = _randomised(MATCHED[name](shape[-1]))
    module = _site(shape[-1])
    fused = site_normed(matched(norm))
    sources = [s.requires_grad_() for s in _sources(shape, 4)]
    leaves = [*sources, module.proj.weight, module.norm.weight, *norm.parameters()]
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    got = fused(module, norm, sources[:3], sources[3])
    assert "AggregateFunction" in got.grad_fn.name(), "one C++ node for the site and the norm"
    # The norm's parameters' edges: to each parameter itself, or through the node that adds Gemma's 1 to it.
    reached = [edge for edge, _ in got.grad_fn.next_functions if edge]
    reached += [edge for node in reached for edge, _ in node.next_functions if edge]
    for parameter in norm.parameters():
        assert any(getattr(edge, "variable", None) is parameter for edge in reached)
    got_grads = torch.autograd.grad(got, leaves, grad)
    want = norm(module(*sources))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for got_grad, want_grad in zip(got_grads, torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(got_grad, want_grad, rtol=RTOL, atol=1e-5)


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# The fused operator's norms: (centred, with a bias).
KINDS = {"rms norm": (False, False), "layer norm": (True, True), "layer norm, no bias": (True, False)}


def _fused_and_apart(shape, count, preserve_scale, kind="rms norm"):
    """The fused operator's result and gradients, and those of the aggregation's operator followed by the
    norm's PyTorch ops (``F.layer_norm`` for a layer norm)."""
    centred, biased = KINDS[kind]
    sources = [s.requires_grad_() for s in _sources(shape, count)]
    module = _site(shape[-1])
    generator = torch.Generator().manual_seed(3)
    weight = (torch.rand(shape[-1], generator=generator) + 0.5).requires_grad_()
    bias = torch.randn(shape[-1], generator=generator).requires_grad_() if biased else None
    leaves = [*sources, module.proj.weight, module.norm.weight, weight, *([bias] if biased else [])]
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    ops = torch.ops.attnres_cpu
    got = ops.aggregate_normed(sources, module.proj.weight, module.norm.weight, 1e-6, preserve_scale, weight, 1e-5,
                               bias, centred)
    aggregate = ops.aggregate(sources, module.proj.weight, module.norm.weight, 1e-6, preserve_scale)
    want = (torch.nn.functional.layer_norm(aggregate, (shape[-1],), weight, bias, 1e-5) if centred
            else _rms_norm(aggregate, weight, 1e-5))
    with torch.no_grad():  # no node: the forward alone (one for a few tokens, aggregate_few_tokens)
        torch.testing.assert_close(
            ops.aggregate_normed(sources, module.proj.weight, module.norm.weight, 1e-6, preserve_scale, weight, 1e-5,
                                 bias, centred), want, rtol=RTOL, atol=ATOL)
    return (got, torch.autograd.grad(got, leaves, grad)), (want, torch.autograd.grad(want, leaves, grad))


@needs_cpu_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preserve_scale", [False, True])
@pytest.mark.parametrize("shape,count", [((2, 37, 64), 3), ((1, 1, 40), 1), ((3, 70, 100), 9)],
                         ids=["many", "one token and source", "odd width, nine sources"])
def test_the_fused_operator_gives_the_gradients_of_the_two_apart(shape, count, preserve_scale, kind):
    """Its backward recomputes the rows before the norm from the sources and the saved logits: the same
    gradients as the aggregation's node followed by the norm's ops, a few units in fp32's last place apart (the
    norm's sums in another order; the recomputed rows differ from the stored ones by as much: a softmax
    divided rather than multiplied). The weights' gradients sum over every token: up to 7e-6 apart relative
    to their norm at 210 tokens; bound 2e-5."""
    (got, got_grads), (want, want_grads) = _fused_and_apart(shape, count, preserve_scale, kind)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert relative_error(got_grad, want_grad) < 2e-5


@needs_cpu_kernel
def test_the_fused_operator_keeps_no_rows_between_the_aggregation_and_the_norm():
    """What its node saves: the sources, the logits' parts (2 x K x T floats), the three weights; the norm's
    ops called apart keep their input and more, stream-sized tensors."""
    sources = [s.requires_grad_() for s in _sources((2, 16, 32), 3)]
    module = _site(32)
    weight = torch.ones(32, requires_grad=True)
    ops = torch.ops.attnres_cpu

    def saved(call):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            call()
        stream = {s.data_ptr() for s in sources}
        return sorted(tuple(t.shape) for t in kept if t.data_ptr() not in stream), len(kept)

    fused, count = saved(lambda: ops.aggregate_normed(sources, module.proj.weight, module.norm.weight, 1e-6, False,
                                                      weight, 1e-5))
    assert fused == [(1, 32), (2, 3, 32), (32,), (32,)] and count == 3 + 4
    apart, _ = saved(lambda: _rms_norm(ops.aggregate(sources, module.proj.weight, module.norm.weight, 1e-6, False),
                                       weight, 1e-5))
    assert (2, 16, 32) in apart


@needs_cpu_kernel
def test_the_fused_operator_under_a_profiler_calls_its_backward_through_the_dispatcher():
    """A profiler sees the backward's operator (a site then deposits nothing: Note [gradient deposits])."""
    with torch.profiler.profile() as profile:
        (_, got_grads), (_, want_grads) = _fused_and_apart((2, 9, 48), 3, False)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert relative_error(got_grad, want_grad) < 2e-5
    names = {event.name for event in profile.events()}
    assert {"attnres_cpu::aggregate_normed_saving_logits", "attnres_cpu::aggregate_normed_backward_saved"} <= names


@needs_cpu_kernel
def test_the_fused_operator_refuses_a_gradient_through_bf16():
    module = _site(8)
    sources = [s.to(torch.bfloat16).requires_grad_() for s in _sources((2, 3, 8), 2)]
    with pytest.raises(RuntimeError, match="float32 sources only"):
        torch.ops.attnres_cpu.aggregate_normed(sources, module.proj.weight.bfloat16(), module.norm.weight.bfloat16(),
                                               1e-6, False, torch.ones(8, dtype=torch.bfloat16), 1e-5)


@needs_cpu_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preserve_scale", [False, True])
def test_the_fused_operators_gradients_of_gradients_are_the_two_apart(preserve_scale, kind):
    """A backward recording its graph (``create_graph=True``: a gradient penalty) differentiates the PyTorch
    formulation of the aggregation and the norm: second derivatives as theirs, 1e-6 to 4e-5 apart
    (relative_error; fp32 through a softmax and three rsqrt), bound 1e-4."""
    centred, biased = KINDS[kind]
    module = _site(33, preserve_scale)
    branches = [branch.requires_grad_() for branch in _sources((2, 7, 33), 5)]
    generator = torch.Generator().manual_seed(3)
    weight = (torch.rand(33, generator=generator) + 0.5).requires_grad_()
    bias = torch.randn(33, generator=generator).requires_grad_() if biased else None
    leaves = [*branches, module.proj.weight, module.norm.weight, weight, *([bias] if biased else [])]

    def stream():  # each source the sum of the branches so far, as a stream's blocks are
        return [sum(branches[:i + 1]) for i in range(len(branches))]

    def second(call):
        grads = torch.autograd.grad(call().square().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum(grad.square().sum() for grad in grads), leaves)

    def apart():
        aggregate = aggregation.fusable(module.proj.weight, module.norm.weight, stream(), eps=1e-6,
                                        preserve_scale=preserve_scale)
        if centred:
            return torch.nn.functional.layer_norm(aggregate, (33,), weight, bias, 1e-5)
        return _rms_norm(aggregate, weight, 1e-5)

    got = second(lambda: torch.ops.attnres_cpu.aggregate_normed(stream(), module.proj.weight, module.norm.weight,
                                                                1e-6, preserve_scale, weight, 1e-5, bias, centred))
    want = second(apart)
    for got_grad, want_grad in zip(got, want, strict=True):
        assert relative_error(got_grad, want_grad) < 1e-4


def _handwritten(layers=4):
    config = handwritten.HandwrittenConfig(dim=64, layers=layers, heads=2, vocab=97, max_batch=2, max_seq=32)
    torch.manual_seed(0)
    return handwritten.Transformer(config).eval()


IDS = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(0))


@contextlib.contextmanager
def nothing_fused():
    """Within: every fused call declines (a global forward hook, which it leaves to the modules)."""
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        yield
    finally:
        handle.remove()


def _tiny(layers=4):
    torch.manual_seed(0)
    return models.TinyTransformer(dim=64, num_layers=layers, num_heads=2, vocab_size=97).eval()


# Per model: the model, its calls without gradients (a prompt, one token after it where it has a cache), its
# training call, and a norm parameter of each layer a fused call must reach.
MODELS = {
    "hand-written Llama (RMS norms)": (_handwritten, lambda m: (m(IDS, 0), m(IDS[:, :1], 7)), lambda m: m(IDS, 0),
                                       ("layers.{}.attention_norm.weight",)),
    "TinyTransformer (layer norms)": (_tiny, lambda m: (m(IDS),), lambda m: m(IDS),
                                      ("blocks.{}.ln1.weight", "blocks.{}.ln1.bias")),
}


@needs_cpu_kernel
@pytest.mark.parametrize("std", [0.0, 0.1])
@pytest.mark.parametrize("name", MODELS)
def test_a_converted_model_computes_what_its_modules_compute(std, name):
    """Outputs without gradients, and a training step's loss and gradients, fused against not."""
    build, calls, train_call, reached = MODELS[name]
    model = attnres_fx.attnresify(build(), (IDS,))
    if std:
        randomise_pseudo_queries(model, std=std)
    stats = conversion_of(model).stats
    with torch.no_grad():
        fused = calls(model)
        with nothing_fused():
            plain = calls(model)
    assert stats.fused_norms > 0
    for got, want in zip(fused, plain, strict=True):
        assert relative_error(got, want) < 1e-5
    model.train()
    results = []
    for context in (contextlib.nullcontext, nothing_fused):
        model.zero_grad()
        with context():
            loss = train_call(model).logsumexp(-1).mean()
            loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (loss, grads), (plain_loss, plain_grads) = results
    assert relative_error(loss, plain_loss) < 1e-5
    for parameter, grad in grads.items():
        assert relative_error(grad, plain_grads[parameter]) < 1e-4, parameter
    assert all(grads[each.format(k)].abs().sum() > 0 for k in range(4) for each in reached)


@needs_cpu_kernel
def test_the_block_code_calls_the_fused_entry_where_a_norm_alone_reads_a_site():
    """Each layer's two sites are read by its two norms alone (the stream's final one by the model's norm,
    outside the blocks): the eager code fuses those; the per-site graph that the two-phase form and
    TorchDynamo start from keeps its run_site calls."""
    model = attnres_fx.attnresify(_handwritten(layers=4), (IDS,))
    with torch.no_grad():
        model(IDS, 0)
    variants = [variant for router in routing.routers(model) if isinstance(router, routing.LayerRouter)
                for routes in router._shapes.values() for variant in routes.variants.values()]
    assert variants
    for variant in variants:
        names = variant.forward.__code__.co_names
        assert sum(name.startswith("attnres_fx_op_module_site_normed") for name in names) == 2, names
        assert len(variant.graph_module.graph.find_nodes(op="call_function", target=run_site)) >= 2
    stats = conversion_of(model).stats
    assert stats.fused_norms == 2 * stats.rewrites


@needs_cpu_kernel
def test_hooks_and_replacements_on_a_norm_after_conversion_are_honoured():
    """The same model where nothing fuses is the reference."""
    model = randomise_pseudo_queries(attnres_fx.attnresify(_handwritten(), (IDS,)), std=0.1)

    def both():
        with torch.no_grad():
            fused = model(IDS, 0)
            with nothing_fused():
                return fused, model(IDS, 0)

    both()
    calls = []
    handle = model.layers[1].attention_norm.register_forward_hook(lambda m, a, o: calls.append(1) or o * 2)
    got, want = both()
    handle.remove()
    assert len(calls) == 2 and relative_error(got, want) < 1e-5
    unhooked, _ = both()
    assert relative_error(got, unhooked) > 1e-3, "the hook changed the result"
    model.layers[1].ffn_norm = nn.LayerNorm(64)            # another norm in its place
    got, want = both()
    assert relative_error(got, want) < 1e-5 and relative_error(got, unhooked) > 1e-3
    model.layers[2].attention_norm.eps = 0.25              # an eps changed after conversion
    before = got
    got, want = both()
    assert relative_error(got, want) < 1e-5 and relative_error(got, before) > 1e-4


@needs_cpu_kernel
@pytest.mark.slow
def test_the_first_call_of_a_process_fuses_as_every_later_one():
    """The process's first aggregation loads the kernel (its entries are None before): that call is fused
    too, so a server's first answer is bit for bit its later ones."""
    code = textwrap.dedent("""
        import torch, attnres_fx
        from attnres_fx.testing import handwritten
        from attnres_fx.conversion import conversion_of
        torch.manual_seed(0)
        config = handwritten.HandwrittenConfig(dim=64, layers=2, heads=2, vocab=97, max_batch=1, max_seq=16)
        ids = torch.randint(1, 97, (1, 5))
        model = attnres_fx.attnresify(handwritten.Transformer(config).eval(), (ids,))
        from attnres_fx.op.kernels import cpu
        assert cpu.Entries.run_site_normed is None
        with torch.no_grad():
            first, second = model(ids, 0), model(ids, 0)
        print(torch.equal(first, second), conversion_of(model).stats.fused_norms > 0)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.stdout.split() == ["True", "True"], result.stderr[-2000:]


class Offset(models.ScaledNorm):
    """Gemma's offset as an option: with ``offset`` the weight is ``1 + weight``."""

    def __init__(self, dim, eps, offset):
        super().__init__(dim, eps)
        self.offset = offset

    def forward(self, x):
        weight = 1.0 + self.weight if self.offset else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight


@needs_cpu_kernel
def test_norms_of_one_class_with_other_constants_in_blocks_of_one_kind_are_each_computed_as_written():
    """Blocks of one kind share their graphs whatever their norms' constants: a norm whose constant makes
    it another function than the one matched (here every other layer's offset) is not fused."""
    model = _handwritten()
    for index, layer in enumerate(model.layers):
        layer.attention_norm = _randomised(Offset(64, 1e-5, offset=index % 2 == 1))
    with torch.no_grad():
        want = model(IDS, 0)
    converted = attnres_fx.attnresify(model, (IDS,), preserve_scale=True)
    with torch.no_grad():
        got = converted(IDS, 0)
    assert conversion_of(converted).stats.fused_norms > 0
    assert relative_error(got, want) < 1e-5


@needs_cpu_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 3])
def test_opcheck_of_the_fused_operators(count, kind):
    """Schema, fake (meta) and autograd-registration checks of the fused operator (now with its C++ node)
    and of the two it runs with gradients: the forward that keeps the logits' parts, the backward that
    recomputes the aggregate."""
    centred, biased = KINDS[kind]
    module = _site(33)
    sources = [s.requires_grad_() for s in _sources((2, 5, 33), count)]
    generator = torch.Generator().manual_seed(3)
    weight = (torch.rand(33, generator=generator) + 0.5).requires_grad_()
    bias = torch.randn(33, generator=generator).requires_grad_() if biased else None
    ops = torch.ops.attnres_cpu
    torch.library.opcheck(ops.aggregate_normed.default,
                          (sources, module.proj.weight, module.norm.weight, 1e-6, True, weight, 1e-5, bias, centred))
    plain = [s.detach() for s in sources]
    weights = (module.proj.weight.detach(), module.norm.weight.detach())
    norm = (weight.detach(), 1e-5)
    detached_bias = bias.detach() if biased else None
    _, saved = ops.aggregate_normed_saving_logits(plain, *weights, 1e-6, True, *norm, detached_bias, centred)
    torch.library.opcheck(ops.aggregate_normed_saving_logits.default,
                          (plain, *weights, 1e-6, True, *norm, detached_bias, centred))
    torch.library.opcheck(ops.aggregate_normed_backward_saved.default,
                          (torch.randn(2, 5, 33), plain, saved, *weights, 1e-6, True, *norm, centred))
