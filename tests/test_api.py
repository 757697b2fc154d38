"""Public API contract: arguments, errors, and the user's model left bit-identical by every failure."""

import re
import subprocess
import sys

import pytest
import torch

import attnres_fx
from attnres_fx import compat
from attnres_fx.models import TinyTransformer, example_ids
from toy_models import DataDependentModel, NoResidualModel, PostNormModel, make_inputs


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyTransformer(num_layers=2, dim=32).eval()


def test_converts_in_place_and_returns_the_same_object(model):
    out = attnres_fx.attnresify(model, (example_ids(model.config),), block_size=2)
    assert out is model and type(out) is TinyTransformer
    assert attnres_fx.is_converted(model)
    assert any(isinstance(m, attnres_fx.BlockAttnRes) for m in model.modules())


@pytest.mark.parametrize("kwargs,error,match", [
    ({"block_size": 0}, ValueError, "block_size"), ({"block_size": -2}, ValueError, "block_size"),
    ({"block_size": 1.5}, ValueError, "block_size"), ({"num_blocks": 0}, ValueError, "num_blocks"),
    ({"eps": 0.0}, ValueError, "eps"), ({"eps": -1e-6}, ValueError, "eps"), ({"eps": float("nan")}, ValueError, "eps"),
    ({"eps": float("inf")}, ValueError, "eps"), ({"eps": "1e-6"}, ValueError, "eps"),
    ({"preserve_scale": 1}, TypeError, "preserve_scale"), ({"preserve_scale": "yes"}, TypeError, "preserve_scale"),
    ({"allow_partial": None}, TypeError, "allow_partial"),
    ({"example_kwargs": [("ids", 1)]}, TypeError, "example_kwargs"),
    ({"example_inputs": "ids"}, TypeError, "example_inputs"), ({"example_inputs": 3}, TypeError, "example_inputs"),
])
def test_bad_arguments_raise_naming_them(model, untouched, kwargs, error, match):
    check = untouched(model)
    with pytest.raises(error, match=match):
        attnres_fx.attnresify(model, **kwargs)
    check()


