"""An onnxruntime-genai model folder for a Hugging Face decoder-only language model: what
``onnxruntime_genai.Model(folder)`` loads and generates with natively (search, sampling, the KV cache,
batches).

    from attnres_fx import export
    folder = export.to_genai(model, "served", tokenizer=tokenizer)   # model.onnx, genai_config.json, tokenizer

Two ways to the graph; ``written_by.json`` in the folder records which one wrote it:

- ``graph="builder"`` (the default where it applies: Llama, Qwen2, Qwen3, Phi-3, Gemma, Granite, SmolLM3,
  Mistral and Gemma 2 without a binding sliding window; fp32 and int4 on the CPU, fp32, fp16 and int4 on
  CUDA): onnxruntime-genai's own model builder writes the stock graph from the model's base weights, and
  :mod:`attnres_fx.export.builder_stream` rewrites its residual stream into the converted model's Block AttnRes
  (:mod:`attnres_fx.export.genai_builder`). The folder is then the builder's (its config, its
  preallocated cache), and serves at nearly the stock model's speed.
- ``graph="torch.onnx"`` (every other decoder LM, and fp16 on the CPU): the graph exported from the model
  itself (its explicit graph when converted, in the two-phase schedule), in the builder's layout:

- inputs ``input_ids`` ``[batch, sequence]`` and ``attention_mask`` ``[batch, past + sequence]`` (int64),
  ``past_key_values.%d.key`` / ``.value`` ``[batch, kv_heads, past, head_size]``; outputs ``logits``
  ``[batch, sequence, vocab]`` and ``present.%d.key`` / ``.value``, the past with this step's keys and
  values appended. The builder's graphs write into a buffer preallocated to the maximum length
  (``past_present_share_buffer``); this graph concatenates, so the config turns that option off.
- onnxruntime-genai right-pads a batch of prompts of different lengths and appends later tokens after the
  pad slots, which its mask marks: the graph takes each token's position, and its attention masks, from
  the mask (:mod:`attnres_fx.export.position_masks`), so a padded row generates what it would alone.
- Sliding-window attention (Mistral, Gemma 2 and 3) is applied by those masks over a cache that keeps
  every position, so the config declares no sliding window (which would make onnxruntime-genai drop
  positions from the cache).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnres_fx import atomic, compat
from attnres_fx.api import explicit_graph
from attnres_fx.conversion import is_converted
from attnres_fx.errors import ExportError, ServingLayoutError

from .decoding import EXAMPLE_PAST
from .failures import reraise_as_export_error
from .onnx import write_onnx
from .position_masks import position_masks, positions_of

CONFIG_NAME = "genai_config.json"
MODEL_NAME = "model.onnx"
WRITTEN_BY_NAME = "written_by.json"
PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "int4": None}
GRAPHS = ("auto", "builder", "torch.onnx")
# execution provider -> its entry in the config's provider_options (the CPU needs none).
PROVIDERS = {"cpu": None, "cuda": {"cuda": {}}}
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
# Config fields that only state-space (Mamba-style) layers have: their cache is a fixed-size state.
STATE_SPACE_FIELDS = ("state_size", "ssm_state_size", "mamba_d_state")
INPUT_NAMES = {"input_ids": "input_ids", "attention_mask": "attention_mask",
               "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
OUTPUT_NAMES = {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
EXAMPLE_BATCH = 2       # > 1 and a sequence > 1, so that torch.export keeps both dimensions dynamic
EXAMPLE_SEQUENCE = 3


@dataclass(frozen=True)
class DecoderShape:
    """What the config declares about the graph, read from the model's text config."""

    layers: int
    heads: int
    kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    context_length: int


