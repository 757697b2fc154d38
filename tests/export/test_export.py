"""attnres_fx.export: torch.compile (Inductor) of explicit graphs and ONNX / onnxruntime agree with the
eager converted model.

Every converted model gets random, non-zero pseudo-queries, so the softmax over depth really weighs the
sources unequally (at zero init every aggregate is a plain mean). Compiled and exported artefacts are
module-scoped: each torch.compile / ONNX export is paid once.
"""

import copy
import types

import onnx
import onnxruntime as ort
import pytest
import torch

import attnres_fx
from attnres_fx import BlockAttnRes, ExportError, export
from attnres_fx.cli import main as cli_main
from attnres_fx.export.schedule import inference_form
from attnres_fx.models import (TinyConfig, TinyTransformer, build_hf, example_ids, hf_example_inputs, main_output,
                               transformers_available)
from attnres_fx.testing import randomise_pseudo_queries
from attnres_fx.testing.reference import block_attn_res
from conftest import cold_compile

EXPORT_SHAPE = (2, 16)
OTHER_SHAPES = [(3, 11), (1, 40)]


def randomise_queries(model, seed=0):
    return randomise_pseudo_queries(model, seed=seed, std=0.5)


def tiny(parallel=False, dtype=torch.float32):
    """A converted TinyTransformer (``model``) with random pseudo-queries, and its explicit graph."""
    torch.manual_seed(0)
    cfg = TinyConfig(dim=32, num_layers=2, parallel=parallel)
    model = TinyTransformer(cfg).eval().to(dtype)
    ids = example_ids(cfg, *EXPORT_SHAPE)
    new = randomise_queries(attnres_fx.attnresify(model, (ids,), block_size=2))
    return types.SimpleNamespace(cfg=cfg, model=new, ids=ids, graph=attnres_fx.rewrite(new, (ids,)))


@pytest.fixture(scope="module", params=[False, True], ids=["sequential", "parallel"])
def tiny_fp32(request):
    return tiny(parallel=request.param)


@pytest.fixture(scope="module")
def exported(tiny_fp32, tmp_path_factory):
    """The tiny model exported at EXPORT_SHAPE; the parallel variant stores its weights externally."""
    external = tiny_fp32.cfg.parallel
    path = export.to_onnx(tiny_fp32.model, (tiny_fp32.ids,), tmp_path_factory.mktemp("onnx") / "tiny.onnx",
                          external_data=external)
    return types.SimpleNamespace(path=path, external=external, session=export.session(path, device="cpu"))


@pytest.mark.slow
def test_compiled_matches_eager_without_graph_breaks(tiny_fp32):
    compiled = export.compile(tiny_fp32.graph)        # fullgraph=True: a graph break would raise
    with torch.no_grad():
        expected, got = tiny_fp32.model(tiny_fp32.ids), compiled(tiny_fp32.ids)
    # fp32 either way; Inductor fuses the norms, the depth-softmax and the weighted sums and reorders
    # their reductions, so only rounding differs (~1e-6 observed on logits of magnitude ~2).
    assert (got - expected).abs().max() <= 1e-5
    assert len(attnres_fx.sites(compiled)) == len(attnres_fx.sites(tiny_fp32.model))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [EXPORT_SHAPE, *OTHER_SHAPES], ids=lambda s: f"{s[0]}x{s[1]}")
def test_onnxruntime_matches_eager_at_any_batch_and_length(tiny_fp32, exported, shape):
    ids = example_ids(tiny_fp32.cfg, *shape, seed=1)
    # ONNX Runtime's CPU kernels (MatMul, LayerNorm, Softmax) accumulate in a different order than
    # PyTorch's: rounding only, ~1e-6 observed; 1e-4 leaves room for other CPUs' SIMD widths.
    report = export.verify(tiny_fp32.model, exported.session, ids, atol=1e-4, rtol=0)
    assert report.ok, str(report)
    assert report.max_abs <= 1e-4
    assert report.outputs[0].shape == (*shape, tiny_fp32.cfg.vocab_size)
    assert report.providers == ("CPUExecutionProvider",)


