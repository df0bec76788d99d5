"""vLLM's offline `LLM` on axonserve's ranks, run by test_offline.py inside the vLLM venv:
`python offline_llm.py MODEL_DIR SPEC.json OUT.json`. Writes what vLLM returned as JSON.

The executor is named with `distributed_executor_backend` (VLLM_TARGET_DEVICE=cpu: vLLM's
built-in CPU platform, no platform plugin), as a user of vLLM's Python API would.
"""

from __future__ import annotations

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

EXECUTOR = "axonserve.frontends.vllm_plugin.executor.AxonExecutor"


def _lp(d) -> dict[str, float]:
    return {str(t): v.logprob for t, v in d.items()} if d is not None else None


def main() -> None:
    model, spec_path, out_path = sys.argv[1:4]
    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(
        model,
        distributed_executor_backend=EXECUTOR,
        dtype="float32",
        max_model_len=spec["max_model_len"],
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
        profiler_config={"profiler": "torch", "torch_profiler_dir": spec["profile_dir"]},
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    n = spec["max_tokens"]
    greedy = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3), use_tqdm=False
    )
    scored = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=40, seed=7, max_tokens=8, ignore_eos=True, repetition_penalty=1.2
    )
    sampled = [llm.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
    llm.start_profile()  # vLLM's profiler calls -> torch.profiler on every axonserve rank
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    llm.stop_profile()
    out = {
        "greedy": [list(o.outputs[0].token_ids) for o in greedy],
        "logprobs": [[_lp(d) for d in o.outputs[0].logprobs] for o in greedy],
        "prompt_logprobs": [_lp(d) for d in scored[0].prompt_logprobs],
        "sampled": [list(s) for s in sampled],
    }
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
