"""Converted models on the paths users take beyond the plain call: an exception inside a sublayer, the
meta device, accelerate's hooks added after conversion, a model whose own forward TorchDynamo cannot
capture, caches the conversion's call does not use, expert loops that depend on the data.

Numerical: with ``preserve_scale=True`` at zero init a converted model computes the original function;
here exactly (0.0: the same ops, sums in the same order) unless said otherwise, and with random
pseudo-queries the same as before the unusual step. Failure: the user's own exception comes out as
itself, once; a library setup the route cannot run raises an error that names the way out.
"""

import copy

import pytest
import torch

import attnres_fx
from attnres_fx.models import TinyTransformer, example_ids
from attnres_fx.testing import randomise_pseudo_queries

transformers = pytest.importorskip("transformers")

# Where each site runs with the layer norm that reads it as one operator (Falcon, GPT-Neo, DBRX): the norm's
# mean and variance summed in another order than ATen's layer_norm, 1e-7 on these logits.
FUSED_NORMS = dict(rtol=1e-5, atol=1e-6)


def llama(layers=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(config).eval()


def ids(batch=2, length=8):
    return torch.randint(1, 100, (batch, length), generator=torch.Generator().manual_seed(3))


class Flaky:
    """A sublayer's forward that raises the first time it is called, then runs as before."""

    def __init__(self, forward):
        self.forward, self.calls = forward, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise ValueError("the sublayer's own failure")
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("route", ["layer", "model"])
def test_an_exception_inside_a_sublayer_propagates_as_itself_once(route):
    model = randomise_pseudo_queries(attnres_fx.attnresify(llama(), route=route))
    x = ids()
    want = model(x).logits
    mlp = model.model.layers[1].mlp
    mlp.forward = Flaky(mlp.forward)
    with pytest.raises(ValueError, match="the sublayer's own failure"):
        model(x)
    torch.testing.assert_close(model(x).logits, want, rtol=0, atol=0)


def test_a_hook_that_raises_once_propagates_as_itself_and_the_next_call_works():
    model = randomise_pseudo_queries(attnres_fx.attnresify(llama()))
    x = ids()
    want = model(x).logits
    raised = []

    def hook(module, args, output):
        if not raised:
            raised.append(True)
            raise KeyError("the hook's own failure")
    model.model.layers[0].self_attn.register_forward_hook(hook)
    with pytest.raises(KeyError, match="the hook's own failure"):
        model(x)
    torch.testing.assert_close(model(x).logits, want, rtol=0, atol=0)


def test_a_converted_model_runs_on_the_meta_device():
    model = attnres_fx.attnresify(llama()).to("meta")
    out = model(ids().to("meta")).logits
    assert out.device.type == "meta" and out.shape == (2, 8, 128)


def test_accelerate_offloading_after_conversion_runs_exactly_or_names_the_option():
    accelerate = pytest.importorskip("accelerate")
    model = randomise_pseudo_queries(attnres_fx.attnresify(llama()))
    x = ids()
    with torch.no_grad():
        # accelerate's hooks on the norms keep them from fusing with their sites (passes/fuse_norms.py): the
        # reference is the model's call where nothing fuses (a global forward hook, which fused calls decline).
        with torch.nn.modules.module.register_module_forward_hook(lambda *args: None):
            want = model(x).logits
        offloaded = copy.deepcopy(model)
        accelerate.cpu_offload(offloaded, preload_module_classes=["BlockAttnRes"])
        torch.testing.assert_close(offloaded(x).logits, want, rtol=0, atol=0)
        plain = copy.deepcopy(model)
        accelerate.cpu_offload(plain)
        with pytest.raises(RuntimeError, match=r"preload_module_classes=\['BlockAttnRes'\]"):
            plain(x)


class BreakingRoot(TinyTransformer):
    """A model whose own forward TorchDynamo cannot capture as one graph: a value read into Python."""

    def forward(self, ids):
        if int(ids.max()) >= 10**9:
            print("out of range")
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_a_graph_break_outside_every_block_converts_on_the_layer_route():
    torch.manual_seed(0)
    original = BreakingRoot(dim=32, num_layers=3, num_heads=4).eval()
    x = example_ids(original.config)
    model = attnres_fx.attnresify(copy.deepcopy(original), (x,), preserve_scale=True)
    assert attnres_fx.plan_of(model).routes == ("layer",)
    torch.testing.assert_close(model(x), original(x), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["falcon", "gpt_neo"])
def test_models_converted_with_example_inputs_while_their_config_caches(name):
    """Falcon (parallel attention, multi-query) and GPT-Neo (local attention) with ``use_cache`` on in
    their config: the conversion's call runs without a cache; generate with one gives the same tokens."""
    torch.manual_seed(0)
    if name == "falcon":
        config = transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=128,
                                           alibi=False, new_decoder_architecture=False, parallel_attn=True,
                                           multi_query=True)
        original = transformers.FalconForCausalLM(config).eval()
    else:
        config = transformers.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=2, vocab_size=128,
                                           attention_types=[[["global", "local"], 1]], window_size=4,
                                           max_position_embeddings=64)
        original = transformers.GPTNeoForCausalLM(config).eval()
    assert original.config.use_cache
    x = ids()
    model = attnres_fx.attnresify(copy.deepcopy(original), (x,), preserve_scale=True)
    torch.testing.assert_close(model(x).logits, original(x).logits, **FUSED_NORMS)
    kwargs = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(x, **kwargs), original.generate(x, **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dbrx", "switch"])
def test_expert_loops_that_depend_on_the_data_run_as_sublayer_calls(name):
    """DBRX and SwitchTransformers route tokens to experts in a Python loop over the experts hit: no single
    graph holds it, but the layer route calls the MLP as a module, so they convert and run as the original."""
    torch.manual_seed(0)
    x = ids()
    if name == "dbrx":
        config = transformers.DbrxConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=128,
                                         attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                         ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2})
        original, call = transformers.DbrxForCausalLM(config).eval(), {"input_ids": x}
    else:
        config = transformers.SwitchTransformersConfig(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                                                       num_heads=2, num_experts=4, vocab_size=128,
                                                       decoder_start_token_id=0, dropout_rate=0.0)
        original = transformers.SwitchTransformersForConditionalGeneration(config).eval()
        call = {"input_ids": x, "decoder_input_ids": x}
    model = attnres_fx.attnresify(copy.deepcopy(original), preserve_scale=True)
    assert set(attnres_fx.plan_of(model).routes) == {"layer"}
    torch.testing.assert_close(model(**call).logits, original(**call).logits, **FUSED_NORMS)


