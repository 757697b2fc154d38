"""Real models: tiny random-weight Hugging Face Transformers, converted in place.

For every pre-norm architecture of :data:`attnres_fx.models.HF_MODELS`: the sites found and their names,
zero-init equivalence (exact with ``preserve_scale=True``; up to a derived eps bound by default), the
explicit graph equal to the live model under random pseudo-queries, other input shapes, one training
step. Then the two-stream T5, post-norm BERT, eval dropout and dtype casts, the explicit graph's
tracers, the CLI, the import isolation of the optional packages, and a timm-layout ViT.

Each model is built and converted once per module (the ``zoo`` fixture caches them).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from torch.export import Dim

import attnres_fx
import hf_models as H
from attnres_fx.cli import build_model, build_parser
from attnres_fx.cli import main as cli_main
from attnres_fx.testing import randomise_pseudo_queries
from hf_models import needs_hf

# preserve_scale=True multiplies each zero-init aggregate (the mean of its sources) back to their plain
# sum, which is the original stream: exact in real arithmetic; fp32 round-off of the reassociated sums
# stays below 1e-6 relative over these two-layer models.
EXACT = 1e-5
TINY_EPS = 1e-12
OTHER_SHAPES = [(3, 11), (1, 64)]       # (batch, seq); the example inputs are (2, 16)


class Zoo:
    """Models, their example outputs and conversions, each made once per module."""

    def __init__(self):
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def model(self, name: str):
        return self._get(("model", name), lambda: H.build_hf(name))

    def output(self, name: str):
        return self._get(("output", name), lambda: run(name, self.model(name)))

    def converted(self, name: str, preserve_scale: bool = False):
        args, kwargs = H.hf_example_inputs(name)
        return self._get(("converted", name, preserve_scale), lambda: attnres_fx.attnresify(
            copy.deepcopy(self.model(name)), args, example_kwargs=kwargs, preserve_scale=preserve_scale))


@pytest.fixture(scope="module")
def zoo():
    return Zoo()


def run(name, module, batch=2, seq=16):
    args, kwargs = H.hf_example_inputs(name, batch, seq)
    with torch.no_grad():
        return module(*args, **kwargs)


def compared_outputs(name, output):
    """The tensors a zero-init conversion must reproduce: the main output, and T5's encoder output."""
    tensors = [H.main_output(name, output)]
    if H.hf_model(name).task == "seq2seq_lm":
        tensors.append(output.encoder_last_hidden_state)
    return tensors


def expected_kinds(name: str, stream: str) -> list[str]:
    """Branch kinds per site, in execution order: attention then MLP per layer (T5's decoder: self-
    and cross-attention, then MLP); a parallel layer is one site with both branches."""
    e = H.EXPECTED[name]
    if e.parallel_residual:
        return ["attn+mlp"] * e.streams[stream]
    per_layer = ["attn"] * (e.sites_per_layer[stream] - 1) + ["mlp"]
    return per_layer * e.num_layers


PRE_NORM = [pytest.param(name, marks=[needs_hf, pytest.mark.slow]) for name in H.PRE_NORM_NAMES]


# -- every pre-norm architecture ------------------------------------------------------------------------

@pytest.mark.parametrize("name", PRE_NORM)
def test_sites_are_named_after_the_module_that_adds_and_never_found_by_class_names(zoo, name):
    """Detection reads data flow: the sites, their owners and kinds are as expected, and with every class
    name in the graph's metadata erased, detection finds the same."""
    from attnres_fx.capture.tracers import capture_dynamo
    from attnres_fx.passes import detect_residual_streams

    e = H.EXPECTED[name]
    args, kwargs = H.hf_example_inputs(name)
    graph_module, _ = capture_dynamo(zoo.model(name), args, kwargs)
    detection = detect_residual_streams(graph_module)
    assert [len(stream.sites) for stream in detection.streams] == list(e.streams.values())
    assert [site.owner for stream in detection.streams for site in stream.sites] == e.owner_paths()
    for stream, stream_name in zip(detection.streams, e.streams):
        kinds = ["+".join(sorted(b.kind for b in site.branches)) for site in stream.sites]
        assert kinds == expected_kinds(name, stream_name)
        assert all(site.normalised for site in stream.sites), "every branch reads the stream through a norm"

    injected = attnres_fx.sites(zoo.converted(name))
    branches = [(site.owner, branch.kind) for stream in detection.streams for site in stream.sites
                for branch in site.branches]
    assert [s.name for s in injected if s.kind != "final"] == [f"{owner}.{kind}_res" for owner, kind in branches]
    finals = [s for s in injected if s.kind == "final"]
    assert [f.stream for f in finals] == list(range(e.num_streams)), "one final aggregation per stream"

    for node in graph_module.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {key: (path, "Module") for key, (path, *_) in stack.items()}
        node.meta.pop("source_fn_stack", None)

    def summary(result):
        return [[(site.owner, site.kind, site.normalised) for site in stream.sites] for stream in result.streams]
    assert summary(detect_residual_streams(graph_module)) == summary(detection)


