"""Adversarial use, as a user would try it: any options and inputs, a first call interrupted or raising
outside the blocks, wrappers and libraries layered before and after conversion (``torch.compile``, PEFT,
torchao, ``torch.inference_mode``), transformers' output recorders, pickling, an input layout Inductor
asserts. Every case either behaves as the original model does, or is refused before anything changes
by an error naming the cause and the way out; the model is then untouched: state, outputs, hooks,
instance attributes, config and ``torch.save`` (``conftest.assert_untouched``).

Models are converted with ``preserve_scale=True`` (zero pseudo-queries): the original function, up to
fp32 round-off of the reassociated sums.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnres_fx
from attnres_fx.checks import relative_error
from attnres_fx.models import TinyTransformer, example_ids
from attnres_fx.testing import randomise_pseudo_queries
from conftest import assert_untouched, saves, snapshot
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
