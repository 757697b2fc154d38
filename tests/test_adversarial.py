"""Adversarial use, as a user would try it: any options and inputs, a first call interrupted or raising
outside the blocks, wrappers and libraries layered before and after conversion (``torch.compile``, PEFT,
torchao, ``torch.inference_mode``), transformers' output recorders, pickling, an input layout Inductor
asserts. Every case either behaves as the original model does, or is refused before anything changes
by an error naming the cause and the way out; the model is then untouched: state, outputs, hooks,
instance attributes, config and ``torch.save`` (``conftest.assert_untouched``). On disk, a save or an
export over an earlier one that fails (a full disk, an interrupt at any line) leaves the earlier one as it
was; a checkpoint whose files come from different saves, or lost its config entry, is refused naming the
file; precision at the edges (mixed dtypes, autocast, a tiny eps) is as documented.

Models are converted with ``preserve_scale=True`` (zero pseudo-queries): the original function, up to
fp32 round-off of the reassociated sums.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnres_fx
from attnres_fx.checks import relative_error
from attnres_fx.models import TinyTransformer, example_ids
from attnres_fx.testing import randomise_pseudo_queries
from conftest import assert_untouched, cold_compile, saves, snapshot
from hf_models import build_hf, needs_hf

EXACT = 1e-5


def tiny(**overrides) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(**{"dim": 32, "num_layers": 2, "num_heads": 4, **overrides}).eval()


TINY = tiny()
IDS = example_ids(TINY.config)
with torch.no_grad():
    TINY_OUT = TINY(IDS)


def close(a, b, tol=EXACT):
    assert a.shape == b.shape and relative_error(a, b) < tol, relative_error(a, b)


# -- options and inputs --------------------------------------------------------------------------------

OPTIONS = st.fixed_dictionaries({}, optional={
    "num_blocks": st.one_of(st.none(), st.integers(-1, 5), st.just(1.5), st.booleans()),
    "block_size": st.one_of(st.none(), st.integers(-1, 5), st.just("2")),
    "preserve_scale": st.one_of(st.booleans(), st.just(1), st.none()),
    "eps": st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.just("1e-6")),
    "allow_partial": st.one_of(st.booleans(), st.just("no")),
    "route": st.sampled_from(["auto", "layer", "model", "stage"]),
    "colour": st.just("blue"),
})


@given(options=OPTIONS)
def test_any_options_convert_and_remove_exactly_or_are_refused_naming_one(options):
    """Whatever the options: either the conversion takes them (its config holds them) and ``remove``
    restores the model exactly, or ``ValueError`` / ``TypeError`` names one of them and nothing changed."""
    model = copy.deepcopy(TINY)
    before = snapshot(model)
    try:
        attnres_fx.attnresify(model, (IDS,), **options)
    except (TypeError, ValueError) as err:
        assert any(name in str(err) for name in options), str(err)
    else:
        config = attnres_fx.config_of(model)
        assert all(getattr(config, name) == value for name, value in options.items() if name != "eps")
        attnres_fx.remove(model)
    assert_untouched(model, before)
    with torch.no_grad():
        assert torch.equal(model(IDS), TINY_OUT)


@pytest.mark.parametrize("args, kwargs, cause", [
    ((), {"idz": IDS}, "unexpected keyword argument 'idz'"),
    ((IDS, IDS), None, "takes 2 positional arguments but 3 were given"),
    (((IDS,),), None, "'tuple' object has no attribute 'shape'"),
], ids=["unknown keyword", "one input too many", "nested tuple"])
def test_inputs_the_model_does_not_take_are_refused_with_the_models_own_error(untouched, args, kwargs, cause):
    model = tiny()
    check = untouched(model, IDS)
    with pytest.raises(attnres_fx.TraceError, match="fails on the example inputs") as err:
        attnres_fx.attnresify(model, args or None, example_kwargs=kwargs)
    assert cause in str(err.value)
    check()


@pytest.mark.parametrize("ids", [IDS[:0], IDS[:, :1], torch.randint(0, 128, (1, 200))],
                         ids=["empty batch", "one token", "long"])
def test_unusual_but_valid_example_shapes_convert_to_the_same_model(ids):
    model = attnres_fx.attnresify(tiny(), (ids,), preserve_scale=True)
    with torch.no_grad():
        close(model(IDS), TINY_OUT)


# -- a first call interrupted, or raising, outside the blocks ------------------------------------------

class Boom(Exception):
    pass


@pytest.fixture(scope="module")
def converted_tiny():
    return attnres_fx.attnresify(copy.deepcopy(TINY), (IDS,), preserve_scale=True)


@pytest.mark.parametrize("where", ["tok_emb", "head", ""], ids=["embedding", "head", "root"])
@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_an_exception_outside_the_blocks_propagates_once_and_the_next_call_works(converted_tiny, where, error):
    raised = []

    def raise_once(module, args):
        if not raised:
            raised.append(error(where))
            raise raised[0]
    handle = converted_tiny.get_submodule(where).register_forward_pre_hook(raise_once)
    try:
        with pytest.raises(error) as caught:
            converted_tiny(IDS)
        assert caught.value is raised[0], "the user's own exception, as itself"
        with torch.no_grad():
            close(converted_tiny(IDS), TINY_OUT)
    finally:
        handle.remove()


# -- torch's own modes and wrappers ---------------------------------------------------------------------

def test_a_conversion_inside_inference_mode_trains_afterwards():
    model = tiny()
    with torch.inference_mode():
        attnres_fx.attnresify(model, (IDS,), preserve_scale=True)
        close(model(IDS), TINY_OUT)
    new = [p for name, p in model.named_parameters() if "_res." in name]
    assert new and not any(p.is_inference() for p in new)
    randomise_pseudo_queries(model)
    model.train()
    model(IDS).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in new[2:]), "every multi-source site learns"


@pytest.mark.slow
@needs_hf
def test_a_torch_compile_wrapper_converts_the_model_it_wraps(tmp_path, untouched):
    """``attnresify(torch.compile(m))``, without example inputs too: both objects are converted, the
    wrapper saves the conversion, and ``remove`` through it restores the model."""
    model = build_hf("llama")
    wrapper = torch.compile(model)      # marks the model compiled (torch's own _is_torch_compile)
    model.save_pretrained(tmp_path / "plain")   # fills in config.architectures and dtype, as any save does
    check = untouched(model)
    assert attnres_fx.attnresify(wrapper, preserve_scale=True) is wrapper
    assert attnres_fx.is_converted(wrapper) and attnres_fx.is_converted(model)
    assert attnres_fx.sites(wrapper)[0].name == "model.layers.0.attn_res"
    wrapper.save_pretrained(tmp_path / "converted")
    saved = json.loads((tmp_path / "converted" / "config.json").read_text())["attnres"]
    assert saved["block_sizes"] == list(attnres_fx.plan_of(wrapper).block_sizes)
    attnres_fx.remove(wrapper)
    assert not attnres_fx.is_converted(model)
    check()


def test_data_parallel_is_looked_through_like_torch_compile():
    """Formerly the wrapper itself was converted: sites named ``module....``, ``is_converted(model)`` False
    while the model ran AttnRes, and the model's save a plain checkpoint."""
    model, alone = tiny(), tiny()
    alone.load_state_dict(model.state_dict())
    wrapper = torch.nn.DataParallel(model)
    assert attnres_fx.attnresify(wrapper, (IDS,), num_blocks=2) is wrapper
    attnres_fx.attnresify(alone, (IDS,), num_blocks=2)
    assert attnres_fx.is_converted(model) and attnres_fx.is_converted(wrapper)
    assert [s.name for s in attnres_fx.sites(wrapper)] == [s.name for s in attnres_fx.sites(model)] == [
        s.name for s in attnres_fx.sites(alone)]
    attnres_fx.remove(wrapper)
    assert not attnres_fx.is_converted(model) and not attnres_fx.sites(model)


