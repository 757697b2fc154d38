"""Serves a folder with vLLM and prints what it generated, as JSON: what a user runs, with no import of
attnres_fx (vLLM loads its plugin through the entry point). Used by tests/serving/test_vllm.py, one engine per run.

    python tests/serving/vllm_serve.py REQUEST.json   # {"folder", "prompts", "max_tokens", "engine": {LLM kwargs}}
"""

import json
import sys


def main(request_path: str) -> None:
    from vllm import LLM, SamplingParams

    request = json.loads(open(request_path).read())
    llm = LLM(model=request["folder"], dtype="float32", gpu_memory_utilization=0.1, seed=0, **request["engine"])
    greedy = SamplingParams(temperature=0, max_tokens=request["max_tokens"])
    prompts = [{"prompt_token_ids": prompt} for prompt in request["prompts"]]
    batched = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, greedy, use_tqdm=False)]
    print("RESULT " + json.dumps({"batched": batched}))


if __name__ == "__main__":
    main(sys.argv[1])
