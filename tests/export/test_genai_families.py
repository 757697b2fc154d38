"""Each family onnxruntime-genai serves, converted with random pseudo-queries and written by
``export.to_genai``, generates in onnxruntime-genai the tokens ``model.generate(do_sample=False)`` does:
one batch of prompts of different lengths (right-padded by onnxruntime-genai, left-padded by Hugging
Face), sliding windows shorter than the sequences where the family has them. Llama is checked, more
closely, in test_genai.py."""

import pytest
import torch

import attnres_fx
from attnres_fx import export
from attnres_fx.testing import randomise_pseudo_queries
from attnres_fx.testing.serving import VOCAB, greedy_reference, serving_model
from genai_support import needs_genai
from hf_models import needs_hf

# One served folder per family, each an export and an onnxruntime-genai session of its own: integration
# (make test keeps Llama's in tests/export/test_genai.py).
pytestmark = [pytest.mark.integration, needs_hf, needs_genai]

NEW_TOKENS = 12


def prompts(seed: int) -> list[list[int]]:
    """Three prompts of 12, 3 and 7 ids, none of them special (pad, bos, eos are 0, 1, 2)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for length in (12, 3, 7)]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "phi3", "gemma", "granite", "smollm3", "gemma3"])
def test_served_folder_generates_what_generate_does(family, tmp_path):
    model = serving_model(family)
    attnres_fx.attnresify(model, (torch.tensor(prompts(0)[:1] * 2),), block_size=2)
    randomise_pseudo_queries(model)
    folder = export.to_genai(model, tmp_path / family)
    batch = prompts(1)
    expected = greedy_reference(model, batch, NEW_TOKENS)
    assert max(map(len, expected)) == NEW_TOKENS, "the reference should not stop at once"
    assert export.generate_genai(folder, batch, NEW_TOKENS) == expected
