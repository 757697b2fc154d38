"""More Hugging Face families than :mod:`attnres_fx.models` builds, each in the shape that sets it apart: tiny
causal LMs from their config classes, converted in place and used as a user would.

Per family: the sites found (one per branch output the stream adds, attention and MLP, and the stream's
final one; two residual positions a layer where the branches are added in turn, one where they are added
together), exactness with ``preserve_scale=True`` (the same bound as test_hf_models: fp32
round-off of the reassociated sums, below 1e-6 relative over these models), greedy generation with the KV
cache equal to generation without it under random pseudo-queries, and a training step that gives every AttnRes
parameter a gradient (non-zero wherever its site has more than one source to weigh). A family whose classes the
installed transformers lacks is skipped, naming them.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import attnres_fx
from attnres_fx.checks import relative_error
from attnres_fx.testing import randomise_pseudo_queries
from hf_models import needs_hf

EXACT = 1e-5
LAYERS = 4
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, vocab_size=256)


class Family(NamedTuple):
    config_class: str
    model_class: str
    fields: dict                # config fields beside SIZES
    positions_per_layer: int    # residual positions a layer: 2 where the branches are added in turn, 1 together


FAMILIES = {
    # sliding-window and global layers, norms before and after each sublayer, embeddings scaled by sqrt(hidden)
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM",
                     dict(num_key_value_heads=2, head_dim=16, sliding_window=8), 2),
    # norms after each sublayer, none before
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2), 2),
    # attention and MLP on one norm, added together
    "cohere": Family("CohereConfig", "CohereForCausalLM", dict(num_key_value_heads=2), 1),
    "falcon": Family("FalconConfig", "FalconForCausalLM", dict(new_decoder_architecture=True, num_kv_heads=2), 1),
    # branch outputs scaled before the residual add
    "granite": Family("GraniteConfig", "GraniteForCausalLM", dict(num_key_value_heads=2, residual_multiplier=0.5), 2),
    # experts routed per token
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM",
                      dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), 2),
    # latent attention; a dense first layer, then experts
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM",
                          dict(num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=32,
                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1), 2),
    # LayerNorm with biases, learned positions
    "opt": Family("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=64), 2),
}


def build(name: str):
    import transformers

    family = FAMILIES[name]
    missing = [c for c in (family.config_class, family.model_class) if not hasattr(transformers, c)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {', '.join(missing)}")
    torch.manual_seed(0)
    config = getattr(transformers, family.config_class)(**{**SIZES, **family.fields})
    return getattr(transformers, family.model_class)(config).eval()


@needs_hf
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_converts_exactly_and_decodes_and_trains(name):
    model = build(name)
    ids = torch.randint(1, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        original = model(ids).logits

    assert attnres_fx.attnresify(model, num_blocks=2, preserve_scale=True) is model
    found = attnres_fx.sites(model)
    assert [site.kind for site in found].count("final") == 1 and len(found) == 2 * LAYERS + 1
    assert len({site.position for site in found if site.kind != "final"}) == FAMILIES[name].positions_per_layer * LAYERS
    with torch.no_grad():
        assert relative_error(model(ids).logits, original) < EXACT

    randomise_pseudo_queries(model, std=0.5)
    with torch.no_grad():
        assert relative_error(model(ids).logits, original) > 1e-3     # the pseudo-queries take part
        cached = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
        uncached = model.generate(ids[:1], max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)

    model.train()
    model(ids, labels=ids).loss.backward()
    for site in found:
        parameters = list(model.get_submodule(site.name).parameters())
        assert parameters and all(parameter.grad is not None for parameter in parameters), site.name
        # A site of the first layer weighs the embeddings alone (a softmax over one source): its
        # pseudo-query has no effect there, and a zero gradient.
        if site.num_sources > 1:
            assert all(parameter.grad.abs().sum() > 0 for parameter in parameters), site.name
