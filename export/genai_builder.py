"""onnxruntime-genai's model builder run on a model's base weights, its graph given the AttnRes
aggregations (:mod:`attnres_fx.export.builder_stream`): the folder ``export.to_genai`` writes by default
where the builder takes the architecture.

The builder has no hook for extra ops (its ``create_model`` picks a class per architecture name), so it
writes the graph of the base architecture from a Hugging Face folder of the converted model's own weights
without the AttnRes modules (a temporary one), and the pass rewrites that graph's residual stream. The
builder's cache (preallocated, shared between past and present), packed QKV, ``GroupQueryAttention`` and
``MatMulNBits`` (int4) stay as it writes them.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from attnres_fx.op.module import BlockAttnRes
from attnres_fx.compat import unwrapped
from attnres_fx.conversion import is_converted, plan_of
from attnres_fx.errors import ExportError
from attnres_fx.integrations.hf import CONFIG_ATTRIBUTE

from .builder_stream import Aggregation, rewrite
from .failures import reraise_as_export_error

# The architectures whose builder graph the pass is checked on (tests/export/test_genai_builder.py); others take
# the torch.onnx path. Mistral's and Gemma 2's builder graphs keep a sliding window in their cache, which
# onnxruntime-genai 0.18 fails on once the window slides: only a window no shorter than the context takes
# the builder, and the folder is written without it (:func:`without_window`; it never binds then). Not
# taken: Gemma 3 (0.18's builder cannot read transformers' config, a rope per layer type), OLMo (0.18's
# builder writes its weightless LayerNorm as an RMSNorm: the original's logits are 0.15 off), Phi-2
# (parallel attention and MLP, which the pass refuses).
ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
                 "GemmaForCausalLM", "Gemma2ForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM"}
# precision -> execution providers the builder writes it for (its own list of valid combinations).
PRECISIONS = {"fp32": {"cpu", "cuda"}, "fp16": {"cuda"}, "int4": {"cpu", "cuda"}}
MODEL_NAME = "model.onnx"


def builder_takes(model: nn.Module, precision: str, execution_provider: str, context_length: int) -> str | None:
    """``None`` when the builder path serves ``model`` at ``precision`` on ``execution_provider``, else why not."""
    name = type(unwrapped(model)).__name__
    if name not in ARCHITECTURES:
        return f"onnxruntime-genai's model builder path is checked on {', '.join(sorted(ARCHITECTURES))}, not {name}"
    if execution_provider not in PRECISIONS.get(precision, ()):
        return f"the model builder writes {precision} for the {', '.join(sorted(PRECISIONS[precision]))} provider"
    text = unwrapped(model).config.get_text_config()
    if getattr(text, "intermediate_size", None) == text.vocab_size:
        return (f"{name}'s intermediate_size equals its vocab_size ({text.vocab_size}): onnxruntime-genai 0.18's "
                "builder takes the first linear layer with vocab_size outputs for the head, an MLP's here")
    window = getattr(text, "sliding_window", None)
    if window is not None and window < context_length:
        return (f"{name}'s sliding window ({window}) is shorter than the context ({context_length}): the builder's "
                "windowed cache fails once the window slides in onnxruntime-genai 0.18")
    if is_converted(model) and len(plan_of(model).streams) != 1:
        return f"{name} is converted with {len(plan_of(model).streams)} residual streams; the builder's graph has one"
    return None


def write_builder_folder(model: nn.Module, folder: Path, precision: str, execution_provider: str,
                         tokenizer: Any = None, form: str = "per_site", context_length: int | None = None) -> int:
    """The builder's ``model.onnx``, ``model.onnx.data`` and ``genai_config.json`` of ``model`` in ``folder``,
    the graph rewritten into Block AttnRes when ``model`` is converted; returns the number of sites
    rewritten (0 for a model that is not converted). A graph whose stream does not match the model's plan
    raises :class:`attnres_fx.StreamMismatchError` and ``folder`` gets no model. The builder reads a
    tokenizer beside the weights (``tokenizer``, or a placeholder of one token: the folder's tokenizer
    files are written by the caller). ``form``: the rewrite's (:func:`~attnres_fx.export.builder_stream.rewrite`;
    ``export.to_genai`` writes the per-site form, whose prompt memory stays near the builder's).
    ``context_length``: the longest sequence served (default: the config's ``max_position_embeddings``);
    a sliding window shorter than it raises ValueError (the folder is written without the window)."""
    model = unwrapped(model)
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    context_length = context_length or text.max_position_embeddings
    if window is not None and window < context_length:
        raise ValueError(f"{type(model).__name__}'s sliding window ({window}) is shorter than the context "
                         f"({context_length}): the builder's folder is written without the window, which would bind")
    with tempfile.TemporaryDirectory(prefix="attnres-builder-") as tmp:
        source, built = Path(tmp) / "hf", Path(tmp) / "built"
        with reraise_as_export_error("saving the base weights for the model builder"):
            save_base_weights(model, source)
            (tokenizer if tokenizer is not None else placeholder_tokenizer()).save_pretrained(source)
        run_builder(source, built, Path(tmp) / "cache", precision, execution_provider)
        graph = onnx.load(str(built / MODEL_NAME), load_external_data=False)
        rewritten = 0
        if is_converted(model):
            graph, rewritten = rewrite(graph, plan_of(model), aggregations(model), form=form)
        config = without_window(graph, load_config(built))
        folder.mkdir(parents=True, exist_ok=True)
        with reraise_as_export_error(f"writing {folder / MODEL_NAME}"):
            onnx.save(graph, str(folder / MODEL_NAME))
            shutil.move(str(built / f"{MODEL_NAME}.data"), str(folder / f"{MODEL_NAME}.data"))
            (folder / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n")
    return rewritten


def without_window(graph: onnx.ModelProto, config: dict) -> dict:
    """``graph`` (changed in place) and ``config`` (a changed copy returned) without the sliding window the
    builder wrote for a model whose window covers its context (the only windowed models
    :func:`builder_takes` takes): every layer attends to every position then, so a full layer computes the
    same. The windowed cache the builder pairs with it needs a capacity (the search's ``max_length``) of
    at least the window, and so refused every generation shorter than the window."""
    for node in graph.graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        kept = [a for a in node.attribute if a.name != "sliding_window_cache"]
        for attribute in kept:
            if attribute.name == "local_window_size":
                attribute.i = -1
        del node.attribute[:]
        node.attribute.extend(kept)
    decoder = {key: value for key, value in config["model"]["decoder"].items() if key != "sliding_window"}
    return {**config, "model": {**config["model"], "decoder": decoder}}


def aggregations(model: nn.Module) -> list[Aggregation]:
    """Each site's pseudo-query, key norm, eps and scale option, in plan order, as fp32 arrays."""
    found = []
    for site in plan_of(model).sites:
        module = model.get_submodule(site.name)
        if not isinstance(module, BlockAttnRes):
            raise ExportError(f"{site.name} is a {type(module).__name__}, not the BlockAttnRes the plan names")
        found.append(Aggregation(site, _array(module.proj.weight), _array(module.norm.weight), module.eps,
                                 module.preserve_scale))
    return found


def _array(parameter: torch.Tensor) -> np.ndarray:
    return parameter.detach().to(device="cpu", dtype=torch.float32).numpy()


def save_base_weights(model: nn.Module, directory: Path) -> None:
    """A Hugging Face folder of ``model``'s architecture with its weights but none of the AttnRes
    modules': what the builder reads."""
    attnres = {f"{name}." for name, module in model.named_modules() if isinstance(module, BlockAttnRes)}
    weights = {key: value for key, value in model.state_dict().items()
               if not any(key.startswith(prefix) for prefix in attnres)}
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    # A model loaded from a converted checkpoint keeps the config entry that converts every model built
    # from that config (and the auto_map to its loading code): the base model has neither.
    for name in (CONFIG_ATTRIBUTE, "auto_map"):
        if hasattr(config, name):
            delattr(config, name)
    config.name_or_path = ""      # not the converted folder, which the base model's construction would check
    with torch.device("meta"):
        base = type(model)(config)
    missing, unexpected = base.load_state_dict(weights, strict=False, assign=True)
    tied = set(getattr(base, "_tied_weights_keys", None) or ())
    if unexpected or set(missing) - tied:
        raise ExportError(f"the base weights of {type(model).__name__} do not fit its architecture (missing "
                          f"{sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")
    base.tie_weights()
    base.save_pretrained(directory)


def placeholder_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                   unk_token="<unk>")


def run_builder(source: Path, out: Path, cache: Path, precision: str, execution_provider: str) -> None:
    """``python -m onnxruntime_genai.models.builder -i source -o out -p precision -e provider``, in this
    process (its prints kept from stdout, and shown in the error if it fails)."""
    try:
        from onnxruntime_genai.models import builder
    except ImportError as err:
        raise ImportError("the model builder path needs onnxruntime-genai and onnx-ir: "
                          "pip install 'attnres-fx[genai]'") from err
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            options = builder.parse_extra_options(None, str(source), str(out), precision, execution_provider,
                                                  str(cache), [])
            builder.create_model(None, str(source), str(out), precision, execution_provider, str(cache), **options)
    except Exception as err:  # noqa: BLE001 - the builder raises plain Exceptions; reported with its output
        tail = "\n".join(printed.getvalue().strip().splitlines()[-5:])
        raise ExportError(f"onnxruntime-genai's model builder failed on {source.name}: {err}\n{tail}") from err


def load_config(folder: Path) -> dict:
    return json.loads((folder / "genai_config.json").read_text())
