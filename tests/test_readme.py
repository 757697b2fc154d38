"""Every Python code block of the README runs, as written, at reduced size: a snippet cannot rot.

Each block is found by its first line; its setup (the names it takes as given) and the replacements
that shrink it (model sizes, steps) are listed here. A block of the README this file does not know fails
the test, so a new snippet gets a setup when it is written.
"""

import copy
import os
import re
from pathlib import Path

import pytest
import torch

import attnres_fx
from hf_models import needs_hf
from conftest import cold_compile

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)

TINY_LLAMA = {"hidden_size=256": "hidden_size=32", "intermediate_size=1024": "intermediate_size=64",
              "num_hidden_layers=16": "num_hidden_layers=2", "vocab_size=1024": "vocab_size=128",
              "num_attention_heads=4, num_key_value_heads=4": "num_attention_heads=2, num_key_value_heads=2"}


def _nanogpt():
    from toy_models import NanoGPT, make_inputs

    torch.manual_seed(0)
    return {"model": NanoGPT(dropout=0.0, mask_buffer=True), "idx": make_inputs(), "targets": make_inputs(seed=1)}


def test_the_intro_models_mask_needs_the_example_inputs_and_the_error_says_so():
    """nanoGPT's causal-mask buffer sliced to the sequence length: torch.fx, the only capture without
    example inputs, cannot trace it; the refusal says to pass them (as the intro block does) and leaves
    the model as it was."""
    namespace = _nanogpt()
    model = namespace["model"]
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(attnres_fx.TraceError, match=r"pass example_inputs"):
        attnres_fx.attnresify(model)
    assert not attnres_fx.is_converted(model)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def _converted_tiny():
    from attnres_fx.models import TinyTransformer, example_ids

    torch.manual_seed(0)
    model = TinyTransformer(dim=32, num_layers=2, num_heads=4).eval()
    ids = example_ids(model.config)
    return {"model": attnres_fx.attnresify(model, (ids,)), "ids": ids, "torch": torch, "attnres_fx": attnres_fx}


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=128)
    return {"model": transformers.LlamaForCausalLM(config), "torch": torch, "attnres_fx": attnres_fx}


def _llama_to_train():
    namespace = _llama()
    namespace["reference"] = copy.deepcopy(namespace["model"])
    namespace["input_ids"] = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    return namespace


def _gradients_as_unwrapped(ns) -> bool:
    """The checkpointed, compiled, sharded model's gradients are those of the same conversion run as it is
    (eager, fp32), up to the recipe's bf16 parameters: 3e-2 of the largest gradient (bf16 keeps 8 bits)."""
    reference = attnres_fx.attnresify(ns["reference"], num_blocks=2)
    ids = ns["input_ids"]
    reference(ids, labels=ids, use_cache=False).loss.backward()
    want = {name: p.grad for name, p in reference.named_parameters()}
    got = {name.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor()
           for name, p in ns["model"].named_parameters()}
    assert got.keys() == want.keys()
    scale = max(float(g.abs().max()) for g in want.values())
    gaps = {name: float((got[name] - want[name]).abs().max()) / scale for name in want}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] < 3e-2, (worst, gaps[worst])
    assert any(float(g.abs().max()) > 0 for name, g in got.items() if "attn_res" in name)
    return True


def _pipeline():
    namespace = _llama()
    attnres_fx.attnresify(namespace["model"], block_size=2)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(2))

    def loss_fn(output, targets):
        return torch.nn.functional.cross_entropy(output.flatten(0, 1), targets.flatten())
    return {**namespace, "ids": ids, "targets": ids, "microbatch": 1, "world": 1, "rank": 0,
            "device": torch.device("cpu"), "loss_fn": loss_fn}


def _run_on_two_ranks():
    pytest.skip("the pipelining block runs on two ranks, as written: test_the_pipelining_block_on_two_ranks")


# The tiny Llama's four blocks, one stage each: two stages per rank, as the block's interleaved schedule places them.
PIPELINE = {'["model.layers.4", "model.layers.8", "model.layers.12"]':
            '["model.layers.1", "model.layers.2", "model.layers.3"]'}