def test_a_typed_config_is_the_same_call_as_its_keyword_options(model, untouched):
    config = attnres_fx.AttnResConfig(block_size=2, preserve_scale=True, allow_partial=True)
    ids = example_ids(model.config)
    twin = TinyTransformer(num_layers=2, dim=32).eval()
    twin.load_state_dict(model.state_dict())
    attnres_fx.attnresify(model, (ids,), config=config)
    attnres_fx.attnresify(twin, (ids,), block_size=2, preserve_scale=True, allow_partial=True)
    assert attnres_fx.config_of(model) == attnres_fx.config_of(twin) == config
    assert attnres_fx.conversion_options(model) == {"num_blocks": None, "block_size": 2, "preserve_scale": True,
                                                     "eps": 1e-6, "allow_partial": True, "route": "auto",
                                                     "trace_cache_size": 256}
    assert attnres_fx.plan_of(model).block_sizes == attnres_fx.plan_of(twin).block_sizes
    # Keyword options beside a config replace its fields.
    other = TinyTransformer(num_layers=2, dim=32).eval()
    attnres_fx.attnresify(other, (ids,), config=config, block_size=1)
    assert attnres_fx.config_of(other).block_size == 1 and attnres_fx.config_of(other).allow_partial
    assert attnres_fx.AttnResConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("make, error, match", [
    (lambda: attnres_fx.AttnResConfig(block_size=0), ValueError, "block_size"),
    (lambda: attnres_fx.AttnResConfig(route="stage"), ValueError, "route"),
    (lambda: attnres_fx.AttnResConfig(version=99), ValueError, "version"),
    (lambda: attnres_fx.AttnResConfig.from_dict({"block_sise": 2}), ValueError, "block_sise"),
])
def test_a_config_is_validated_when_it_is_made(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_config_is_frozen_and_unknown_options_are_refused(model, untouched):
    config = attnres_fx.AttnResConfig()
    with pytest.raises(AttributeError):
        config.block_size = 2
    check = untouched(model)
    with pytest.raises(TypeError, match="'blocksize'.*block_size"):
        attnres_fx.attnresify(model, blocksize=2)
    with pytest.raises(TypeError, match="AttnResConfig"):
        attnres_fx.attnresify(model, config={"block_size": 2})
    check()


def test_block_size_and_num_blocks_that_disagree_are_refused(model, untouched):
    check = untouched(model)
    with pytest.raises(ValueError, match=r"block_size=1 and num_blocks=1 disagree: stream 0 has 4 residual"):
        attnres_fx.attnresify(model, num_blocks=1, block_size=1)
    check()


def test_converting_twice_is_refused(model):
    attnres_fx.attnresify(model)
    with pytest.raises(attnres_fx.AttnResError, match="already converted"):
        attnres_fx.attnresify(model)


def test_untraceable_model_raises_trace_error_with_the_cause(untouched):
    model = DataDependentModel()
    check = untouched(model, torch.randn(2, 3, 32))
    with pytest.raises(attnres_fx.TraceError, match="pass example_inputs") as without_inputs:
        attnres_fx.attnresify(model)
    assert set(without_inputs.value.causes) == {"fx"}
    assert "tracer=" not in str(without_inputs.value), "attnresify takes no tracer: no hint may suggest one"
    with pytest.raises(attnres_fx.TraceError, match="TorchDynamo could not capture") as with_inputs:
        attnres_fx.attnresify(model, (torch.randn(2, 3, 32),))
    assert set(with_inputs.value.causes) == {"dynamo"} and "graph break" in str(with_inputs.value)
    check()


@pytest.mark.parametrize("inputs,cause", [
    pytest.param(torch.randn(2, 16),
                 r"Expected tensor for argument #1 'indices' to have one of the following scalar types",
                 marks=pytest.mark.skipif(compat.release(torch.__version__) < (2, 13), reason=(
                     "torch 2.11 and 2.12's fake embedding does not check the index dtype: a conversion on fake "
                     "tensors cannot see this error there (the model's first real call raises it)"))),
    (torch.randint(0, 128, (2, 16, 3)), r"RuntimeError: .*shape"),
])
def test_a_model_that_fails_on_the_example_inputs_raises_the_root_cause(model, untouched, inputs, cause):
    """Float ids for an embedding (the dtype), or ids of one dimension too many (a shape): the message
    names the model, says it failed on the inputs and carries the innermost error, with the line."""
    check = untouched(model)
    failed = r"TinyTransformer fails on the example inputs at \w+\.py:\d+"
    with pytest.raises(attnres_fx.TraceError, match=failed) as err:
        attnres_fx.attnresify(model, (inputs,))
    assert len(str(err.value).splitlines()) == 2
    assert re.search(cause, str(err.value)), str(err.value)
    check()


def test_no_residual_stream_error_lists_the_adds(untouched):
    model = NoResidualModel()
    check = untouched(model, make_inputs())
    with pytest.raises(attnres_fx.NoResidualStreamError) as err:
        attnres_fx.attnresify(model, (make_inputs(),))
    message = str(err.value)
    assert "operands are independent" in message and "no parameterised compute" in message
    assert len(err.value.rejected) == 4
    check()


def test_post_norm_raises_unsupported_architecture(untouched):
    model = PostNormModel()
    check = untouched(model, make_inputs())
    with pytest.raises(attnres_fx.UnsupportedArchitectureError, match="post-norm") as err:
        attnres_fx.attnresify(model, (make_inputs(),))
    assert "pre-norm" in str(err.value)
    check()


def test_errors_share_a_base_class():
    for error in (attnres_fx.TraceError, attnres_fx.NoResidualStreamError, attnres_fx.StreamMismatchError,
                  attnres_fx.UnsupportedArchitectureError, attnres_fx.ExportError):
        assert issubclass(error, attnres_fx.AttnResError)


def test_sites_of_an_unconverted_model_is_empty_and_the_rest_refuses_it(model):
    assert attnres_fx.sites(model) == [] and not attnres_fx.is_converted(model)
    for call in (attnres_fx.remove, attnres_fx.compile, attnres_fx.plan_of):
        with pytest.raises(ValueError, match="needs a model converted by attnres_fx.attnresify"):
            call(model)
    with pytest.raises(ValueError, match="needs a model converted"):
        attnres_fx.rewrite(model, (example_ids(model.config),))


def test_a_single_tensor_or_a_list_is_accepted_as_example_inputs(model):
    x = example_ids(model.config)
    for inputs in (x, [x]):
        converted = attnres_fx.attnresify(TinyTransformer(num_layers=2, dim=32).eval(), inputs)
        assert converted(x).shape == (2, 16, 128)


@pytest.mark.slow
def test_import_does_not_pull_optional_or_test_only_modules():
    code = ("import sys, attnres_fx, attnres_fx.passes, attnres_fx.cli, attnres_fx.export; "
            "loaded = {'transformers', 'onnx', 'onnxruntime', 'onnxscript', 'matplotlib', 'attnres_fx.testing'}"
            " & set(sys.modules); assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)