@pytest.mark.parametrize("name", PRE_NORM)
def test_preserve_scale_conversion_equals_the_original_and_keeps_the_output_type(zoo, name):
    original, new = zoo.output(name), run(name, zoo.converted(name, preserve_scale=True))
    assert type(new) is type(original), "a ModelOutput stays the same ModelOutput"
    for got, want in zip(compared_outputs(name, new), compared_outputs(name, original)):
        assert H.relative_error(got, want) < EXACT


@pytest.mark.parametrize("name", PRE_NORM)
def test_default_conversion_differs_only_by_the_norms_eps(zoo, name):
    """At zero init each norm reads h / c instead of h (c = number of sources): the norm of h with eps
    replaced by c^2 eps. ``eps_bound`` sums the resulting per-token rescaling over every aggregation,
    from the models' own eps and the measured per-token variance of the stream (HF init keeps it small,
    ~2e-4 for the LMs, hence differences of a few percent). With eps = 1e-12 the same conversion must
    match to round-off: the difference is the eps and nothing else."""
    args, kwargs = H.hf_example_inputs(name)
    eps = getattr(zoo.model(name).config, H.hf_model(name).eps_field)
    bound = H.eps_bound(zoo.converted(name, preserve_scale=True), args, kwargs, eps)
    new = run(name, zoo.converted(name))
    for got, want in zip(compared_outputs(name, new), compared_outputs(name, zoo.output(name))):
        assert H.relative_error(got, want) <= bound + EXACT

    tiny_eps = H.build_hf(name, **{H.hf_model(name).eps_field: TINY_EPS})
    original = run(name, tiny_eps)
    converted = attnres_fx.attnresify(tiny_eps, args, example_kwargs=kwargs)
    for got, want in zip(compared_outputs(name, run(name, converted)), compared_outputs(name, original)):
        assert H.relative_error(got, want) < EXACT


# test_export.py compiles and exports the explicit graphs of Llama, GPT-NeoX and ViT against the live model.
EXPLICIT_HERE = [p for p in PRE_NORM if p.values[0] not in ("llama", "gpt_neox", "vit")]


@pytest.mark.parametrize("name", EXPLICIT_HERE)
def test_the_explicit_graph_equals_the_live_model_with_random_pseudo_queries(zoo, name):
    new = randomise_pseudo_queries(copy.deepcopy(zoo.converted(name)), seed=2, std=0.5)
    args, kwargs = H.hf_example_inputs(name)
    graph = attnres_fx.rewrite(new, args, example_kwargs=kwargs)
    live, explicit = run(name, new), run(name, graph)
    for got, want in zip(compared_outputs(name, explicit), compared_outputs(name, live)):
        assert H.relative_error(got, want) < EXACT
    assert H.relative_error(H.main_output(name, live), H.main_output(name, zoo.output(name))) > 1e-3, \
        "the random pseudo-queries must change the output"


@pytest.mark.parametrize("name", PRE_NORM)
def test_other_shapes_run_exactly_too(zoo, name):
    """Batch and sequence may change between calls (ViT's token count is fixed by its image size)."""
    new, model = zoo.converted(name, preserve_scale=True), zoo.model(name)
    for batch, seq in OTHER_SHAPES:
        got, want = run(name, new, batch, seq), run(name, model, batch, seq)
        assert H.main_output(name, got).shape[0] == batch
        assert H.relative_error(H.main_output(name, got), H.main_output(name, want)) < EXACT