@pytest.mark.slow
def test_a_layerdrop_in_a_blocks_own_code_is_refused_in_training_never_frozen():
    """HuBERT's encoder adds its positional convolution (a site) and draws, in training, whether each layer
    runs. Failure: with LayerDrop on, a training call raises TraceError (a trace would have frozen the draw
    made while tracing: outputs silently not the original's); numerical: with ``layerdrop=0`` it trains
    as the original, exactly (dropout off: it acts on the stream, which AttnRes holds as block sums)."""
    torch.manual_seed(0)
    config = transformers.HubertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       do_stable_layer_norm=True, feat_extract_norm="layer", conv_dim=(16, 16),
                                       conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
                                       num_conv_pos_embedding_groups=2, layerdrop=0.5, mask_time_prob=0.0,
                                       hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    original = transformers.HubertModel(config).eval()
    model = attnres_fx.attnresify(copy.deepcopy(original), preserve_scale=True).train()
    audio = torch.randn(2, 1600, generator=torch.Generator().manual_seed(0))
    with pytest.raises(attnres_fx.TraceError, match="Data-dependent branching"):
        model(audio)
    for module in (original, model):
        module.config.layerdrop = 0.0
    original.train()
    for seed in (0, 1):
        torch.manual_seed(seed)
        want = original(audio).last_hidden_state
        torch.manual_seed(seed)
        torch.testing.assert_close(model(audio).last_hidden_state, want, rtol=0, atol=0)


@pytest.mark.slow
def test_a_hybrid_of_linear_and_full_attention_generates_the_originals_tokens():
    """Kimi Linear: a linear-attention layer (its recurrent state in the cache) and a full-attention one.
    transformers' own generate needs one attention layer to count the cache's length (with none, the
    original fails the same way); with one, the converted model generates the original's tokens."""
    torch.manual_seed(0)
    config = transformers.KimiLinearConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=4, linear_head_dim=16,
                                           linear_num_heads=4, layer_types=["linear_attention", "full_attention"],
                                           num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    original = transformers.KimiLinearForCausalLM(config).eval()
    model = attnres_fx.attnresify(copy.deepcopy(original), preserve_scale=True)
    prompt = ids(length=6)
    want = original.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False), want)
