"""Depth-attention maps: the weights against a computation from the parameters, their layout, the table,
the heatmap, and a model left as it was (eager, Inductor-routed, and as a rewrite graph)."""

import copy
import math
import struct
import sys

import numpy as np
import pytest
import torch

import attnres_fx
from attnres_fx import routing
from attnres_fx.conversion import conversion_of
from attnres_fx.models import TinyTransformer, example_ids
from attnres_fx.testing import randomise_pseudo_queries
from conftest import cold_compile, hooks_of
from toy_models import EncoderDecoder, make_inputs

BLOCK_SIZE = 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    original = TinyTransformer(num_layers=4, dim=32).eval()
    return randomise_pseudo_queries(attnres_fx.attnresify(original, (example_ids(original.config),),
                                                          block_size=BLOCK_SIZE))


@pytest.fixture(scope="module")
def ids(model):
    return example_ids(model.config, batch=3, seq=10, seed=5)


def manual_weights(model, ids):
    """Per-token weights of every site in float64, from the sources each module receives (captured by
    this test's own hooks) and the parameters: softmax_i((w * g) . v_i / rms(v_i))."""
    sources = {}
    handles = [model.get_submodule(site.name).register_forward_pre_hook(
        lambda module, args, name=site.name: sources.__setitem__(name, [a.detach().double() for a in args]))
        for site in attnres_fx.sites(model)]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    weights = {}
    for site in attnres_fx.sites(model):
        module = model.get_submodule(site.name)
        query = (module.proj.weight[0] * module.norm.weight).detach().double()
        logits = torch.stack([(v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + module.eps)) @ query
                              for v in sources[site.name]], dim=-1)
        weights[site.name] = logits.softmax(-1)
    return weights


def png_size(path):
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_weights_match_a_manual_computation_from_the_parameters(model, ids):
    weights = attnres_fx.depth_weights(model, ids, per_token=True)
    expected = manual_weights(model, ids)
    assert [row.site.name for row in weights] == [site.name for site in attnres_fx.sites(model)]
    for row in weights:
        want = expected[row.site.name]
        assert row.tokens == 30
        np.testing.assert_allclose(row.weights, want.reshape(-1, want.shape[-1]).mean(0).numpy(), rtol=0, atol=1e-6)
        assert row.per_token.shape == (3, 10, row.site.num_sources)
        np.testing.assert_allclose(row.per_token.double().numpy(), want.numpy(), rtol=0, atol=1e-6)
        entropy = -(want * want.log()).sum(-1).mean()
        assert row.entropy == pytest.approx(float(entropy), abs=1e-6)
        assert row.max_weight == pytest.approx(float(want.max(-1).values.mean()), abs=1e-6)
    # The pseudo-queries are random: the weights are far from uniform, so the check above has teeth.
    assert max(abs(row.weights - 1 / len(row.weights)).max() for row in weights) > 0.2


def test_rows_sum_to_one_in_a_lower_triangular_layout(model, ids):
    weights = attnres_fx.depth_weights(model, ids)
    matrix = weights.to_numpy()
    found = attnres_fx.sites(model)
    assert matrix.shape == (len(found), max(site.num_sources for site in found))
    for i, site in enumerate(found):
        assert np.isfinite(matrix[i, :site.num_sources]).all() and np.isnan(matrix[i, site.num_sources:]).all()
        # Source j is block j: a site never reads a block after its own.
        assert site.block is None or site.num_sources <= site.block + 1
    np.testing.assert_allclose(np.nansum(matrix, axis=1), 1.0, atol=1e-6)
    assert weights["final_res"].site.kind == "final"


def test_zero_pseudo_queries_give_uniform_weights_and_maximal_entropy():
    torch.manual_seed(0)
    model = TinyTransformer(num_layers=2, dim=32).eval()
    attnres_fx.attnresify(model, (example_ids(model.config),), block_size=1)
    for row in attnres_fx.depth_weights(model, example_ids(model.config)):
        n = row.site.num_sources
        np.testing.assert_allclose(row.weights, np.full(n, 1 / n), atol=1e-7)
        assert row.entropy == pytest.approx(math.log(n), abs=1e-6)


def test_the_model_is_left_as_it_was(model, ids, untouched):
    check = untouched(model)
    expected = model(ids)
    hooks = hooks_of(model)
    model.train()
    with torch.enable_grad():
        attnres_fx.depth_weights(model, ids)
    assert model.training and torch.is_grad_enabled()
    model.eval()
    assert torch.equal(model(ids), expected)
    assert hooks_of(model) == hooks, "hooks removed"
    check()