@pytest.mark.parametrize("name", PRE_NORM)
def test_one_optimizer_step_moves_the_pseudo_queries(zoo, name):
    """Every aggregation over two or more sources gets a gradient; one over a single source (the first
    site of a stream) has softmax weight 1 whatever its query, so its gradient is exactly zero."""
    new = copy.deepcopy(zoo.converted(name)).train()
    inputs = H.hf_example_inputs(name)
    optimizer = torch.optim.Adam(new.parameters(), lr=1e-2)
    loss = H.lm_loss(name, new(*inputs[0], **inputs[1]), inputs)
    loss.backward()
    optimizer.step()
    for site in attnres_fx.sites(new):
        moved = bool(new.get_submodule(site.name).proj.weight.abs().max() > 0)
        assert moved == (site.num_sources > 1), site.name


# -- encoder-decoder: two streams -----------------------------------------------------------------------

@needs_hf
@pytest.mark.slow
def test_t5_encoder_final_aggregation_feeds_the_output_and_every_cross_attention(zoo):
    """With a random pseudo-query on ``encoder.final_res`` only, the exact conversion must compute what
    the original decoder computes from the converted encoder's output: the encoder's final aggregation
    feeds ``encoder_last_hidden_state`` and, through the same final norm, each cross-attention."""
    new = copy.deepcopy(zoo.converted("t5", preserve_scale=True))
    final = {site.name: site for site in attnres_fx.sites(new)}["encoder.final_res"]
    assert final.stream == 0
    with torch.no_grad():
        new.encoder.final_res.proj.weight.normal_(generator=torch.Generator().manual_seed(0))
    args, kwargs = H.hf_example_inputs("t5")
    out = run("t5", new)
    encoder_output = out.encoder_last_hidden_state
    assert H.relative_error(encoder_output, zoo.output("t5").encoder_last_hidden_state) > 1e-3, \
        "the perturbed final aggregation must change the encoder's output"
    with torch.no_grad():
        decoded = zoo.model("t5")(*args, encoder_outputs=(encoder_output,), **kwargs)
        assert H.relative_error(new.encoder(*args).last_hidden_state, encoder_output) < EXACT, \
            "the encoder called on its own (as generate does) is converted too"
    assert H.relative_error(out.logits, decoded.logits) < EXACT


# -- post-norm ------------------------------------------------------------------------------------------

@needs_hf
@pytest.mark.slow
def test_bert_is_post_norm_and_left_untouched(untouched):
    model = H.build_hf("bert")
    args, kwargs = H.hf_example_inputs("bert")
    check = untouched(model)
    with torch.no_grad():
        before = model(*args, **kwargs).last_hidden_state
    with pytest.raises(attnres_fx.UnsupportedArchitectureError, match="post-norm") as err:
        attnres_fx.attnresify(model, args, example_kwargs=kwargs)
    assert "pre-norm residual stream" in str(err.value) and "BertModel" in str(err.value)
    check()
    with torch.no_grad():
        assert torch.equal(model(*args, **kwargs).last_hidden_state, before)
    assert "forward" not in model.__dict__


# -- what the stream passes through ---------------------------------------------------------------------