class ServedDecoder(nn.Module):
    """``model`` with the inputs and outputs onnxruntime-genai feeds and reads: what the graph computes.

    Positions and masks come from ``attention_mask`` (:mod:`attnres_fx.export.position_masks`), which
    describes onnxruntime-genai's cache, pad slots included. The cache passed in is a plain
    ``DynamicCache`` (every layer keeps every position), so ``present`` is always ``past`` with this
    step appended, whatever sliding windows the model's config declares.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: list[torch.Tensor]):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)])
        length = input_ids.shape[1]
        masks = position_masks(self.model, attention_mask, length, past[0].dtype)
        positions = positions_of(attention_mask)[:, -length:]
        out = self.model(input_ids=input_ids, attention_mask=masks, position_ids=positions,
                         **{compat.cache_argument(self.model.forward): cache}, use_cache=True, return_dict=True)
        present = [tensor for layer in compat.output_cache(out).layers for tensor in (layer.keys, layer.values)]
        return (out.logits, *present)


def to_genai(model: nn.Module, out_dir: str | Path, *, tokenizer: Any = None, precision: str = "fp32",
             execution_provider: str = "cpu", context_length: int | None = None, chunk_size: int | None = None,
             opset: int | None = None, two_phase: bool = True, graph: str = "auto") -> Path:
    """Write the onnxruntime-genai model folder of ``model`` to ``out_dir``; return ``out_dir``.

    Args:
        model: a Hugging Face decoder-only language model (``...ForCausalLM``), converted by ``attnresify``
            (exported through its explicit graph with its current weights) or not (the same export of
            an original, to compare with). Left unchanged.
        out_dir: the folder; created if needed. Written beside it and swapped in whole: a failure, an
            interrupt or a full disk leaves it as it was; files of an earlier folder that this export does
            not write (other than the model's) are kept.
        tokenizer: a Hugging Face tokenizer (``save_pretrained`` writes ``tokenizer.json`` and
            ``tokenizer_config.json``, which ``onnxruntime_genai.Tokenizer`` reads); also a source of
            the special token ids the model's configs lack.
        precision: ``"fp32"``, ``"fp16"`` (weights, cache and logits) or ``"int4"`` (the builder's
            ``MatMulNBits`` weights; builder graph only). AttnRes softmax and sums stay in fp32.
        execution_provider: ``"cpu"`` or ``"cuda"`` (the ``onnxruntime-genai-cuda`` package), recorded
            in the config's session options.
        context_length: the longest sequence, prompt and generated tokens (default: the model's
            ``max_position_embeddings``); also the default ``max_length`` of the search.
        chunk_size: process a batch-1 prompt longer than this in chunks of this many tokens (the search's
            ``chunk_size``; default: the whole prompt at once).
        opset, two_phase: as for :func:`attnres_fx.export.to_onnx` (the torch.onnx graph).
        graph: ``"builder"``, ``"torch.onnx"`` (see the module's docstring) or ``"auto"``: the builder's
            where it takes the architecture and precision, else torch.onnx.

    Raises :class:`attnres_fx.ServingLayoutError` before writing anything for a model the folder cannot
    describe (an encoder-decoder, a state-space or linear-attention cache), and
    :class:`attnres_fx.ExportError` if the export or a write fails (the disk full included), or the
    builder graph's residual stream is not the converted model's plan (:class:`attnres_fx.StreamMismatchError`),
    and
    :class:`attnres_fx.WriteError` if moving the folder in does (nothing is changed then either).
    """
    dtype = _option(precision, PRECISIONS, "precision")
    _option(execution_provider, PROVIDERS, "execution_provider")
    _option(graph, dict.fromkeys(GRAPHS), "graph")
    for name, value in (("context_length", context_length), ("chunk_size", chunk_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    shape = decoder_shape(model, context_length)
    chosen = choose_graph(model, graph, precision, execution_provider, shape.context_length)
    config = genai_config(model, shape, tokenizer=tokenizer, execution_provider=execution_provider,
                          chunk_size=chunk_size)
    out_dir = Path(out_dir)
    written = {"graph": chosen, "precision": precision, "execution_provider": execution_provider}
    # Everything is written into a folder beside out_dir and swapped in once complete (the old folder
    # renamed aside, the new one in): a failure leaves out_dir as it was.
    drop = (MODEL_NAME, f"{MODEL_NAME}.data", CONFIG_NAME, WRITTEN_BY_NAME)
    with atomic.replaced_folder(out_dir, drop=lambda name: name in drop) as staging:
        if chosen == "builder":
            from .genai_builder import write_builder_folder

            written["attnres_sites"] = write_builder_folder(model, staging, precision, execution_provider, tokenizer,
                                                             context_length=shape.context_length)
            config = builder_config(json.loads((staging / CONFIG_NAME).read_text()), config, context_length)
        else:
            export_decoder(model, shape, dtype, staging / MODEL_NAME, opset=opset, two_phase=two_phase,
                           target=out_dir / MODEL_NAME)
        with reraise_as_export_error(f"writing {out_dir / CONFIG_NAME}"):
            (staging / CONFIG_NAME).write_text(json.dumps(config, indent=4) + "\n")
            (staging / WRITTEN_BY_NAME).write_text(json.dumps(written, indent=4) + "\n")
        if tokenizer is not None:
            _save_tokenizer(tokenizer, shape.context_length, staging)
    return out_dir


def choose_graph(model: nn.Module, graph: str, precision: str, execution_provider: str, context_length: int) -> str:
    """``"builder"`` or ``"torch.onnx"``: ``graph`` itself, or for ``"auto"`` the builder's where it takes
    the model; ValueError naming why where the asked-for graph cannot be written."""
    from .genai_builder import builder_takes

    why_not = builder_takes(model, precision, execution_provider, context_length)
    if graph == "builder" and why_not is not None:
        raise ValueError(f"graph='builder': {why_not}")
    if graph == "auto":
        graph = "builder" if why_not is None else "torch.onnx"
    if graph == "torch.onnx" and precision == "int4":
        raise ValueError("precision='int4' needs the model builder's graph (MatMulNBits), which this model does not "
                         f"take: {why_not or 'graph=torch.onnx was asked for'}. Use fp32 or fp16")
    return graph


def builder_config(built: dict, ours: dict, context_length: int | None) -> dict:
    """The builder's config (its model type and preallocated cache) with the special tokens, the search
    defaults, the chunk size and the context length ``to_genai`` was given."""
    model = {**built["model"], **{key: ours["model"][key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                                  if key in ours["model"]}}
    search = {**ours["search"], "past_present_share_buffer": built["search"].get("past_present_share_buffer", True)}
    if context_length is not None:
        if context_length > model["context_length"]:
            raise ValueError(f"context_length={context_length} exceeds the {model['context_length']} positions the "
                             "builder's graph holds rotary tables for (the config's max_position_embeddings)")
        model["context_length"] = context_length
    search["max_length"] = model["context_length"]
    return {**built, "model": model, "search": search}


def decoder_shape(model: nn.Module, context_length: int | None = None) -> DecoderShape:
    """The shape of ``model``'s decoder and cache; :class:`ServingLayoutError` where onnxruntime-genai's
    decoder-only folder cannot describe it."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ServingLayoutError(f"{name} is not a Hugging Face model (no config): to_genai writes the folder of "
                                 "a transformers decoder-only language model (a ...ForCausalLM)")
    if getattr(config, "is_encoder_decoder", False):
        raise ServingLayoutError(
            f"{name} is an encoder-decoder: onnxruntime-genai's decoder-only folder holds one decoder graph fed "
            "its own tokens, with no encoder graph nor cross-attention cache. Export the decoder-only "
            "language models (...ForCausalLM); to_onnx exports any model as one graph")
    text = config.get_text_config()
    other_layers = sorted(set(getattr(text, "layer_types", None) or ()) - ATTENTION_LAYERS)
    state_fields = [field for field in STATE_SPACE_FIELDS if getattr(text, field, None) is not None]
    if other_layers or state_fields:
        what = f"layers of kind {', '.join(other_layers)}" if other_layers else \
            f"state-space layers (config.{state_fields[0]})"
        raise ServingLayoutError(
            f"{name} has {what}: their cache is a fixed-size state (convolution or recurrent), not keys and "
            "values that grow with the sequence, which is the only cache this folder's graph declares. "
            "to_onnx exports the model as one graph without a cache")
    if compat.cache_argument(model.forward) is None:
        raise ServingLayoutError(f"{name}.forward takes no cache: it cannot be given the attention key/value cache "
                                 "this folder's graph declares")
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(output, nn.Linear) or not model.can_generate():
        raise ServingLayoutError(f"{name} does not generate text (no language-model head): export its ...ForCausalLM")
    heads = text.num_attention_heads
    context = context_length or getattr(text, "max_position_embeddings", None)
    if context is None:
        raise ValueError(f"{name}'s config has no max_position_embeddings: pass context_length")
    return DecoderShape(layers=text.num_hidden_layers, heads=heads,
                        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                        head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
                        hidden_size=text.hidden_size, vocab_size=output.out_features, context_length=context)


def export_decoder(model: nn.Module, shape: DecoderShape, dtype: torch.dtype, path: Path, *,
                   opset: int | None = None, two_phase: bool = True, target: Path | None = None) -> Path:
    """``model``'s decoder graph with the cache, in ``dtype`` and eval mode, at ``path`` (its explicit graph
    when it is converted), checked to return a cache of the declared shape. ``model`` is left as it was."""
    if next(model.parameters()).dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    training = model.training
    try:
        wrapper = ServedDecoder(model).eval()
        args, dynamic_shapes = example_call(shape, dtype, next(model.parameters()).device)
        if is_converted(model):
            with reraise_as_export_error("capturing the decoder with its cache"):
                wrapper = explicit_graph(wrapper, model, "model", args, None, "export", dynamic_shapes)
        with reraise_as_export_error("running the decoder on the example inputs"), torch.no_grad():
            outputs = wrapper(*args)
        _check_cache(type(model).__name__, shape, outputs)
        input_names = ["input_ids", "attention_mask", *cache_names("past_key_values", shape.layers)]
        output_names = ["logits", *cache_names("present", shape.layers)]
        # Weights in model.onnx.data beside the graph, as the builder writes them: onnxruntime then reads
        # them without holding a second copy in the graph's protobuf while it loads.
        return write_onnx(wrapper, args, {}, dynamic_shapes, input_names, output_names, path, opset=opset,
                          external_data=True, two_phase=two_phase, target=target)
    finally:
        model.train(training)


def cache_names(prefix: str, layers: int) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def example_call(shape: DecoderShape, dtype: torch.dtype, device: torch.device) -> tuple[tuple, dict]:
    """Example inputs for the trace (a past of :data:`EXAMPLE_PAST` positions) and their dynamic axes."""
    total = EXAMPLE_PAST + EXAMPLE_SEQUENCE
    ids = torch.arange(EXAMPLE_BATCH * EXAMPLE_SEQUENCE, device=device).reshape(EXAMPLE_BATCH, EXAMPLE_SEQUENCE)
    ids = ids % shape.vocab_size
    mask = torch.ones(EXAMPLE_BATCH, total, dtype=torch.long, device=device)
    past = [torch.zeros(EXAMPLE_BATCH, shape.kv_heads, EXAMPLE_PAST, shape.head_size, dtype=dtype, device=device)
            for _ in range(2 * shape.layers)]
    auto = torch.export.Dim.AUTO
    dynamic = {"input_ids": {0: auto, 1: auto}, "attention_mask": {0: auto, 1: auto},
               "past": [{0: auto, 2: auto} for _ in past]}
    return (ids, mask, past), dynamic


def _check_cache(name: str, shape: DecoderShape, outputs: tuple) -> None:
    """The cache the model returned is what the config declares: one key and one value per layer, the
    past with the new positions appended (a model whose own cache class replaced ours returns another)."""
    expected = (EXAMPLE_BATCH, shape.kv_heads, EXAMPLE_PAST + EXAMPLE_SEQUENCE, shape.head_size)
    present = outputs[1:]
    shapes = sorted({tuple(t.shape) for t in present})
    if len(present) != 2 * shape.layers or shapes != [expected]:
        raise ServingLayoutError(
            f"{name} returned a cache of {len(present)} tensors shaped {shapes}, not the key and value of each of "
            f"its {shape.layers} layers shaped {list(expected)} (batch, key/value heads, past + new positions, "
            "head size) that the folder declares: its cache is not a plain attention key/value cache")


def genai_config(model: nn.Module, shape: DecoderShape, *, tokenizer: Any = None, execution_provider: str = "cpu",
                 chunk_size: int | None = None) -> dict:
    """The contents of ``genai_config.json``: the graph's names and shape, the special tokens, the
    session's execution provider and the default search (from the model's generation config)."""
    bos, eos, pad = special_tokens(model, tokenizer)
    provider = PROVIDERS[execution_provider]
    model_section = {
        "type": "decoder",      # onnxruntime-genai's generic decoder-only model: no family-specific handling
        "context_length": shape.context_length,
        "vocab_size": shape.vocab_size,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "decoder": {
            "filename": MODEL_NAME,
            "session_options": {"log_id": "onnxruntime-genai", "provider_options": [provider] if provider else []},
            "head_size": shape.head_size,
            "hidden_size": shape.hidden_size,
            "num_attention_heads": shape.heads,
            "num_hidden_layers": shape.layers,
            "num_key_value_heads": shape.kv_heads,
            "inputs": dict(INPUT_NAMES),
            "outputs": dict(OUTPUT_NAMES),
        },
    }
    if bos is None:
        del model_section["bos_token_id"]
    search = _search(getattr(model, "generation_config", None), shape.context_length)
    if chunk_size is not None:
        search["chunk_size"] = chunk_size
    return {"model": model_section, "search": search}


def special_tokens(model: nn.Module, tokenizer: Any = None) -> tuple[int | None, int | list[int], int]:
    """``(bos, eos, pad)``: each from the generation config, else the model config, else the tokenizer.
    EOS is required; without a pad token the (first) EOS pads, as onnxruntime-genai's builder does."""
    sources = [getattr(model, "generation_config", None), model.config.get_text_config(), tokenizer]

    def first(field: str):
        return next((value for source in sources if (value := getattr(source, field, None)) is not None), None)

    eos = first("eos_token_id")
    if eos is None:
        raise ExportError(f"{type(model).__name__} names no eos_token_id (generation config, config or tokenizer): "
                          "set model.generation_config.eos_token_id, or pass the tokenizer")
    eos = eos[0] if isinstance(eos, (list, tuple)) and len(eos) == 1 else eos
    pad = first("pad_token_id")
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    return first("bos_token_id"), list(eos) if isinstance(eos, (list, tuple)) else eos, pad


def _search(generation: Any, context_length: int) -> dict:
    """The default search: the model's generation config where it sets a field, Hugging Face's defaults
    otherwise; past and present are separate tensors (see the module's docstring)."""
    def value(field: str, default):
        found = getattr(generation, field, None)
        return default if found is None else found

    return {"do_sample": value("do_sample", False), "num_beams": value("num_beams", 1),
            "num_return_sequences": value("num_return_sequences", 1), "temperature": value("temperature", 1.0),
            "top_k": value("top_k", 50), "top_p": value("top_p", 1.0),
            "repetition_penalty": value("repetition_penalty", 1.0), "length_penalty": value("length_penalty", 1.0),
            "no_repeat_ngram_size": value("no_repeat_ngram_size", 0),
            "diversity_penalty": value("diversity_penalty", 0.0),
            "early_stopping": True, "min_length": 0, "max_length": context_length, "past_present_share_buffer": False}


def _save_tokenizer(tokenizer: Any, context_length: int, directory: Path) -> None:
    if not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer (save_pretrained), got {type(tokenizer).__name__}")
    tokenizer = copy.copy(tokenizer)
    # Hugging Face writes "no limit" as 1e30, which onnxruntime-genai cannot read as an integer.
    tokenizer.model_max_length = context_length
    with reraise_as_export_error("saving the tokenizer"):
        tokenizer.save_pretrained(directory)


def _option(value: str, allowed: dict, name: str):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return allowed[value]