@pytest.mark.slow
def test_onnx_graph_is_valid_named_and_traceable_to_every_site(tiny_fp32, exported, tmp_path):
    onnx.checker.check_model(str(exported.path))
    model = onnx.load(str(exported.path))
    assert [i.name for i in model.graph.input] == ["ids"]
    assert [o.name for o in model.graph.output] == ["logits"]
    assert exported.path.with_name("tiny.onnx.data").exists() == exported.external
    sites = attnres_fx.sites(tiny_fp32.model)
    # The default export is the two-phase schedule: a single-source site (the first) is the identity
    # and exports to no node; every other site keeps its own group.
    two_phase_groups = export.attnres_node_groups(exported.path)
    assert list(two_phase_groups) == [site.name for site in sites if site.num_sources > 1]
    per_site = export.to_onnx(tiny_fp32.model, (tiny_fp32.ids,), tmp_path / "per_site.onnx", two_phase=False)
    groups = export.attnres_node_groups(per_site)
    assert len(groups) == len(sites)
    assert list(groups) == [site.name for site in sites]
    model = onnx.load(str(per_site))
    nodes = {node.name: node for node in model.graph.node}
    for site, names in groups.items():
        assert names and set(names) <= set(nodes)
        # The exporter's own "namespace" metadata spells out the module path, e.g. in Netron.
        namespace = {p.key: p.value for p in nodes[names[0]].metadata_props}["namespace"]
        assert f"{site}: attnres_fx.op.module.BlockAttnRes" in namespace


@pytest.mark.slow
def test_verify_reports_disagreement(tiny_fp32, exported):
    other = copy.deepcopy(tiny_fp32.model)
    randomise_queries(other, seed=1)
    report = export.verify(other, exported.session, tiny_fp32.ids)
    assert not report.ok
    text = str(report)
    assert "logits" in text and "CPUExecutionProvider" in text and "NO" in text
    with pytest.raises(ExportError, match="disagrees"):
        report.raise_if_failed()


@cold_compile
@pytest.mark.slow
def test_bf16_compiled_matches_eager_bf16():
    model = tiny(dtype=torch.bfloat16)
    with torch.no_grad():
        expected, got = model.model(model.ids), export.compile(model.graph)(model.ids)
    assert got.dtype == torch.bfloat16
    # Eager rounds to bf16 (8 significant bits) after every op; Inductor computes each fused chain in
    # fp32 and rounds once. A few bf16 ulps per op accumulate over two layers: ~0.02-0.035 observed on
    # logits of magnitude ~2, so allow 5% of the output's scale (~13 ulps).
    scale = expected.float().abs().max()
    assert (got.float() - expected.float()).abs().max() <= 0.05 * scale


def test_block_attnres_softmax_runs_in_fp32_for_bf16_sources():
    """Logits ~1000, 1 apart: bf16 (spacing 4 there) rounds them equal, an fp32 softmax does not."""
    torch.manual_seed(0)
    dim = 64
    sources = [torch.randn(1, 1, dim).to(torch.bfloat16) for _ in range(2)]      # [batch, seq, dim]
    keys = torch.cat([s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                      for s in sources]).view(2, dim)
    # Smallest query whose logits against the two keys are 1000 and 1001.
    query = torch.linalg.lstsq(keys, torch.tensor([1000.0, 1001.0])).solution
    module = BlockAttnRes(dim).to(torch.bfloat16)
    with torch.no_grad():
        module.proj.weight.copy_(query[None])
    fp32 = copy.deepcopy(module).float()
    reference = block_attn_res([sources[0].float()], sources[1].float(), fp32.proj, fp32.norm)
    logits = keys @ fp32.proj.weight[0]
    assert logits[1] - logits[0] > 0.5 and logits.abs().max() > 512      # close, and large for bf16
    bf16_weights = torch.softmax(logits.to(torch.bfloat16), dim=0).float()
    bf16_softmax = bf16_weights[0] * sources[0].float() + bf16_weights[1] * sources[1].float()

    out = module(*sources)
    assert out.dtype == torch.bfloat16
    module_error = (out.float() - reference).abs().max()
    bf16_error = (bf16_softmax - reference).abs().max()
    assert bf16_error > 0.5                       # a bf16 softmax visibly changes the result...
    assert module_error < bf16_error / 20         # ...the module matches the fp32 one far better
    assert module_error <= 2 ** -7 * reference.abs().max()   # up to rounding its output to bf16


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)


def assert_readable(err: ExportError, *needles):
    text = str(err)
    assert "Traceback" not in text and len(text.splitlines()) < 20, text
    assert "Hint:" in text
    for needle in needles:
        assert needle in text, text


def test_data_dependent_control_flow_cannot_export(tmp_path):
    with pytest.raises(ExportError) as info:
        export.to_onnx(DataDependent(), (torch.randn(2, 3, 8),), tmp_path / "bad.onnx")
    assert_readable(info.value, "torch.export failed", "data-dependent", "torch.where",
                    "test_export.py", "if x.sum() > 0:")
    assert not (tmp_path / "bad.onnx").exists()