@pytest.fixture
def process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_model_inside_distributed_data_parallel_is_refused_and_one_converted_before_is_looked_through(
        process_group):
    """DistributedDataParallel averages the gradients of the parameters it had when built: a conversion
    inside it would add parameters that every rank trains apart."""
    model = tiny()
    before = snapshot(model)
    with pytest.raises(attnres_fx.RoutingError, match=r"inside a DistributedDataParallel.*Convert the model "
                       r"first, then wrap it: DistributedDataParallel\(attnres_fx\.attnresify\(model"):
        attnres_fx.attnresify(torch.nn.parallel.DistributedDataParallel(model), (IDS,))
    assert_untouched(model, before)
    wrapper = torch.nn.parallel.DistributedDataParallel(attnres_fx.attnresify(model, (IDS,), num_blocks=2))
    assert attnres_fx.is_converted(wrapper)
    assert [s.name for s in attnres_fx.sites(wrapper)] == [s.name for s in attnres_fx.sites(model)]
    assert attnres_fx.sites(wrapper)[0].name.startswith("blocks.0")


@pytest.mark.slow
@needs_hf
def test_a_data_parallel_hf_model_saves_a_converted_checkpoint(tmp_path):
    """Formerly a plain checkpoint that reloaded 0.757 off; now the converted model, reloaded exactly."""
    import transformers

    model = build_hf("llama")
    wrapper = torch.nn.DataParallel(model)
    randomise_pseudo_queries(attnres_fx.attnresify(wrapper, num_blocks=2), seed=2, std=0.5)
    assert attnres_fx.sites(model)[0].name == "model.layers.0.attn_res"
    model.save_pretrained(tmp_path / "converted")
    saved = json.loads((tmp_path / "converted" / "config.json").read_text())["attnres"]
    assert saved["block_sizes"] == list(attnres_fx.plan_of(model).block_sizes)
    assert (tmp_path / "converted" / "attnres.safetensors").is_file()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = wrapper(ids).logits
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
        _reloaded(loaded(ids).logits, want)


# -- transformers' output recorders, pickling -----------------------------------------------------------

def _collected(model):
    with torch.no_grad():
        out = model(IDS, output_hidden_states=True, output_attentions=True)
    return len(out.hidden_states), len(out.attentions), out.logits


@pytest.mark.slow
@needs_hf
def test_output_recorders_are_installed_once_and_never_left_behind(untouched):
    """transformers installs its recording hooks at the first call asking for outputs (a config that asks
    for them too), as local functions ``pickle`` cannot take. A conversion installs them for its capture
    and removes them again, failed or not, so the converted model pickles as the original does; and it
    never installs them twice: hidden states and attentions are counted once, before and after a call
    installed them, and after ``remove``."""
    model = build_hf("llama", output_hidden_states=True, output_attentions=True)
    original = copy.deepcopy(model)
    check = untouched(model)
    assert saves(model) == "yes"
    with pytest.raises(ValueError, match="disagree"):
        attnres_fx.attnresify(model, num_blocks=1, block_size=1)
    check()
    attnres_fx.attnresify(model, preserve_scale=True)
    assert saves(model) == "yes"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    assert attnres_fx.is_converted(again)
    want = _collected(original)
    assert want[:2] == (3, 2)
    for got in (_collected(again), _collected(model)):
        assert got[:2] == want[:2]
        close(got[2], want[2])
    attnres_fx.remove(model)
    assert _collected(model)[:2] == want[:2]
    attnres_fx.attnresify(model, preserve_scale=True)     # after a call installed the recorders
    assert _collected(model)[:2] == want[:2]


# -- libraries layered before and after conversion ------------------------------------------------------

@pytest.mark.slow
@needs_hf
def test_a_peft_model_converts_through_the_model_it_wraps():
    """``attnresify`` and ``freeze`` / ``unfreeze`` of a ``PeftModel`` act on the model it wraps; its
    LoRA adapters (random, so they count) keep working, and ``merge_and_unload`` gives the converted
    model with the adapters merged."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    wrapped = peft.get_peft_model(build_hf("llama"), lora)
    want = _collected(wrapped)[2]
    assert attnres_fx.attnresify(wrapped, preserve_scale=True) is wrapped
    assert attnres_fx.is_converted(wrapped) and attnres_fx.is_converted(wrapped.get_base_model())
    close(_collected(wrapped)[2], want)
    queries = [m.proj.weight for m in wrapped.modules() if isinstance(m, attnres_fx.BlockAttnRes)]
    attnres_fx.freeze(wrapped)
    assert not any(q.requires_grad for q in queries)
    attnres_fx.unfreeze(wrapped)
    assert all(q.requires_grad for q in queries)
    merged = wrapped.merge_and_unload()
    assert attnres_fx.is_converted(merged)
    close(_collected(merged)[2], want)


@pytest.mark.parametrize("order", ["quantized after conversion", "quantized before conversion"])
def test_torchao_weight_only_quantization_leaves_the_pseudo_queries_in_full_precision(order):
    quantization = pytest.importorskip("torchao.quantization")
    quantized = copy.deepcopy(TINY)
    quantization.quantize_(quantized, quantization.Int8WeightOnlyConfig())
    model = copy.deepcopy(TINY if order.endswith("after conversion") else quantized)
    attnres_fx.attnresify(model, (IDS,), preserve_scale=True)
    keys = list(model.state_dict())
    if order.endswith("after conversion"):
        quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    assert type(model.blocks[0].attn.qkv.weight) is not torch.nn.Parameter, "the layers are quantized"
    for module in model.modules():
        if isinstance(module, attnres_fx.BlockAttnRes):
            assert type(module.proj.weight) is torch.nn.Parameter and module.proj.weight.dtype == torch.float32
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        close(model(IDS), quantized(IDS))


# -- an input layout Inductor asserts --------------------------------------------------------------------

class TransposedEmbedding(TinyTransformer):
    """The stream starts as a transposed view, as SigLIP's patch embeddings do (``flatten(2).transpose(1, 2)``):
    block 0, the embedding, is not contiguous."""

    def embed(self, ids):
        x = super().embed(ids)
        return x.transpose(1, 2).contiguous().transpose(1, 2)


@cold_compile
@pytest.mark.slow
def test_a_non_contiguous_embedding_compiles_on_the_layer_route():
    torch.manual_seed(0)
    original = TransposedEmbedding(dim=32, num_layers=2, num_heads=4).eval()
    model = attnres_fx.attnresify(copy.deepcopy(original), (IDS,), preserve_scale=True)
    randomise_pseudo_queries(model)
    with torch.no_grad():
        want = model(IDS)
        attnres_fx.compile(model)
        close(model(IDS), want)


# -- edges of precision and options ----------------------------------------------------------------------

def _fp64_aggregate(module, sources):
    """The aggregation's formula in fp64: the reference a fp32 computation is held to."""
    values = torch.stack([s.double() for s in sources])
    query = module.proj.weight[0].double() * module.norm.weight.double()
    keys = values * torch.rsqrt(values.square().mean(-1, keepdim=True) + module.eps)
    return (torch.softmax(keys @ query, 0).unsqueeze(-1) * values).sum(0)


