"""``generate`` with the default KV cache on converted Hugging Face models.

AttnRes is per token (depth attention never mixes positions), so the cache stays exact: past keys and
values were computed from the AttnRes inputs of their own positions.

- (a) zero init with ``preserve_scale=True``: the same tokens as the original model, 20 new tokens,
  greedy and sampling, a batch of 2 with left padding;
- (b) random pseudo-queries: ``generate`` with the cache gives the same tokens and the same per-step
  logits as a greedy loop that re-runs the whole sequence without a cache. This is what catches a stream
  whose start is skipped (an encoder run outside the routing) or a decode graph rewritten differently
  from the prefill graph.
"""

from __future__ import annotations

import copy

import pytest
import torch

import attnres_fx
import hf_models as H
from attnres_fx.testing import randomise_pseudo_queries
from hf_models import needs_hf

NEW_TOKENS = 20
LOOP_TOKENS = 8
# The per-step logits of generate (cache) and of the loop (no cache) are fp32 computations of the same
# function in different orders (attention over a cache vs the full sequence): round-off, ~1e-6 seen.
LOGITS_ATOL = 1e-4
GENERATE_NAMES = [pytest.param(name, marks=[needs_hf, pytest.mark.slow]) for name in (*H.DECODER_LM_NAMES, "t5")]


@pytest.fixture(scope="module")
def models():
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            original = H.build_hf(name, use_cache=True)
            converted = attnres_fx.attnresify(copy.deepcopy(original), preserve_scale=True)
            cache[name] = original, converted
        return cache[name]
    return get


def _prompt(name: str, batch: int, seq: int, padded: bool):
    ids = H.hf_example_inputs(name, batch, seq)[0][0]
    mask = torch.ones_like(ids)
    if padded:          # left padding: the first sequence is shorter
        ids[0, :2] = 0
        mask[0, :2] = 0
    return ids, mask


def _generate(model, ids, mask, new_tokens=NEW_TOKENS, **options):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          pad_token_id=0, **options)


@pytest.mark.parametrize("name", GENERATE_NAMES)
def test_generate_with_the_cache(models, name):
    """(a), then (b) on the same converted model (its graphs are reused: only the weights change)."""
    original, converted = models(name)
    padded = H.hf_model(name).task == "causal_lm"       # T5's encoder masks padding the same way
    ids, mask = _prompt(name, 2, 7, padded)
    assert torch.equal(_generate(converted, ids, mask, do_sample=False),
                       _generate(original, ids, mask, do_sample=False)), "greedy"
    sampled = []
    for model in (converted, original):
        torch.manual_seed(7)
        sampled.append(_generate(model, ids, mask, do_sample=True, top_k=20))
    assert torch.equal(*sampled), "sampling"

    randomise_pseudo_queries(converted, seed=4, std=0.5)
    ids, mask = _prompt(name, 2, 6, padded=False)
    out = converted.generate(ids, attention_mask=mask, max_new_tokens=LOOP_TOKENS, min_new_tokens=LOOP_TOKENS,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens, steps = _greedy_without_cache(converted, ids, name)
    assert torch.equal(out.sequences, tokens)
    for step, (cached, full) in enumerate(zip(out.logits, steps)):
        torch.testing.assert_close(cached, full, rtol=0, atol=LOGITS_ATOL, msg=f"step {step}")
    assert not torch.equal(_generate(original, ids, mask, LOOP_TOKENS, do_sample=False), out.sequences), \
        "the random pseudo-queries must change what is generated"


def _greedy_without_cache(model, prompt, name):
    """Greedy decoding that re-runs the whole sequence at every step, no cache: the reference."""
    seq2seq = H.hf_model(name).task == "seq2seq_lm"
    tokens = torch.full((prompt.shape[0], 1), model.config.decoder_start_token_id) if seq2seq else prompt
    steps = []
    with torch.no_grad():
        for _ in range(LOOP_TOKENS):
            if seq2seq:
                logits = model(input_ids=prompt, decoder_input_ids=tokens, use_cache=False).logits[:, -1]
            else:
                logits = model(tokens, use_cache=False).logits[:, -1]
            steps.append(logits)
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens, steps


@needs_hf
@pytest.mark.slow
def test_decoding_reuses_its_graphs(models):
    """Per-step Python work stays out of decoding: after the first generate, a second one with another
    prompt length captures nothing new."""
    from torch._dynamo.utils import counters

    _, converted = models("llama")
    ids, mask = _prompt("llama", 2, 7, padded=False)
    _generate(converted, ids, mask, do_sample=False)
    counters.clear()
    ids, mask = _prompt("llama", 2, 11, padded=False)
    _generate(converted, ids, mask, do_sample=False)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