class ComplexRotary(torch.nn.Module):
    """Rotates pairs of features as a complex product, as Llama 4's rotary embedding does."""

    def forward(self, x):
        turn = torch.polar(torch.ones(x.shape[-1] // 2), torch.arange(x.shape[-1] // 2, dtype=torch.float32))
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * turn.unsqueeze(0)).flatten(-2)


def test_complex_arithmetic_is_refused_with_what_to_do(tmp_path):
    with pytest.raises(ExportError) as info:
        export.to_onnx(ComplexRotary(), (torch.randn(2, 3, 8),), tmp_path / "bad.onnx")
    assert_readable(info.value, "ONNX conversion failed", "complex tensors", "cos/sin")
    assert not (tmp_path / "bad.onnx").exists()


def test_graph_break_is_a_compile_error():
    compiled = export.compile(DataDependent())
    with pytest.raises(ExportError) as info:
        compiled(torch.randn(2, 3, 8))
    assert_readable(info.value, "torch.compile failed", "Data-dependent branching", "if x.sum() > 0:")


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="this onnxruntime build has CUDA: no fallback to provoke")
def test_cuda_session_without_cuda_reports_the_fallback(tiny_fp32, exported):
    with pytest.raises(ExportError, match="fell back to CPU") as info:
        export.session(exported.path, device="cuda")
    assert "CPUExecutionProvider" in str(info.value) and "onnxruntime-gpu" in str(info.value)
    assert export.session(exported.path, device="auto").get_providers() == ["CPUExecutionProvider"]


class KeywordsAndDict(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None, scale=None):
        hidden = self.lin(x) * mask[..., None]
        return {"hidden": hidden, "pooled": hidden.mean(1) * scale, "unused": None}


@pytest.mark.slow
def test_inputs_named_by_signature_outputs_by_keys(tmp_path):
    model = KeywordsAndDict()
    x, mask, scale = torch.randn(2, 5, 8), torch.ones(2, 5), torch.randn(2, 8)
    # Keyword order differs from forward()'s: the graph follows the signature either way.
    path = export.to_onnx(model, (x,), tmp_path / "kw.onnx", example_kwargs={"scale": scale, "mask": mask})
    sess = export.session(path, device="cpu")
    assert [i.name for i in sess.get_inputs()] == ["x", "mask", "scale"]
    assert [o.name for o in sess.get_outputs()] == ["hidden", "pooled"]
    report = export.verify(model, sess, (torch.randn(3, 7, 8),),
                           example_kwargs={"mask": torch.rand(3, 7), "scale": torch.randn(3, 8)})
    assert report.ok, str(report)


def test_non_tensor_outputs_are_reported_before_export(tmp_path):
    class ReturnsInt(torch.nn.Module):
        def forward(self, x):
            return x * 2, 3

    with pytest.raises(ExportError, match="non-tensor values"):
        export.to_onnx(ReturnsInt(), (torch.randn(2, 3),), tmp_path / "int.onnx")


@cold_compile
@pytest.mark.slow
def test_hf_llama_compiles_and_exports(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, EXPORT_SHAPE, generator=torch.Generator().manual_seed(0))
    new = randomise_queries(attnres_fx.attnresify(model, (ids,)))
    with torch.no_grad():
        expected, got = new(ids).logits, export.compile(attnres_fx.rewrite(new, (ids,)))(ids).logits
    assert (got - expected).abs().max() <= 1e-5          # fp32, reordered reductions only
    path = export.to_onnx(new, (ids,), tmp_path / "llama.onnx")
    sess = export.session(path, device="cpu")
    assert [i.name for i in sess.get_inputs()] == ["input_ids"]
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    assert len(export.attnres_node_groups(path)) == sum(s.num_sources > 1 for s in attnres_fx.sites(new))
    for shape in [EXPORT_SHAPE, *OTHER_SHAPES]:
        report = export.verify(new, sess, torch.randint(0, 128, shape))
        assert report.ok and report.max_abs <= 1e-4, str(report)