def _mixed_sources():
    generator = torch.Generator().manual_seed(0)
    module = attnres_fx.BlockAttnRes(64)
    with torch.no_grad():
        module.proj.weight.copy_(torch.randn(1, 64, generator=generator))
    embedding = torch.randn(2, 5, 64, generator=generator).bfloat16()
    outputs = [torch.randn(2, 5, 64, generator=generator) for _ in range(2)]
    return module, [embedding, *outputs]


@pytest.mark.parametrize("mode", ["eager", "autocast", "autocast, captured"])
def test_mixed_dtype_sources_aggregate_in_fp32_into_the_streams_dtype(mode):
    """A bf16 embedding with fp32 sublayer outputs is an fp32 stream (as the residual adds promote): the
    aggregate is fp32 and within fp32 round-off (1e-6) of the fp64 formula, eagerly and under
    ``torch.autocast`` (which would run the dot products as bf16 matmuls, some 1e-2 off), captured too."""
    module, sources = _mixed_sources()
    call = torch.compile(module, backend="eager", fullgraph=True) if "captured" in mode else module
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in mode)
    with torch.no_grad(), autocast:
        out = call(*sources)
    assert out.dtype == torch.float32
    assert (out.double() - _fp64_aggregate(module, sources)).abs().max() < 1e-6


def test_two_phase_and_export_forms_keep_fp32_under_autocast():
    """The forms graph captures and exports use (per-source, stacked, batched) agree with the fp64 formula
    under autocast as eagerly."""
    from attnres_fx.op import aggregation

    module, sources = _mixed_sources()
    want = _fp64_aggregate(module, sources)
    for form in (aggregation.fusable, aggregation.stacked, aggregation.batched):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = form(module.proj.weight, module.norm.weight, sources, eps=module.eps, preserve_scale=False)
        assert out.dtype == torch.float32 and (out.double() - want).abs().max() < 1e-6, form.__name__


def test_an_eps_that_is_zero_in_fp32_is_refused(untouched):
    """1e-300 is 0 in fp32, where the key norm adds it: a zero (padding) source would give NaN. Refused
    naming the bound; the smallest normal fp32 number itself keeps a zero source finite."""
    model = tiny()
    check = untouched(model, IDS)
    for make in (lambda: attnres_fx.AttnResConfig(eps=1e-300), lambda: attnres_fx.attnresify(model, (IDS,), eps=1e-300),
                 lambda: attnres_fx.BlockAttnRes(8, eps=1e-40)):
        with pytest.raises(ValueError, match=r"eps must be at least 1\.175e-38, the smallest normal float32"):
            make()
    check()
    smallest = torch.finfo(torch.float32).tiny
    module = attnres_fx.BlockAttnRes(8, eps=smallest)
    with torch.no_grad():
        assert torch.isfinite(module(torch.zeros(1, 2, 8), torch.randn(1, 2, 8))).all()


def test_numpy_integers_are_taken_as_ints():
    np = pytest.importorskip("numpy")
    model = attnres_fx.attnresify(tiny(), (IDS,), block_size=np.int64(2), num_blocks=np.int32(2), preserve_scale=True)
    config = attnres_fx.config_of(model)
    assert type(config.block_size) is int and type(config.num_blocks) is int
    assert json.loads(json.dumps(config.to_dict()))["block_size"] == 2
    with torch.no_grad():
        close(model(IDS), TINY_OUT)


# -- a model changed after conversion --------------------------------------------------------------------

@pytest.mark.parametrize("change, what", [
    (lambda blocks: blocks.__delitem__(1), r"1 of the 2 layers converted are gone \(pruned\)"),
    (lambda blocks: blocks.append(copy.deepcopy(blocks[0])), r"blocks\.2 was added after conversion"),
    (lambda blocks: blocks.insert(0, copy.deepcopy(TINY.blocks[0])), r"blocks\.0 was added after conversion"),
], ids=["pruned", "a converted layer copied in", "a plain layer inserted"])
def test_a_layer_pruned_or_added_after_conversion_raises_stream_mismatch(change, what):
    """Not ``AttributeError: ModuleList has no attribute `2` `` nor a silent run: StreamMismatchError
    naming the container and the way out, and ``remove`` takes the changed model."""
    model = attnres_fx.attnresify(copy.deepcopy(TINY), (IDS,), preserve_scale=True)
    change(model.blocks)
    with pytest.raises(attnres_fx.StreamMismatchError,
                       match=rf"^blocks holds other layers .*{what}.*attnres_fx\.remove"):
        with torch.no_grad():
            model(IDS)
    attnres_fx.remove(model)
    assert not attnres_fx.is_converted(model) and not any(
        isinstance(m, attnres_fx.BlockAttnRes) for m in model.modules())
    attnres_fx.attnresify(model, (IDS,), preserve_scale=True)
    with torch.no_grad():
        model(IDS)


