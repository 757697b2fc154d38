"""Public API contract: arguments, errors, and the user's model left untouched by every call."""

import subprocess
import sys

import pytest
import torch

import attnres_fx
from attnres_fx.cli import main as cli_main
from attnres_fx.models import TinyTransformer, example_ids
from toy_models import DataDependentModel, NoResidualModel, PostNormModel, make_inputs


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyTransformer(num_layers=2, dim=32).eval()


def test_returns_a_new_module_and_leaves_the_original_untouched(model, untouched):
    check = untouched(model)
    code_before = type(model).forward
    new = attnres_fx.attnresify(model, (example_ids(model.config),), block_size=2)
    assert new is not model and isinstance(new, torch.fx.GraphModule)
    assert type(model).forward is code_before
    assert not any(isinstance(m, attnres_fx.BlockAttnRes) for m in model.modules())
    check()


def test_parameters_are_shared_not_copied(model):
    new = attnres_fx.attnresify(model)
    assert new.get_parameter("blocks.0.attn.qkv.weight") is model.blocks[0].attn.qkv.weight


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 0}, "block_size"), ({"block_size": -2}, "block_size"), ({"block_size": 1.5}, "block_size"),
    ({"num_blocks": 0}, "num_blocks"), ({"tracer": "jit"}, "tracer"),
])
def test_bad_arguments_raise_value_error_naming_them(model, untouched, kwargs, match):
    check = untouched(model)
    with pytest.raises(ValueError, match=match):
        attnres_fx.attnresify(model, **kwargs)
    check()


def test_block_size_wins_over_the_default_num_blocks_and_must_agree_with_an_explicit_one(model, untouched):
    assert attnres_fx.attnresify(model, block_size=1).meta["attnres"]["block_sizes"] == [1]
    assert attnres_fx.attnresify(model, num_blocks=2, block_size=2).meta["attnres"]["block_sizes"] == [2]
    check = untouched(model)
    with pytest.raises(ValueError, match=r"block_size=1 and num_blocks=1 disagree: stream 0 has 4 residual"):
        attnres_fx.attnresify(model, num_blocks=1, block_size=1)
    check()


def test_already_rewritten_module_is_refused(model):
    new = attnres_fx.attnresify(model)
    with pytest.raises(ValueError, match="already contains BlockAttnRes"):
        attnres_fx.attnresify(new)


def test_untraceable_model_raises_trace_error_with_both_causes(untouched):
    model = DataDependentModel()
    check = untouched(model)
    with pytest.raises(attnres_fx.TraceError, match="fx") as fx_only:
        attnres_fx.attnresify(model, tracer="fx")
    assert set(fx_only.value.causes) == {"fx"} and "Try" in str(fx_only.value)
    with pytest.raises(attnres_fx.TraceError, match="neither tracer") as both:
        attnres_fx.attnresify(model, (torch.randn(2, 3, 32),))
    assert set(both.value.causes) == {"fx", "export"}
    with pytest.raises(attnres_fx.TraceError, match="needs example inputs"):
        attnres_fx.attnresify(model)
    check()


def test_no_residual_stream_error_lists_the_adds(untouched):
    model = NoResidualModel()
    check = untouched(model)
    with pytest.raises(attnres_fx.NoResidualStreamError) as err:
        attnres_fx.attnresify(model, (make_inputs(),))
    message = str(err.value)
    assert "operands are independent" in message and "no parameterised compute" in message
    assert len(err.value.rejected) == 4
    check()


def test_post_norm_raises_unsupported_architecture(untouched):
    model = PostNormModel()
    check = untouched(model)
    with pytest.raises(attnres_fx.UnsupportedArchitectureError, match="post-norm") as err:
        attnres_fx.attnresify(model, (make_inputs(),))
    assert "pre-norm" in str(err.value)
    check()


def test_errors_share_a_base_class():
    for error in (attnres_fx.TraceError, attnres_fx.NoResidualStreamError,
                  attnres_fx.UnsupportedArchitectureError, attnres_fx.ExportError):
        assert issubclass(error, attnres_fx.AttnResError)


def test_sites_of_an_unrewritten_model_is_empty(model):
    assert attnres_fx.sites(model) == []


def test_single_tensor_example_input_is_accepted(model):
    x = example_ids(model.config)
    new = attnres_fx.attnresify(model, x)
    torch.testing.assert_close(new(x).shape, model(x).shape)


def test_import_does_not_pull_optional_dependencies():
    code = ("import sys, attnres_fx, attnres_fx.passes; "
            "assert 'transformers' not in sys.modules and 'onnxruntime' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_demo_prints_table_difference_and_saves_code(tmp_path, capsys):
    assert cli_main(["demo", "--layers", "2", "--dim", "32", "--out", str(tmp_path), "--no-backends"]) == 0
    out = capsys.readouterr().out
    assert "blocks.1  mlp   yes" in out
    injected = out[out.index("Injected BlockAttnRes"):].splitlines()
    assert injected[1].split() == ["site", "name", "layer", "kind", "block", "sources", "normalised"]
    assert injected[3].split() == ["0", "blocks.0.attn_res", "blocks.0", "attn", "1", "1", "yes"]
    assert "max |original - rewritten|" in out
    code = (tmp_path / "rewritten_graph.py").read_text()
    assert "blocks_0_attn_res" in code and "final_res" in code
