"""Greedy generation with an onnxruntime-genai model folder (``export.to_genai``'s, or its model builder's):
what the CLI and the benchmark run, the way an application calls onnxruntime-genai.

    tokens = export.generate_genai("served", [[5, 6, 7], [8, 9]], max_new_tokens=20)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load_genai(folder: str | Path):
    """``onnxruntime_genai.Model(folder)``; the package is the ``genai`` extra."""
    try:
        import onnxruntime_genai as og
    except ImportError as err:
        raise ImportError("serving a model folder needs onnxruntime-genai: pip install 'attnres-fx[genai]' "
                          "(onnxruntime-genai-cuda on a GPU)") from err
    return og.Model(str(folder))


def generate_genai(folder: str | Path, prompts: list[list[int]], max_new_tokens: int, *, model=None,
                   chunk_size: int | None = None) -> list[list[int]]:
    """The new tokens of each prompt, greedily, up to and including its first EOS: one batch, prompts of
    any lengths, right-padded with the folder's pad token as onnxruntime-genai pads (so no prompt may end
    with it). ``model``: the folder's ``onnxruntime_genai.Model`` when loaded already; ``chunk_size``:
    process a single prompt in chunks of that many tokens."""
    import onnxruntime_genai as og

    config = json.loads((Path(folder) / "genai_config.json").read_text())["model"]
    model = model or load_genai(folder)
    longest = max(len(prompt) for prompt in prompts)
    padded = np.full((len(prompts), longest), config["pad_token_id"], dtype=np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, :len(prompt)] = prompt
    params = og.GeneratorParams(model)
    options = {"do_sample": False, "max_length": longest + max_new_tokens, "batch_size": len(prompts)}
    if chunk_size is not None:
        options["chunk_size"] = chunk_size
    params.set_search_options(**options)
    generator = og.Generator(model, params)
    generator.append_tokens(padded)
    while not generator.is_done():
        generator.generate_next_token()
    eos = set(np.atleast_1d(config["eos_token_id"]).tolist())
    return [until_eos(generator.get_sequence(row)[longest:].tolist(), eos) for row in range(len(prompts))]


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token."""
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[:index + 1]
    return tokens