@pytest.mark.parametrize("route", ["layer", "model"])
@pytest.mark.parametrize("layers, what", [
    (lambda b: [b[0], b[2]], r"1 of the 3 layers converted are gone \(pruned\)"),
    (lambda b: [b[1], b[0], b[2]], r"its layers were reordered"),
], ids=["a new list without a layer", "a new list reordered"])
def test_a_layer_container_replaced_after_conversion_raises_stream_mismatch(route, layers, what):
    """Formerly ``AttributeError: ModuleList has no attribute `2` `` (a raw BackendCompilerFailed on the
    model route), or a silent run of the reordered layers on the model route; a new list of the same
    layers runs as converted."""
    model = attnres_fx.attnresify(tiny(num_layers=3), (IDS,), preserve_scale=True, route=route)
    with torch.no_grad():
        want = model(IDS)
    converted = model.blocks
    model.blocks = torch.nn.ModuleList(layers(converted))
    with pytest.raises(attnres_fx.StreamMismatchError,
                       match=rf"^blocks holds other layers .*{what}.*attnres_fx\.remove"):
        with torch.no_grad():
            model(IDS)
    model.blocks = torch.nn.ModuleList(list(converted))
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), want, rtol=0, atol=0)


class Scaled(TinyTransformer):
    def forward(self, ids, scale=1.0):
        return super().forward(ids) * scale


def test_a_new_graph_past_the_recompile_limit_raises_naming_the_module_and_the_way_out(monkeypatch):
    """Formerly Dynamo's own FailOnRecompileLimitHit ("Hard failure due to fullgraph=True") at the 65th
    distinct float of a model-route call, and at every new value after it; the limit is lowered to 2 here.
    After ``torch.compiler.reset()`` (as test suites and notebooks call between models), which formerly dropped
    the capture settings with Dynamo's callbacks: the floats became graph inputs and no limit was reached."""
    from attnres_fx.routing import dynamo

    torch.compiler.reset()

    monkeypatch.setattr(dynamo, "RECOMPILE_LIMIT", 2)
    # torch 2.11 and 2.12 have only the process-wide limit, which attnres_fx raises to at least its own
    # (later releases take it per compilation; their process-wide setting is left alone).
    from attnres_fx.compat import torch as compat_torch

    # Dynamo's own config patch, not monkeypatch: monkeypatch's undo deletes the entry from torch 2.11's config
    # module, and every later compile in the process fails.
    process_limit = (contextlib.nullcontext() if compat_torch._compile_takes_recompile_limit()
                     else torch._dynamo.config.patch(recompile_limit=2))
    torch.manual_seed(0)
    model = attnres_fx.attnresify(Scaled(dim=16, num_layers=2, num_heads=2).eval(), (IDS,), route="model")
    with process_limit, torch.no_grad():
        model(IDS, 0.5)
        model(IDS, 0.75)
        with pytest.raises(attnres_fx.RoutingError, match=r"^Scaled needs a new graph for this call and has 2 already.*"
                           r"Pass such a value as a tensor"):
            model(IDS, 0.9)
        model(IDS, 0.5)


@pytest.mark.parametrize("make", [torch.jit.script, lambda m: torch.jit.trace(m, (IDS,))], ids=["scripted", "traced"])
def test_a_torchscript_model_is_refused_naming_what_to_convert(make):
    with pytest.raises(attnres_fx.UnsupportedArchitectureError, match=r"a TorchScript module .*Convert the original "
                       r"nn\.Module, then script or export the converted one"):
        attnres_fx.attnresify(make(tiny()), (IDS,))


def test_remove_and_is_converted_of_something_not_a_module():
    assert not attnres_fx.is_converted(None) and not attnres_fx.is_converted(torch.zeros(1))
    with pytest.raises(TypeError, match=r"attnres_fx\.remove takes a model converted by attnres_fx\.attnresify "
                       r"\(a torch\.nn\.Module\), got NoneType"):
        attnres_fx.remove(None)