@pytest.mark.slow
def test_cli_export(tmp_path, capsys):
    path = tmp_path / "cli.onnx"
    code = cli_main(["export", "tiny", "--onnx", str(path), "--block-size", "2", "--layers", "2", "--dim", "32"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert path.exists()
    assert "providers used: CPUExecutionProvider" in out and "max |onnxruntime - torch|" in out


@cold_compile
@pytest.mark.slow
def test_cli_demo_reports_eager_compiled_and_onnxruntime(tmp_path, capsys):
    assert cli_main(["demo", "--layers", "2", "--dim", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("eager vs compiled vs onnxruntime"):].splitlines()
    assert [line.split()[0] for line in table[3:6]] == ["eager", "compiled", "onnxruntime"]
    assert all(float(line.split()[1]) <= 1e-4 for line in table[4:6]), "three-way agreement"
    assert (tmp_path / "model.onnx").exists() and (tmp_path / "rewritten_graph.py").exists()


def test_backends_get_the_two_phase_form_without_touching_the_module(tiny_fp32):
    module = tiny_fp32.graph
    code = module.code
    twin = inference_form(module, two_phase=True)
    assert twin is not module and module.code == code, "the caller's module keeps its per-site graph"
    assert any(n.name.startswith("attnres_phase1_block") for n in twin.graph.nodes)
    assert twin.get_parameter("blocks.1.attn_res.proj.weight") is module.get_parameter("blocks.1.attn_res.proj.weight")
    assert [s.name for s in attnres_fx.sites(twin)] == [s.name for s in attnres_fx.sites(module)]
    assert inference_form(module, two_phase=False) is module
    with torch.no_grad():
        # The schedule regroups the same fp32 softmax (online-softmax merge): rounding only.
        torch.testing.assert_close(twin(tiny_fp32.ids), module(tiny_fp32.ids), rtol=1e-5, atol=1e-5)


# -- real models: one parallel-residual decoder and ViT (Llama is above) ---------------------------------

# T5 (two streams) is checked as an explicit graph in test_hf_models.py; its export costs a minute.
HF_BACKEND_MODELS = ["gpt_neox", "vit"]


@pytest.fixture(scope="module", params=HF_BACKEND_MODELS)
def hf_converted(request):
    if not transformers_available():
        pytest.skip("transformers is not installed (pip install 'attnres-fx[hf]')")
    name = request.param
    args, kwargs = hf_example_inputs(name, *EXPORT_SHAPE)
    new = randomise_queries(attnres_fx.attnresify(build_hf(name), args, example_kwargs=kwargs, block_size=2))
    return types.SimpleNamespace(name=name, model=new, args=args, kwargs=kwargs)


@cold_compile
@pytest.mark.slow
def test_hf_explicit_graphs_compile_without_graph_breaks_and_match_eager(hf_converted):
    m = hf_converted
    compiled = export.compile(attnres_fx.rewrite(m.model, m.args, example_kwargs=m.kwargs))   # fullgraph=True
    with torch.no_grad():
        expected = main_output(m.name, m.model(*m.args, **m.kwargs))
        got = main_output(m.name, compiled(*m.args, **m.kwargs))
    # fp32 both; Inductor reorders reductions (norms, depth softmax, matmuls): rounding only.
    assert (got - expected).abs().max() <= 1e-5


@pytest.mark.slow
def test_hf_models_run_in_onnxruntime_at_three_shapes(hf_converted, tmp_path):
    m = hf_converted
    path = export.to_onnx(m.model, m.args, tmp_path / f"{m.name}.onnx", example_kwargs=m.kwargs)
    onnx.checker.check_model(str(path))
    sess = export.session(path, device="cpu")
    sites = attnres_fx.sites(m.model)
    # Two-phase export: every site but the single-source ones (the identity) keeps a node group.
    assert list(export.attnres_node_groups(path)) == [s.name for s in sites if s.num_sources > 1]
    # ViT's token count is fixed by the image size: only the batch varies there.
    for batch, seq in [EXPORT_SHAPE, *OTHER_SHAPES]:
        args, kwargs = hf_example_inputs(m.name, batch, seq)
        # onnxruntime's CPU kernels accumulate in another order than PyTorch's: rounding, ~1e-6 seen.
        report = export.verify(m.model, sess, args, example_kwargs=kwargs, atol=1e-4, rtol=0)
        assert report.ok and report.max_abs <= 1e-4, str(report)


# -- models whose export needs more than their graph -------------------------------------------------------

def _tiny_hf(config_class: str, model_class: str, **fields):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    tiny_fields = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager")
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**{**tiny_fields, **fields})).eval()


def test_transformers_grouped_matmul_of_experts_exports(tmp_path):
    """transformers runs a mixture of experts' matmul on the CPU as a custom operator the ONNX exporter has
    no translation of (Qwen2-MoE, GraniteMoeHybrid failed there, converted or not); the export takes
    transformers' own ONNX function for it."""
    pytest.importorskip("transformers.integrations.moe")

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 16, 8))
            self.register_buffer("ends", torch.tensor([3, 3, 8]))      # rows per expert, cumulative

        def forward(self, x):
            return torch.ops.transformers.grouped_mm_fallback(x, self.weight, self.ends)

    torch.manual_seed(0)
    experts, x = Experts(), torch.randn(8, 16)
    path = export.to_onnx(experts, (x,), tmp_path / "experts.onnx", dynamic=False)
    assert export.verify(experts, path, (x,), atol=1e-5, rtol=0).ok