def test_several_recorded_calls_average_over_all_their_tokens(model, ids):
    other = example_ids(model.config, batch=1, seq=6, seed=9)
    with attnres_fx.DepthRecorder(model) as recorder, torch.no_grad():
        model(ids)
        model(other)
    combined = recorder.result()
    first, second = attnres_fx.depth_weights(model, ids), attnres_fx.depth_weights(model, other)
    for row in combined:
        assert row.tokens == 36
        expected = (30 * first[row.site.name].weights + 6 * second[row.site.name].weights) / 36
        np.testing.assert_allclose(row.weights, expected, atol=1e-7)


def test_a_recording_where_the_sites_did_not_run_is_refused(model):
    with attnres_fx.DepthRecorder(model) as recorder:
        pass
    with pytest.raises(attnres_fx.DepthWeightsError, match="did not run"):
        recorder.result()


def test_a_rewrite_graph_gives_the_live_models_weights(model, ids):
    graph = attnres_fx.rewrite(model, (ids,))
    from_graph, from_model = attnres_fx.depth_weights(graph, ids), attnres_fx.depth_weights(model, ids)
    np.testing.assert_allclose(from_graph.to_numpy(), from_model.to_numpy(), atol=1e-7)
    assert from_graph.block_sizes == (BLOCK_SIZE,)


@cold_compile
@pytest.mark.slow
def test_an_inductor_routed_model_is_measured_on_the_eager_route_and_stays_compiled(model, ids):
    from torch._dynamo.utils import counters

    compiled = attnres_fx.compile(copy.deepcopy(model))
    expected = compiled(ids)
    routers = routing.routers(compiled)
    inductor_entries = [dict(router._entries) for router in routers]
    assert all(compiler == "inductor" for entries in inductor_entries for compiler, *_ in entries)
    weights = attnres_fx.depth_weights(compiled, ids)
    np.testing.assert_allclose(weights.to_numpy(), attnres_fx.depth_weights(model, ids).to_numpy(), atol=1e-6)
    assert conversion_of(compiled).compiler == "inductor"
    assert [{k: v for k, v in router._entries.items() if k[0] == "inductor"} for router in routers] == inductor_entries
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(compiled(ids), expected)
    assert counters["stats"]["unique_graphs"] == graphs, "the compiled graph serves again, no recompilation"


def test_an_unconverted_model_is_refused():
    with pytest.raises(ValueError, match="converted by attnres_fx.attnresify"):
        attnres_fx.depth_weights(TinyTransformer(num_layers=2, dim=32), example_ids(TinyTransformer().config))


def test_printed_as_a_table_with_one_row_per_site(model, ids):
    weights = attnres_fx.depth_weights(model, ids)
    lines = str(weights).splitlines()
    assert lines[0].startswith("Depth attention of TinyTransformer, block size 2")
    assert lines[1].split() == ["site", "kind", "block", "emb", "b1", "b2", "b3", "b4", "entropy", "max/token"]
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert list(rows) == [site.name for site in attnres_fx.sites(model)]
    mlp = weights["blocks.1.mlp_res"]
    assert rows["blocks.1.mlp_res"][3:6] == [f"{w:.3f}" for w in mlp.weights]
    assert rows["blocks.1.mlp_res"][-1] == f"{mlp.max_weight:.3f}"


def test_plot_writes_a_png_of_the_requested_size(model, ids, tmp_path):
    pytest.importorskip("matplotlib")
    weights = attnres_fx.depth_weights(model, ids)
    path = weights.plot(tmp_path / "maps" / "depth.png", size=(6, 4), dpi=50)
    assert path == tmp_path / "maps" / "depth.png" and png_size(path) == (300, 200)
    default = weights.plot(tmp_path / "default.png")
    width, height = png_size(default)
    assert height >= 100 * 0.25 * len(weights) and width >= 100 * 0.45 * weights.to_numpy().shape[1]


def test_plot_draws_one_panel_per_stream(tmp_path):
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    src, tgt = make_inputs(seed=1), make_inputs(seed=2)
    model = attnres_fx.attnresify(EncoderDecoder().eval(), (src, tgt), block_size=2)
    weights = attnres_fx.depth_weights(model, src, tgt)
    assert {row.site.stream for row in weights} == {0, 1}
    png_path = weights.plot(tmp_path / "two.png", size=(10, 4), dpi=40)
    assert png_size(png_path) == (400, 160)


def test_plot_without_matplotlib_says_what_to_install(model, ids, tmp_path, monkeypatch):
    weights = attnres_fx.depth_weights(model, ids)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"attnres-fx\[viz\]"):
        weights.plot(tmp_path / "depth.png")
    assert not (tmp_path / "depth.png").exists()