def test_layers_wrapped_after_conversion_run_as_converted_and_wrapped_out_of_order_raise():
    """``checkpoint_wrapper`` per block (torchtitan's order) holds each converted layer as a submodule: the
    same layers, so the call runs, exactly as before (checkpointing recomputes the same ops); the same
    wrappers in another order are the layers reordered."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = attnres_fx.attnresify(copy.deepcopy(TINY), (IDS,), preserve_scale=True)
    with torch.no_grad():
        want = model(IDS)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(block)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), want, rtol=0, atol=0)
    model.blocks[0], model.blocks[1] = model.blocks[1], model.blocks[0]
    with pytest.raises(attnres_fx.StreamMismatchError, match=r"^blocks holds other layers .*its layers were reordered"):
        with torch.no_grad():
            model(IDS)


@needs_hf
def test_checkpointed_compiled_layers_refuse_a_kv_cache_in_training():
    """A compiled, non-reentrant-checkpointed Llama layer given the key/value cache that a training call
    makes by default: the recomputation would find the cache the first run filled (longer keys), a new
    graph whose saved activations the first graph's Inductor backward cannot take. Refused at the call,
    naming the layer and ``use_cache=False``, before anything is compiled; the model untouched."""
    import transformers
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=128)
    model = attnres_fx.attnresify(transformers.LlamaForCausalLM(config), num_blocks=2)
    layers = model.model.layers
    for index, block in enumerate(layers):
        layers[index] = checkpoint_wrapper(block)
    attnres_fx.compile(model)
    ids = torch.randint(0, 128, (2, 8))
    before = snapshot(model)
    with pytest.raises(attnres_fx.RoutingError, match=r"at 'model\.layers\.0'.*use_cache=False"):
        model(ids, labels=ids)
    assert_untouched(model, before)


# -- on disk: one consistent checkpoint, written whole or not at all -----------------------------------------

def _files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path, with its bytes."""
    return {str(path.relative_to(directory)): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return [path.name for path in parent.iterdir() if path.name.startswith(".attnres-tmp-")]


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A converted Llama with random pseudo-queries, saved; its logits; a second such model (other
    pseudo-queries) for saves over the first."""
    first = randomise_pseudo_queries(attnres_fx.attnresify(build_hf("llama"), num_blocks=2), seed=3, std=0.5)
    second = randomise_pseudo_queries(attnres_fx.attnresify(build_hf("llama"), num_blocks=2), seed=4, std=0.5)
    directory = tmp_path_factory.mktemp("saved") / "llama"
    first.save_pretrained(directory)
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = first(ids).logits
    return {"model": first, "other": second, "directory": directory, "ids": ids, "logits": logits}


def _same_attnres_weights(model, saved) -> bool:
    state, want = model.state_dict(), saved.state_dict()
    return all(torch.equal(state[key], value) for key, value in want.items() if "_res." in key)


def _reloaded(got, want):
    """The weights reload exactly; the logits of a model built anew may differ by fp32 round-off of its
    first calls' kernels (1e-6 of logits of size ~0.1)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _copy(directory: Path, into: Path) -> Path:
    import shutil

    return Path(shutil.copytree(directory, into))


def _auto(directory, **kwargs):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()


@pytest.mark.slow
@needs_hf
def test_a_checkpoint_saved_after_remove_loads_as_the_original(saved_llama, tmp_path):
    """``remove`` takes the config entry with the AttnRes modules: the next save is the original model's
    (formerly the entry stayed, and the model loaded converted with uninitialised pseudo-queries: NaN)."""
    loaded = _auto(saved_llama["directory"])
    attnres_fx.remove(loaded)
    assert not hasattr(loaded.config, "attnres")
    with torch.no_grad():
        want = loaded(saved_llama["ids"]).logits
    loaded.save_pretrained(tmp_path / "plain")
    assert "attnres" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    again = _auto(tmp_path / "plain")
    assert not attnres_fx.is_converted(again)
    with torch.no_grad():
        assert torch.equal(again(saved_llama["ids"]).logits, want)


@pytest.mark.slow
@needs_hf
def test_attnres_weights_missing_from_the_main_weights_are_restored_or_refused(saved_llama, tmp_path):
    """Never uninitialised memory: AttnRes weights the main weights lack come from ``attnres.safetensors``
    (with a warning); without that file they are an error naming what is lost."""
    from safetensors.torch import load_file, save_file

    directory = _copy(saved_llama["directory"], tmp_path / "copy")
    weights = load_file(str(directory / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if "_res." not in k}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.warns(attnres_fx.AttnResWarning,
                      match=r"gave no AttnRes weights for .* taken from attnres\.safetensors"):
        model = _auto(directory)
    assert _same_attnres_weights(model, saved_llama["model"])
    with torch.no_grad():
        _reloaded(model(saved_llama["ids"]).logits, saved_llama["logits"])
    (directory / "attnres.safetensors").unlink()
    (directory / "attnres_config.json").unlink()
    with pytest.raises(attnres_fx.CheckpointMismatchError,
                       match=r"no AttnRes weights for .*attnres\.safetensors is missing"):
        _auto(directory)


@pytest.mark.slow
@needs_hf
@pytest.mark.parametrize("swap", ["attnres.safetensors of another save", "attnres.safetensors in fp16",
                                  "attnres_config.json of another save"])
def test_files_of_different_saves_are_refused_on_every_load_path(saved_llama, tmp_path, swap, untouched):
    """The config entry, ``attnres_config.json`` and ``attnres.safetensors`` carry one fingerprint: a file
    of another save (logits 0.75 off before), an fp16 copy, is refused naming the file, by
    ``attnres_fx.from_pretrained`` of an instance or a class and by transformers' own loader."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import transformers

    directory = _copy(saved_llama["directory"], tmp_path / "copy")
    other = saved_llama["other"]
    other.save_pretrained(tmp_path / "other")
    if swap == "attnres.safetensors in fp16":
        with safe_open(str(directory / "attnres.safetensors"), "pt") as f:
            tensors, metadata = {k: f.get_tensor(k).half() for k in f.keys()}, f.metadata()
        save_file(tensors, str(directory / "attnres.safetensors"), metadata=metadata)
        named = r"attnres\.safetensors: its tensors do not hash to the fingerprint"
    else:
        name = swap.split()[0]
        (directory / name).write_bytes((tmp_path / "other" / name).read_bytes())
        named = (r"attnres\.safetensors: its metadata 'attnres_fingerprint'" if name == "attnres.safetensors"
                 else r"config\.json, key 'attnres': its fingerprint differ")
    instance = build_hf("llama")
    check = untouched(instance)
    for load in (lambda: attnres_fx.from_pretrained(instance, directory),
                 lambda: attnres_fx.from_pretrained(transformers.LlamaForCausalLM, directory),
                 lambda: _auto(directory)):
        with pytest.raises(attnres_fx.CheckpointMismatchError, match=named):
            load()
    check()


@pytest.mark.slow
@needs_hf
@pytest.mark.parametrize("how", ["a plain model saved over it", "the config entry deleted"])
def test_a_folder_whose_config_lost_its_entry_is_refused(saved_llama, tmp_path, how, untouched):
    """AttnRes files beside a ``config.json`` without the entry: transformers would build the original
    model (0.71 off), ``from_pretrained`` of an instance applied the old AttnRes files. Refused naming
    ``config.json`` and what to do."""
    directory = _copy(saved_llama["directory"], tmp_path / "copy")
    if how == "the config entry deleted":
        config = json.loads((directory / "config.json").read_text())
        del config["attnres"]
        (directory / "config.json").write_text(json.dumps(config))
    else:
        build_hf("llama").save_pretrained(directory)
    instance = build_hf("llama")
    check = untouched(instance)
    for load in (lambda: attnres_fx.from_pretrained(instance, directory), lambda: _auto(directory)):
        with pytest.raises(attnres_fx.CheckpointMismatchError, match=r"copy/config\.json has no 'attnres' entry, but "
                           r"attnres_config\.json lies beside it"):
            load()
    check()


@pytest.mark.slow
@needs_hf
def test_a_config_edited_to_other_layers_is_refused_by_transformers_loaders_too(tmp_path):
    """``num_hidden_layers`` edited in config.json: formerly loaded silently by AutoModel where the block
    sizes stay alike (a fixed ``block_size``), refused by attnres_fx.from_pretrained only."""
    directory = tmp_path / "copy"
    attnres_fx.attnresify(build_hf("llama"), block_size=2).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["num_hidden_layers"] += 2
    (directory / "config.json").write_text(json.dumps(config))
    import transformers

    for load in (_auto, lambda folder: attnres_fx.from_pretrained(transformers.AutoModelForCausalLM, folder)):
        with pytest.raises(attnres_fx.CheckpointMismatchError, match=r"(?s)does not convert to the sites saved in "
                           r".*copy/attnres_config\.json.*found now but not saved: model\.layers\.2, model\.layers\.3"):
            load(directory)
    # The folder's own code, run by transformers in a process that never imported attnres_fx, refuses it too.
    import subprocess
    import sys

    script = ("import sys, transformers\n"
              "transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n")
    env = {**__import__("os").environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    done = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode != 0 and "CheckpointMismatchError" in done.stderr, done.stderr[-3000:]
    assert "found now but not saved: model.layers.2, model.layers.3" in done.stderr


@pytest.mark.slow
@needs_hf
def test_a_model_built_from_the_config_of_a_removed_conversion_is_the_plain_model(saved_llama):
    """Formerly ``LlamaForCausalLM(r.config)`` after ``remove(r)`` of a loaded model raised "config.json has
    no 'attnres' entry": the folder it was loaded from was read for a model built from a config."""
    import transformers

    loaded = attnres_fx.remove(_auto(saved_llama["directory"]))
    built = transformers.LlamaForCausalLM(loaded.config)
    assert not attnres_fx.is_converted(built) and not attnres_fx.is_converted(loaded)


@pytest.mark.slow
@needs_hf
def test_transformers_alone_loads_the_converted_model_with_trust_remote_code(saved_llama, tmp_path):
    """A process that never imported attnres_fx: ``trust_remote_code=True`` runs the folder's
    ``modeling_attnres.py``, which imports attnres_fx: the converted model, the saved logits, nothing
    captured."""
    import subprocess
    import sys

    torch.save(saved_llama["ids"], tmp_path / "ids.pt")
    script = (
        "import sys, torch, transformers\n"
        "assert 'attnres_fx' not in sys.modules\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()\n"
        "import attnres_fx\n"
        "with torch.no_grad(): torch.save(m(torch.load(sys.argv[2])).logits, sys.argv[3])\n"
        "s = attnres_fx.conversion.stats\n"
        "print(s.captures, s.fingerprints, s.checkpoint_reads, attnres_fx.is_converted(m), "
        "type(m).__mro__[1].__name__)\n")
    env = {**__import__("os").environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    done = subprocess.run([sys.executable, "-c", script, str(saved_llama["directory"]), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt")], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # Nothing captured, the folder read and hashed once, as on every load path.
    assert done.stdout.split()[-5:] == ["0", "1", "1", "True", "LlamaForCausalLM"]
    _reloaded(torch.load(tmp_path / "logits.pt"), saved_llama["logits"])


class _Interrupt:
    """Counts the lines run in attnres_fx, transformers and safetensors while a call runs (``sys.settrace``)
    and raises ``KeyboardInterrupt`` at line ``at``: an interrupt at any point of a save or an export."""

    def __init__(self, at: int | None = None):
        import safetensors
        import transformers

        self.roots = tuple(str(Path(m.__file__).parent) for m in (attnres_fx, transformers, safetensors))
        self.roots += tuple(str(Path(root).resolve()) for root in self.roots)
        self.roots += (str(Path(attnres_fx.__file__).parent.parent / "export"),)
        self.at, self.count = at, 0

    def run(self, call):
        import sys

        def local(frame, event, arg):
            if event == "line":
                self.count += 1
                if self.count == self.at:
                    raise KeyboardInterrupt(f"line {self.count}")
            return local

        previous = sys.gettrace()  # a tracer running the suite (coverage's) gets its function back
        sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename.startswith(self.roots) else None)
        try:
            call()
        finally:
            sys.settrace(previous)
        return self.count


@pytest.mark.slow
@needs_hf
def test_a_save_interrupted_anywhere_leaves_the_old_checkpoint_or_the_new_one(saved_llama, tmp_path):
    """Saving over an earlier converted save, interrupted at random lines of the save (attnres_fx's,
    transformers' and safetensors' code): the folder holds the earlier save or the new one, whole, and
    nothing of the attempt beside it."""
    import random
    import shutil

    parent = tmp_path / "saves"
    before = _files(saved_llama["directory"])
    target = _copy(saved_llama["directory"], parent / "llama")
    lines = _Interrupt().run(lambda: saved_llama["other"].save_pretrained(target))
    after = _files(target)
    assert after != before and not _leftovers(parent)
    for at in sorted(random.Random(0).sample(range(1, lines + 1), 6)):
        shutil.rmtree(target)
        _copy(saved_llama["directory"], target)
        with pytest.raises(KeyboardInterrupt):
            _Interrupt(at).run(lambda: saved_llama["other"].save_pretrained(target))
        assert _files(target) in (before, after), f"interrupted at line {at} of {lines}"
        assert not _leftovers(parent), at


@pytest.mark.slow
@needs_hf
def test_a_failed_save_over_a_converted_one_leaves_it_as_it_was(saved_llama, tmp_path, monkeypatch):
    """A save failing after the main weights are written (the AttnRes files not yet), formerly left them
    beside the old AttnRes files, which ``from_pretrained`` preferred (1.35 off): now the folder is as
    before, and loads as the earlier save."""
    from attnres_fx.integrations import checkpoint

    target = _copy(saved_llama["directory"], tmp_path / "llama")
    before = _files(target)

    def fail(*args):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(checkpoint, "write", fail)
    with pytest.raises(attnres_fx.WriteError, match=r"writing .*llama failed while writing attnres_config\.json, "
                       r"attnres\.safetensors .*Input/output error.*is as it was before"):
        saved_llama["other"].save_pretrained(target)
    assert _files(target) == before and not _leftovers(tmp_path)
    monkeypatch.undo()
    with torch.no_grad():
        _reloaded(attnres_fx.from_pretrained(build_hf("llama"), target)(saved_llama["ids"]).logits,
                  saved_llama["logits"])


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted for the test (root only; skipped with the reason elsewhere), and a function
    that fills it up to ``left`` free bytes."""
    import os
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill: {done.stderr.strip() or done.returncode}")

    def fill(left: int) -> None:
        stat = os.statvfs(mount)
        free = stat.f_bavail * stat.f_frsize
        with open(mount / "filler", "wb") as filler:
            filler.write(b"\0" * max(0, free - left))
    try:
        yield mount, fill
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
@needs_hf
def test_a_save_onto_a_full_disk_says_so_and_leaves_the_folder(saved_llama, small_disk):
    mount, fill = small_disk
    target = _copy(saved_llama["directory"], mount / "llama")
    before = _files(target)
    fill(left=16 * 1024)
    with pytest.raises(attnres_fx.WriteError, match=r"llama failed while .*: the disk is full .*is as it was before"):
        saved_llama["other"].save_pretrained(target)
    assert _files(target) == before and not _leftovers(mount)


@pytest.mark.slow
def test_an_onnx_export_that_fails_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """Formerly written straight to its path: a failing checker or verification left a truncated or
    unchecked file (or deleted the earlier one)."""
    import os

    import onnx

    from attnres_fx import export

    path = tmp_path / "tiny.onnx"
    path.write_bytes(b"an earlier export")
    model = attnres_fx.attnresify(tiny(), (IDS,), preserve_scale=True)

    def refuse(*args, **kwargs):
        raise onnx.checker.ValidationError("refused")
    monkeypatch.setattr(onnx.checker, "check_model", refuse)
    with pytest.raises(attnres_fx.ExportError, match=r"onnx\.checker of .*tiny\.onnx failed"):
        export.to_onnx(model, (IDS,), path)
    assert path.read_bytes() == b"an earlier export" and sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx"]
    monkeypatch.undo()
    # An interrupt right after each step that writes: the file saved beside the target, the old file
    # moved aside, the new one moved in (the rename that commits it, undone). The export itself is
    # replaced by a write of its bytes (the steps around it are what is tried).
    from attnres_fx.export import onnx as onnx_export

    def exported(module, args, kwargs, dynamic_shapes, names_in, names_out, staged, **options):
        staged.write_bytes(b"a new export")
        return staged
    monkeypatch.setattr(onnx_export, "write_onnx", exported)
    for owner, name, call in [(onnx_export, "write_onnx", 1), (os, "replace", 1), (os, "replace", 2)]:
        calls = []
        real = getattr(owner, name)

        def interrupted(*args, real=real, calls=calls, call=call, name=name, **kwargs):
            result = real(*args, **kwargs)
            calls.append(1)
            if len(calls) == call:
                raise KeyboardInterrupt(name)
            return result
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, interrupted)
            with pytest.raises(KeyboardInterrupt):
                export.to_onnx(model, (IDS,), path, check=False)
        assert path.read_bytes() == b"an earlier export", f"interrupted after {name} {call}"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx"], (name, call)
    export.to_onnx(model, (IDS,), path, check=False)
    assert path.read_bytes() == b"a new export" and sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx"]


@pytest.mark.slow
def test_an_onnx_export_onto_a_full_disk_says_so(small_disk):
    from attnres_fx import export

    mount, fill = small_disk
    path = mount / "tiny.onnx"
    path.write_bytes(b"an earlier export")
    model = attnres_fx.attnresify(tiny(dim=64), (IDS,), preserve_scale=True)
    fill(left=8 * 1024)
    with pytest.raises(attnres_fx.ExportError, match=r"(?s)saving .*tiny\.onnx failed.*the disk is full"):
        export.to_onnx(model, (IDS,), path)
    assert path.read_bytes() == b"an earlier export" and not _leftovers(mount)


@pytest.mark.slow
@needs_hf
def test_to_genai_over_an_earlier_folder_failing_part_way_leaves_it_whole(tmp_path, monkeypatch):
    """Formerly the staged files moved in one at a time: a failure after the first left a folder of two
    exports. Now the folder is swapped whole: a failure in the move leaves the earlier one."""
    import os
    import shutil

    from attnres_fx import export
    from attnres_fx.testing.serving import serving_model

    out = tmp_path / "served"
    out.mkdir()
    for name in ("model.onnx", "model.onnx.data", "genai_config.json", "notes.txt"):
        (out / name).write_text(f"earlier {name}")
    before = _files(out)
    moves = []
    real_replace, real_move = os.replace, shutil.move

    def second_fails(real):
        def move(source, destination, *args):
            # The renames of the folder swap: the old folder aside, the new one in (the export's own moves
            # inside the temporary folder do not count).
            if out in (Path(source), Path(destination)):
                moves.append(destination)
            if len(moves) == 2 and Path(destination) == out:
                raise OSError(28, "No space left on device")
            return real(source, destination, *args)
        return move
    monkeypatch.setattr(os, "replace", second_fails(real_replace))
    monkeypatch.setattr(shutil, "move", second_fails(real_move))
    model = attnres_fx.attnresify(serving_model("llama"), num_blocks=2)
    with pytest.raises(attnres_fx.WriteError, match=r"served failed while moving the new folder in: the disk is full"):
        export.to_genai(model, out)
    assert _files(out) == before and not _leftovers(tmp_path)


# -- on disk, at the edges: folders in the way, links, killed writers, targets that cannot be renamed -------

def _tree(directory: Path) -> dict[str, bytes]:
    folders = {str(p.relative_to(directory)) + "/": b"" for p in directory.rglob("*") if p.is_dir()}
    return {**_files(directory), **folders}


@pytest.mark.parametrize("where", ["model.onnx", "model.onnx.data", "a link at model.onnx"])
def test_an_onnx_export_onto_a_folder_is_refused_and_the_folder_kept(tmp_path, where):
    """Formerly the folder at the path (or at its ``.data``) was renamed aside and deleted with its files."""
    from attnres_fx import export

    folder = tmp_path / ("elsewhere" if where.startswith("a link") else where)
    (folder / "inner").mkdir(parents=True)
    (folder / "inner" / "weights.bin").write_bytes(b"kept")
    if where.startswith("a link"):
        (tmp_path / "model.onnx").symlink_to(folder)
    before = _tree(tmp_path)
    with pytest.raises(attnres_fx.WriteError, match=r"is a folder: nothing was written .*move the folder away"):
        export.to_onnx(torch.nn.Linear(4, 4), (torch.randn(2, 4),), tmp_path / "model.onnx", check=False)
    assert _tree(tmp_path) == before and not _leftovers(tmp_path)


def test_a_linked_folder_and_a_linked_file_are_written_through_the_link(tmp_path):
    """Formerly the link was replaced by a real folder (file), the folder it pointed to left with the old."""
    from attnres_fx import atomic
    from attnres_fx.export.onnx import onnx_files

    real = tmp_path / "real" / "model"
    real.mkdir(parents=True)
    (real / "weights.bin").write_bytes(b"old")
    (real / "tokenizer.json").write_bytes(b"kept")
    link = tmp_path / "link"
    link.symlink_to(real)
    with atomic.replaced_folder(link, drop=lambda name: name == "weights.bin") as staging:
        (staging / "weights.bin").write_bytes(b"new")
    assert link.is_symlink() and link.resolve() == real
    assert _files(real) == {"weights.bin": b"new", "tokenizer.json": b"kept"} and not _leftovers(real.parent)
    (real / "model.onnx").write_bytes(b"old graph")
    (real / "model.onnx.data").write_bytes(b"old data")
    (tmp_path / "graph.onnx").symlink_to(real / "model.onnx")
    with atomic.replaced_files(tmp_path / "graph.onnx", onnx_files) as staged:
        # Written under the name of the file the link points to: the graph refers to its data by that name.
        assert staged.name == "model.onnx"
        staged.write_bytes(b"new graph")
        Path(f"{staged}.data").write_bytes(b"new data")
    assert (tmp_path / "graph.onnx").is_symlink() and (tmp_path / "graph.onnx").read_bytes() == b"new graph"
    assert (real / "model.onnx.data").read_bytes() == b"new data" and not _leftovers(real)


def _killed_at_rename(number: int, write) -> None:
    """Run ``write`` in a forked child that dies (``os._exit``, as at a SIGKILL: no cleanup runs) at its
    ``number``-th ``os.replace``, before that rename."""
    import os

    child = os.fork()
    if child == 0:
        calls = []

        def replace(*args, **kwargs):
            calls.append(1)
            if len(calls) == number:
                os._exit(9)
            return real(*args, **kwargs)
        real, os.replace = os.replace, replace
        try:
            write()
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 9, "the write did not reach that rename"


def _write_folder(target, files):
    from attnres_fx import atomic

    def write():
        with atomic.replaced_folder(target, drop=lambda name: name.startswith("weights")) as staging:
            for name, data in files.items():
                (staging / name).write_bytes(data)
    return write


def test_a_folder_swap_killed_between_its_renames_is_finished_by_the_next_write_or_load(tmp_path):
    """Formerly a kill between renaming the old folder aside and the new one in left nothing at the path,
    the old checkpoint only in a hidden sibling that nothing recovered or removed."""
    from attnres_fx import atomic

    target = tmp_path / "model"
    target.mkdir()
    (target / "weights.bin").write_bytes(b"old")
    (target / "tokenizer.json").write_bytes(b"kept")
    _killed_at_rename(2, _write_folder(target, {"weights.bin": b"new", "weights-extra.bin": b"new too"}))
    assert not target.exists() and _leftovers(tmp_path)
    atomic.recover(target)
    assert _files(target) == {"weights.bin": b"new", "weights-extra.bin": b"new too", "tokenizer.json": b"kept"}
    assert not _leftovers(tmp_path)
    # Killed while writing (before any rename): the old folder stays, the next write removes the attempt.
    _killed_at_rename(1, _write_folder(target, {"weights.bin": b"newer"}))
    assert _files(target)["weights.bin"] == b"new" and _leftovers(tmp_path)
    _write_folder(target, {"weights.bin": b"newest"})()
    assert _files(target) == {"weights.bin": b"newest", "tokenizer.json": b"kept"} and not _leftovers(tmp_path)


def test_a_killed_swap_moved_with_its_folder_is_finished_where_it_is_now(tmp_path):
    """Formerly the note held absolute paths: recovering a copy (or a moved folder) of a killed swap
    moved its new files into the original place, and the copy stayed empty."""
    import shutil

    from attnres_fx import atomic

    first = tmp_path / "first"
    (first / "model").mkdir(parents=True)
    (first / "model" / "weights.bin").write_bytes(b"old")
    _killed_at_rename(2, _write_folder(first / "model", {"weights.bin": b"new"}))
    second = Path(shutil.copytree(first, tmp_path / "second", symlinks=True))
    atomic.recover(second / "model")
    assert _files(second) == {"model/weights.bin": b"new"} and not _leftovers(second)
    assert not (first / "model").exists() and _leftovers(first)


def test_a_file_swap_killed_between_its_renames_is_finished_by_the_next_export(tmp_path):
    from attnres_fx import atomic
    from attnres_fx.export.onnx import onnx_files

    target = tmp_path / "model.onnx"
    target.write_bytes(b"old graph")
    Path(f"{target}.data").write_bytes(b"old data")

    def write(graph, data=None):
        def run():
            with atomic.replaced_files(target, onnx_files) as staged:
                staged.write_bytes(graph)
                if data is not None:
                    Path(f"{staged}.data").write_bytes(data)
        return run
    # The old graph and data renamed aside, the new graph moved in, killed before the new data.
    _killed_at_rename(4, write(b"new graph", b"new data"))
    assert target.read_bytes() == b"new graph" and not Path(f"{target}.data").exists()
    atomic.recover(target)
    assert _files(tmp_path) == {"model.onnx": b"new graph", "model.onnx.data": b"new data"}
    # A new graph without data, killed after the old ones were renamed aside: no old data beside it after.
    _killed_at_rename(3, write(b"newer graph"))
    assert not target.exists()
    write(b"newest graph")()
    assert _files(tmp_path) == {"model.onnx": b"newest graph"}


def test_the_temporary_folder_of_a_write_at_work_is_left_alone(tmp_path):
    from attnres_fx import atomic

    target = tmp_path / "model"
    with atomic.replaced_folder(target) as staging:
        (staging / "weights.bin").write_bytes(b"new")
        atomic.recover(target)
        assert (staging / "weights.bin").exists()
    assert _files(target) == {"weights.bin": b"new"} and not _leftovers(tmp_path)


@pytest.mark.parametrize("why", ["a mount point (EBUSY)", "a read-only parent"])
def test_a_folder_that_cannot_be_swapped_whole_is_written_in_place_with_a_warning(tmp_path, monkeypatch, why):
    """Formerly refused with a WriteError where transformers' own save writes the files."""
    import errno
    import os
    import tempfile

    target = tmp_path / "model"
    target.mkdir()
    for name, data in {"weights.bin": b"old", "weights-2.bin": b"old shard", "tokenizer.json": b"kept"}.items():
        (target / name).write_bytes(data)
    if why.startswith("a mount"):
        real = os.replace

        def replace(source, destination):
            if Path(source) == target or Path(destination) == target:
                raise OSError(errno.EBUSY, "Device or resource busy")
            return real(source, destination)
        monkeypatch.setattr(os, "replace", replace)
    else:
        real = tempfile.mkdtemp

        def mkdtemp(*args, dir=None, **kwargs):
            if Path(dir) == tmp_path:
                raise PermissionError(errno.EACCES, "Permission denied", str(dir))
            return real(*args, dir=dir, **kwargs)
        monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    with pytest.warns(attnres_fx.AttnResWarning, match=r"model cannot be replaced whole .*written in place"):
        _write_folder(target, {"weights.bin": b"new", "config.json": b"new config"})()
    assert _files(target) == {"weights.bin": b"new", "config.json": b"new config", "tokenizer.json": b"kept"}
    assert not _leftovers(tmp_path) and not _leftovers(target)


@pytest.mark.slow
@needs_hf
def test_save_pretrained_writes_through_a_link_and_a_killed_save_is_finished_by_the_next_load(saved_llama, tmp_path):
    import transformers

    real = _copy(saved_llama["directory"], tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    saved_llama["other"].save_pretrained(link)
    assert link.is_symlink() and _same_attnres_weights(attnres_fx.from_pretrained(build_hf("llama"), real),
                                                     saved_llama["other"])
    target = _copy(saved_llama["directory"], tmp_path / "killed")
    _killed_at_rename(2, lambda: saved_llama["other"].save_pretrained(target))
    assert not target.exists()
    loaded = attnres_fx.from_pretrained(transformers.LlamaForCausalLM, target)
    assert _same_attnres_weights(loaded, saved_llama["other"]) and not _leftovers(tmp_path)
    # transformers' own loaders too, in a process that has not imported a model class yet: AutoModel reads
    # config.json before it imports any (formerly: "couldn't connect to huggingface.co", the folder gone).
    _killed_at_rename(2, lambda: saved_llama["model"].save_pretrained(target))
    assert not target.exists()
    code = ("import sys, attnres_fx, transformers\n"
            "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "assert attnres_fx.is_converted(model)\n")
    subprocess.run([sys.executable, "-c", code, str(target)], check=True, timeout=100)
    assert _same_attnres_weights(_auto(target), saved_llama["model"]) and not _leftovers(tmp_path)


@pytest.mark.slow
def test_a_save_onto_a_real_mount_point_is_written_in_place(small_disk):
    """The folder is a tmpfs mounted for the test: renaming it fails with EBUSY, its files are written in."""
    mount, _ = small_disk
    (mount / "weights.bin").write_bytes(b"old")
    (mount / "tokenizer.json").write_bytes(b"kept")
    with pytest.warns(attnres_fx.AttnResWarning, match=r"cannot be replaced whole .*Device or resource busy"):
        _write_folder(mount, {"weights.bin": b"new", "config.json": b"new config"})()
    assert _files(mount) == {"weights.bin": b"new", "config.json": b"new config", "tokenizer.json": b"kept"}
    assert not _leftovers(mount) and not _leftovers(mount.parent)