def test_a_cache_of_more_than_keys_and_values_is_refused_before_anything_is_written(tmp_path):
    model = _tiny_hf("Lfm2Config", "Lfm2ForCausalLM", layer_types=["conv", "full_attention"], block_ff_dim=64)
    ids = torch.randint(1, 128, (2, 8))
    with pytest.raises(ExportError, match=r"Lfm2ForCausalLM's cache also holds LinearAttentionLayer layers .*"
                                          r"with_cache=False"):
        export.to_onnx(model, (ids,), tmp_path / "lfm2.onnx", with_cache=True)
    assert not list(tmp_path.iterdir())


def test_an_export_that_computes_something_else_is_deleted_and_refused(tmp_path):
    """An exporter can translate a graph it takes without an error into one that computes something else
    (LongT5's explicit graph does): here a model whose traced code differs from its eager code."""
    class TracedOtherwise(torch.nn.Module):
        def forward(self, x):
            return x * 2 if torch.compiler.is_exporting() else x * 3

    with pytest.raises(ExportError, match=r"computes something else than TracedOtherwise .* not written"):
        export.to_onnx(TracedOtherwise(), (torch.randn(2, 3),), tmp_path / "other.onnx")
    assert not list(tmp_path.iterdir())
    assert export.to_onnx(TracedOtherwise(), (torch.randn(2, 3),), tmp_path / "kept.onnx", check=False).exists()


def test_an_export_that_rounds_otherwise_is_kept(tmp_path):
    """Rounding of a deep model's export is beyond an element-wise 1e-3 on its largest logits but within
    1e-2 of each row's norm (a 12-layer, d=512 model's logits differ by 8e-4 of the row): kept."""
    class RoundsOtherwise(torch.nn.Module):
        def forward(self, x):
            return x * 3 * (1.005 if torch.compiler.is_exporting() else 1.0)

    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    path = export.to_onnx(RoundsOtherwise(), (x,), tmp_path / "rounded.onnx")
    assert not export.verify(RoundsOtherwise(), path, (x,), atol=1e-3, rtol=1e-3).ok


@pytest.mark.slow
def test_longt5_converts_whole_and_its_explicit_graph_asks_for_the_attention_mask():
    """LongT5 builds a missing attention mask only when it runs eagerly: the conversion's dummy inputs carry
    one (without it the capture failed and each decoder block became a stream of its own), and an explicit
    graph traced without one says to pass it."""
    model = _tiny_hf("LongT5Config", "LongT5ForConditionalGeneration", d_model=32, d_kv=16, d_ff=64, num_layers=2,
                     num_decoder_layers=2, num_heads=2, decoder_start_token_id=0, pad_token_id=0, local_radius=4)
    new = attnres_fx.attnresify(model, preserve_scale=True)
    assert [stream.owner for stream in attnres_fx.plan_of(new).streams] == ["encoder", "decoder"]
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(attnres_fx.TraceError, match=r"Pass attention_mask=torch.ones_like\(input_ids\)"):
        attnres_fx.rewrite(new, (ids,), example_kwargs={"decoder_input_ids": ids})


@pytest.mark.slow
def test_wavlm_whose_two_phase_graph_the_exporter_mistranslates_is_written_in_the_per_site_form(tmp_path):
    """WavLM (do_stable_layer_norm: pre-norm) in the two-phase schedule computes its function in torch (1e-5
    off the converted model), but torch.onnx translates that graph into a wrong one (2.3 off); its refusal
    once ended the export with a hint that left out two_phase=False. to_onnx now writes the per-site form,
    checked as well, and warns. 1e-4: fp32, reordered reductions."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.WavLMConfig(do_stable_layer_norm=True, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64, conv_dim=(8, 8),
                                      conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                      num_conv_pos_embedding_groups=2)
    audio = torch.randn(1, 800, generator=torch.Generator().manual_seed(0))
    model = randomise_pseudo_queries(attnres_fx.attnresify(transformers.WavLMModel(config).eval(), (audio,)))
    with pytest.warns(attnres_fx.AttnResWarning, match=r"two-phase schedule of WavLMModel.*per-site form"):
        path = export.to_onnx(model, (audio,), tmp_path / "wavlm.onnx")
    report = export.verify(model, export.session(path, device="cpu"), (audio,))
    assert report.ok and report.max_abs <= 1e-4, str(report)