def _pipeline_rank(rank, world, store, out, code):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        namespace = {"__name__": "readme", **_pipeline(), "rank": rank, "world": world}
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
        grads = {name: p.grad for name, p in namespace["model"].named_parameters() if p.grad is not None}
        torch.save({"stages": len(namespace["stages"]), "grads": grads}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@needs_hf
@pytest.mark.timeout(300)
def test_the_pipelining_block_on_two_ranks(tmp_path):
    """The pipelining block as written, on two processes over gloo (rank 0 feeds the first stage, rank 1 holds
    the last): each rank's gradients after the step are the single-process model's on the whole batch (the
    schedule averages its four microbatches' mean losses; 1e-5 relative: fp32 sums in another order)."""
    import torch.multiprocessing as mp

    block = next(b for b in BLOCKS if b.startswith("from torch.distributed.pipelining import"))
    code = block
    for old, new in PIPELINE.items():
        assert old in code, f"the README block changed: {old!r} is gone"
        code = code.replace(old, new)
    mp.spawn(_pipeline_rank, args=(2, str(tmp_path / "store"), str(tmp_path), code), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reference = _pipeline()
    model = reference["model"]
    reference["loss_fn"](model(reference["ids"]).logits, reference["targets"]).backward()
    want = {name: p.grad for name, p in model.named_parameters()}
    assert all(found["stages"] == 4 for found in ranks)
    got = {name: grad for found in ranks for name, grad in found["grads"].items()}
    assert set(got) == set(want), set(want) ^ set(got)
    scale = max(float(grad.abs().max()) for grad in want.values())
    gaps = {name: float((got[name] - want[name]).abs().max()) / scale for name in want}
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] < 1e-5, (worst, gaps[worst])


def _served():
    """A converted tiny Llama and its tokenizer (onnxruntime-genai needed: the genai extra)."""
    pytest.importorskip("onnxruntime_genai", reason="needs onnxruntime-genai (pip install 'attnres-fx[genai]')")
    from attnres_fx.testing import randomise_pseudo_queries
    from attnres_fx.testing.serving import serving_model, tiny_tokenizer

    model = attnres_fx.attnresify(serving_model("llama"), block_size=2)
    return {"model": randomise_pseudo_queries(model), "tokenizer": tiny_tokenizer()}


def _run_in_the_vllm_venv():
    pytest.skip("the vLLM block runs in vLLM's venv, as written: tests/serving/test_vllm.py (make test-vllm)")


# first line -> (setup, replacements, what must hold afterwards)
SNIPPETS = {
    "import attnres_fx": (_nanogpt, {}, lambda ns: not attnres_fx.is_converted(ns["model"])),
    "import torch, transformers, attnres_fx": (dict, {
        **TINY_LLAMA, "torch.randint(0, 1024, (64, 64))": "torch.randint(0, 128, (16, 16))",
        "max_steps=20": "max_steps=2", "per_device_train_batch_size=8": "per_device_train_batch_size=4",
        "max_new_tokens=20": "max_new_tokens=4"}, lambda ns: bool(ns["same"])),
    "weights = attnres_fx.depth_weights(model, ids)": (_converted_tiny, {},
                                                        lambda ns: Path("depth.png").is_file()),
    "optimizer = torch.optim.AdamW(attnres_fx.param_groups(": (_converted_tiny, {},
                                                               lambda ns: len(ns["optimizer"].param_groups) >= 3),
    "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper": (
        _llama_to_train, {"num_blocks=8": "num_blocks=2"}, lambda ns: _gradients_as_unwrapped(ns)),
    "from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B": (
        _run_on_two_ranks, {}, lambda ns: False),
    "import onnxruntime_genai as og": (
        _served, {}, lambda ns: ns["generator"].is_done() and len(ns["generator"].get_sequence(0)) == 32
        and Path("served/genai_config.json").is_file()
        and '"precision": "int4"' in Path("served-int4/written_by.json").read_text()),
    "from attnres_fx import export": (_converted_tiny, {}, lambda ns: ns["path"].is_file()),
    "from vllm import LLM, SamplingParams": (_run_in_the_vllm_venv, {}, lambda ns: False),
}


def _snippet(block: str):
    first = block.splitlines()[0]
    for start, snippet in SNIPPETS.items():
        if first.startswith(start):
            return snippet
    raise AssertionError(f"a README code block this test does not know: {first!r}; give it a setup")


@pytest.fixture
def process_group():
    """One process over gloo: what the distributed snippets take as given."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{os.path.abspath('store')}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@cold_compile
@pytest.mark.slow
@needs_hf
@pytest.mark.parametrize("block", BLOCKS, ids=[b.splitlines()[0][:50] for b in BLOCKS])
def test_readme_block_runs(block, tmp_path, monkeypatch, request):
    setup, replacements, holds = _snippet(block)
    monkeypatch.chdir(tmp_path)
    if "torch.distributed" in block:
        request.getfixturevalue("process_group")
    code = block
    for old, new in replacements.items():
        assert old in code, f"the README block changed: {old!r} is gone"
        code = code.replace(old, new)
    namespace = {"__name__": "readme", **setup()}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert holds(namespace)