@needs_hf
@pytest.mark.slow
def test_eval_mode_dropout_on_the_stream_is_transparent():
    model = H.build_hf("gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)   # eval(): dropout is off
    args, _ = H.hf_example_inputs("gpt2")
    new = attnres_fx.attnresify(copy.deepcopy(model), args, preserve_scale=True)
    assert len([s for s in attnres_fx.sites(new) if s.kind != "final"]) == H.EXPECTED["gpt2"].num_sites
    with torch.no_grad():
        assert H.relative_error(new(*args).logits, model(*args).logits) < EXACT


@needs_hf
@pytest.mark.slow
def test_bf16_model_casts_are_transparent_and_cost_no_more_than_bf16_itself():
    """Llama's norms cast the bf16 stream to fp32 and back. The conversion sums sources in fp32 and
    rounds once where the original rounds after every add, so the two bf16 models differ by round-off;
    the converted one must be as close to the fp32 model as the original bf16 model is (up to a factor
    2 for the luck of rounding)."""
    reference = H.build_hf("llama")
    model = H.build_hf("llama").to(torch.bfloat16)
    args, _ = H.hf_example_inputs("llama")
    new = attnres_fx.attnresify(copy.deepcopy(model), args, preserve_scale=True)
    assert len([s for s in attnres_fx.sites(new) if s.kind != "final"]) == H.EXPECTED["llama"].num_sites
    with torch.no_grad():
        truth = reference(*args).logits
        original_error = H.relative_error(model(*args).logits.float(), truth)
        assert H.relative_error(new(*args).logits.float(), truth) <= 2 * original_error


# -- the explicit graph's tracers -----------------------------------------------------------------------

@needs_hf
@pytest.mark.slow
def test_explicit_graph_falls_back_to_export_keeps_the_config_and_refuses_a_cache(zoo):
    """Most pretrained configs say use_cache=True: the explicit graph is traced without a cache, keeps the
    call signature, returns no cache, and leaves the config as it was; fx alone says what to try."""
    model = attnres_fx.attnresify(H.build_hf("llama", use_cache=True), preserve_scale=True)
    args, _ = H.hf_example_inputs("llama")
    graph = attnres_fx.rewrite(model, args)
    assert graph.meta["attnres"]["frontend"] == "export" and model.config.use_cache is True
    with torch.no_grad():
        got = graph(*args)
    assert got.get("past_key_values") is None
    assert H.relative_error(got.logits, run("llama", zoo.model("llama")).logits) < EXACT
    with pytest.raises(attnres_fx.TraceError, match="tracer='export'") as err:
        attnres_fx.rewrite(model, args, tracer="fx")
    assert set(err.value.causes) == {"fx"}
    with pytest.raises(attnres_fx.TraceError, match="use_cache=False") as err:
        attnres_fx.rewrite(model, args, example_kwargs={"use_cache": True})
    assert "KV cache" in str(err.value) and "converted model itself" in str(err.value)


@needs_hf
@pytest.mark.slow
def test_dynamic_shapes_given_by_the_user_override_the_default(zoo):
    args, _ = H.hf_example_inputs("gpt2")
    graph = attnres_fx.rewrite(zoo.converted("gpt2"), args, tracer="export", dynamic_shapes=({0: Dim.AUTO},))
    assert run("gpt2", graph, batch=3).logits.shape[:2] == (3, 16)
    with pytest.raises((AssertionError, RuntimeError), match="16"):   # the sequence length stayed static
        run("gpt2", graph, seq=11)


# -- CLI ------------------------------------------------------------------------------------------------

@needs_hf
@pytest.mark.slow
def test_cli_demo_model_converts_a_hugging_face_model_and_refuses_bert(tmp_path, capsys):
    assert cli_main(["demo", "--model", "llama", "--out", str(tmp_path), "--no-backends"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "model.layers.1.mlp_res" in out and "model.final_res" in out
    assert "PASS equivalence" in out
    assert cli_main(["demo", "--model", "bert", "--out", str(tmp_path), "--no-backends"]) == 1
    assert "post-norm" in capsys.readouterr().err


def test_build_model_knows_tiny_and_every_hugging_face_name():
    from attnres_fx.cli import MODELS, UsageError

    assert MODELS == ("tiny", *H.HF_NAMES)
    model, args, kwargs = build_model("tiny", build_parser().parse_args(["demo", "--layers", "2"]))
    assert len(model.blocks) == 2 and args[0].shape == (2, 16) and kwargs == {}
    with pytest.raises(UsageError, match="known: tiny, gpt2"):
        build_model("gpt3", None)


# -- optional packages ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_import_needs_neither_transformers_nor_a_working_torchvision(tmp_path):
    """``import attnres_fx`` (models and CLI included) imports neither transformers nor timm, so a broken
    torchvision, as on this machine's CPU torch (README, Limits), cannot break it."""
    for package in ("torchvision", "timm"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise RuntimeError('broken {package}')\n")
    code = ("import sys, attnres_fx, attnres_fx.models, attnres_fx.cli; "
            "loaded = {'transformers', 'torchvision', 'timm'} & set(sys.modules); assert not loaded, loaded")
    path = [str(tmp_path), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


class TimmLayoutViT(torch.nn.Module):
    """A vision Transformer laid out as timm's ``VisionTransformer`` (timm itself needs torchvision, which
    does not install next to this CPU torch; README, Limits): conv patch embedding, a class token,
    learned positions, blocks ``x + drop_path(ls(attn(norm1(x))))`` with LayerScale and stochastic depth,
    a final norm and a head on the class token."""

    def __init__(self, dim=32, depth=2, heads=2, patch=8, image=32, classes=10):
        super().__init__()
        nn = torch.nn
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + (image // patch) ** 2, dim) * 0.02)
        self.blocks = nn.ModuleList(TimmLayoutBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class LayerScale(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = torch.nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x):
        return x * self.gamma


class DropPath(torch.nn.Module):
    """Stochastic depth: drops a whole sample's branch in training, the identity in eval."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = torch.rand(x.shape[0], 1, 1, device=x.device) >= self.p
        return x * keep / (1 - self.p)


class TimmLayoutBlock(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        nn = torch.nn
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ls1, self.ls2 = LayerScale(dim), LayerScale(dim)
        self.drop_path = DropPath(0.1)

    def forward(self, x):
        u = self.norm1(x)
        x = x + self.drop_path(self.ls1(self.attn(u, u, u, need_weights=False)[0]))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))


def test_a_timm_layout_vision_transformer_with_layer_scale_and_stochastic_depth():
    torch.manual_seed(0)
    model = TimmLayoutViT().eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    other = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(other)
    converted = attnres_fx.attnresify(model, (x,), preserve_scale=True)
    assert converted is model
    assert [s.name for s in attnres_fx.sites(model)] == [
        "blocks.0.attn_res", "blocks.0.mlp_res", "blocks.1.attn_res", "blocks.1.mlp_res", "final_res"]
    with torch.no_grad():
        assert H.relative_error(model(other), expected) < EXACT
    model.train()   # stochastic depth on: another graph, still trainable end to end
    loss = model(other).square().mean()
    loss.backward()
    assert model.blocks[1].mlp_res.proj.weight.grad.abs().sum() > 0


# -- architectures beyond HF_MODELS, used as a user would -----------------------------------------------------

# Sampled from transformers' causal-LM list, one per mechanism the table above has none of: ALiBi with a fused
# query-key-value (BLOOM), attention and MLP in parallel off one norm with sliding-window layers (Cohere 2),
# chunked attention over 4-token chunks with experts and a layer without rotary (Llama 4: the 9-token prompt
# spans three chunks). Tiny, built from their configs; README names the others this check passes on.
SAMPLED = {
    "bloom": ("BloomConfig", "BloomForCausalLM", {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"sliding_window": 4}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {"attention_chunk_size": 4, "num_local_experts": 2,
                                                         "intermediate_size_mlp": 64, "no_rope_layers": [1, 0]}),
}
SAMPLED_FIELDS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, attn_implementation="eager")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAMPLED))
def test_a_sampled_architecture_converts_exactly_and_generates_the_same_tokens(name):
    import transformers

    config_class, model_class, fields = SAMPLED[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SAMPLED_FIELDS, **fields})
    original = getattr(transformers, model_class)(config).eval()
    model = attnres_fx.attnresify(copy.deepcopy(original), preserve_scale=True)
    assert [s.kind for s in attnres_fx.sites(model)][-1] == "final" and len(attnres_fx.sites(model)) >= 3
    ids = H.hf_example_inputs("llama", 2, 9)[0][0]
    with torch.no_grad():
        assert H.relative_error(model(ids).logits, original(ids).logits) < EXACT
    want = original.generate(ids[:1], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1], max_new_tokens=3, do_sample=False, pad_token_id=0), want)
