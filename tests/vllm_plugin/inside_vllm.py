"""Checks that need vLLM itself, run by test_translation.py inside the vLLM venv:
`python inside_vllm.py MODEL_DIR CHECK...` prints `ok CHECK` per passing check and exits
non-zero at the first failure (its traceback names it).

They build vLLM's real objects (SamplingParams, NewRequestData, CachedRequestData,
SchedulerOutput, a VllmConfig) and run our translation, executor and platform on them —
no ranks are started here.
"""

from __future__ import annotations

import importlib
import os
import sys

from vllm.sampling_params import SamplingParams as VSP
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.core.sched.output import CachedRequestData as VCached
from vllm.v1.core.sched.output import NewRequestData as VNew
from vllm.v1.core.sched.output import SchedulerOutput

from axonserve.frontends.vllm_plugin.mirror import Mirror
from axonserve.frontends.vllm_plugin.output import runner_output
from axonserve.frontends.vllm_plugin.plan import sampling_params, step_plan
from axonserve.protocol import Codec
from axonserve.protocol.messages import PromptLogprobs, StepPlan, StepResult, TokenLogprobs

EXECUTOR = "axonserve.frontends.vllm_plugin.executor.AxonExecutor"


def vsp(**kw) -> VSP:
    sp = VSP(**kw)
    sp.update_from_generation_config({}, eos_token_id=2)  # as vLLM's input processor does
    return sp


def new(rid: str, prompt: list[int], blocks: list[int], computed: int = 0, **sp) -> VNew:
    return VNew(
        req_id=rid,
        prompt_token_ids=prompt,
        mm_features=[],
        sampling_params=vsp(temperature=0, **sp),
        pooling_params=None,
        block_ids=(blocks,),
        num_computed_tokens=computed,
        lora_request=None,
    )


def cached(rids, new_blocks, computed, resumed=(), all_tokens=None) -> VCached:
    return VCached(
        req_ids=list(rids),
        resumed_req_ids=set(resumed),
        new_token_ids=[],
        all_token_ids=all_tokens or {},
        new_block_ids=[None if b is None else (b,) for b in new_blocks],
        num_computed_tokens=list(computed),
        num_output_tokens=[0] * len(rids),
    )


def sched(new_reqs=(), cached_reqs=None, n=None, finished=()) -> SchedulerOutput:
    n = n or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=cached_reqs or VCached.make_empty(),
        num_scheduled_tokens=n,
        total_num_scheduled_tokens=sum(n.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )


def round_trip(plan: StepPlan) -> StepPlan:
    back, _ = Codec(StepPlan).decode(Codec.encode(plan))
    assert back == plan, (back, plan)
    return back


# --------------------------------------------------------------------------- checks


def check_plan_sequence(model: str) -> None:
    """Chunked prefill, a prefix-cache hit, decode, preemption + resume, finish, a no-token step."""
    m = Mirror()
    a_prompt, b_prompt = list(range(100, 120)), list(range(200, 240))
    # step 1: a's first 16-token chunk; b is new but its first 32 tokens hit the prefix cache
    so = sched([new("a", a_prompt, [0, 1]), new("b", b_prompt, [2, 3, 4], computed=32)], n={"a": 16, "b": 8})
    p1 = round_trip(step_plan(so, 1, m))
    assert [r.request_id for r in p1.new] == ["a", "b"] and p1.num_scheduled_tokens == [16, 8]
    assert p1.new[1].num_computed_tokens == 32 and p1.new[1].block_ids == [2, 3, 4] and p1.new[1].token_ids == b_prompt
    out = runner_output(p1, StepResult(step_id=1, request_ids=["b"], sampled_token_ids=[99]), m)
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [[], [99]] and out.req_id_to_index == {"a": 0, "b": 1}
    assert m.requests["a"].num_computed_tokens == 16 and m.requests["b"].token_ids == b_prompt + [99]
    # step 2: a's last 4 prompt tokens, b decodes into a new block: both are diffs
    so = sched(cached_reqs=cached(["a", "b"], [None, [5]], [16, 40]), n={"a": 4, "b": 1})
    p2 = round_trip(step_plan(so, 2, m))
    assert not p2.new and [(c.request_id, c.new_block_ids) for c in p2.cached] == [("a", []), ("b", [5])]
    runner_output(p2, StepResult(step_id=2, request_ids=["a", "b"], sampled_token_ids=[7, 8]), m)
    assert m.requests["b"].block_ids == [2, 3, 4, 5]
    # step 3: a finished; b was preempted and resumes: blocks replaced, recomputed from 0, all its tokens
    b_tokens = b_prompt + [99, 8]
    so = sched(
        cached_reqs=cached(["b"], [[6, 7, 8]], [0], resumed={"b"}, all_tokens={"b": b_tokens}),
        n={"b": 16},
        finished={"a"},
    )
    p3 = round_trip(step_plan(so, 3, m))
    assert p3.finished_request_ids == ["a", "b"] and not p3.cached  # b's old state is dropped, then re-sent
    nb = p3.new[0]
    assert (nb.request_id, nb.token_ids, nb.block_ids, nb.num_computed_tokens, nb.num_prompt_tokens) == (
        "b",
        b_tokens,
        [6, 7, 8],
        0,
        40,
    )
    assert "a" not in m.requests
    runner_output(p3, StepResult(step_id=3), m)
    # a computed count that disagrees with vLLM's is re-sent whole, not diffed
    so = sched(cached_reqs=cached(["b"], [None], [10]), n={"b": 6})
    p4 = step_plan(so, 4, m)
    assert p4.new[0].num_computed_tokens == 10 and p4.new[0].block_ids == [6, 7, 8] and "b" in p4.finished_request_ids
    # a step that runs nothing sends nothing; its finished ids ride with the next plan
    assert step_plan(sched(finished={"b"}), 5, m) is None
    p6 = step_plan(sched([new("c", [1, 2, 3], [9])], n={"c": 3}), 5, m)
    assert p6.finished_request_ids == ["b"] and [r.request_id for r in p6.new] == ["c"]


def check_logprobs_output(model: str) -> None:
    m = Mirror()
    so = sched(
        [new("a", [5, 6, 7, 8, 9], [0], prompt_logprobs=1), new("b", [1, 2], [1], logprobs=2)], n={"a": 3, "b": 2}
    )
    p1 = step_plan(so, 1, m)
    lp_b = TokenLogprobs(logprob=-0.25, rank=1, top_ids=[42, 3], top_logprobs=[-0.25, -2.0])
    entries = [TokenLogprobs(logprob=-1.0 - i, rank=i + 2, top_ids=[50 + i], top_logprobs=[-0.5]) for i in range(3)]
    res = StepResult(
        step_id=1,
        request_ids=["b"],
        sampled_token_ids=[42],
        logprobs=[lp_b],
        prompt_logprobs=[PromptLogprobs("a", 1, entries)],
    )
    out = runner_output(p1, res, m)
    assert out.prompt_logprobs_dict == {}, "a's prefill is not complete: vLLM gets its prompt logprobs at the end"
    ids, vals, ranks = out.logprobs.slice_request(1, 1)[:3]
    assert ids.tolist() == [[42, 42, 3]] and ranks.tolist() == [1] and vals.tolist() == [[-0.25, -0.25, -2.0]]
    assert out.logprobs.logprob_token_ids.shape == (2, 3)
    so = sched(cached_reqs=cached(["a"], [None], [3]), n={"a": 2})
    p2 = step_plan(so, 2, m)
    res = StepResult(
        step_id=2,
        request_ids=["a"],
        sampled_token_ids=[11],
        prompt_logprobs=[PromptLogprobs("a", 4, [TokenLogprobs(-4.0, 5, [60], [-0.1])])],
    )
    out = runner_output(p2, res, m)
    t = out.prompt_logprobs_dict["a"]
    assert t.logprob_token_ids.tolist() == [[6, 50], [7, 51], [8, 52], [9, 60]]
    assert t.logprobs[:, 0].tolist() == [-1.0, -2.0, -3.0, -4.0] and t.selected_token_ranks.tolist() == [2, 3, 4, 5]


def check_sampling_params(model: str) -> None:
    sp = vsp(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        min_tokens=2,
        stop_token_ids=[7],
        logit_bias={5: 200.0},
        logprobs=2,
        prompt_logprobs=1,
        max_tokens=9,
        allowed_token_ids=[5, 6, 7],
    )
    ours = sampling_params(sp)
    assert (ours.temperature, ours.top_p, ours.top_k, ours.min_p, ours.seed) == (0.7, 0.9, 20, 0.05, 3)
    assert (ours.presence_penalty, ours.frequency_penalty, ours.repetition_penalty) == (0.5, 0.2, 1.1)
    assert ours.stop_token_ids == [2, 7] and ours.ignore_eos and ours.min_tokens == 2 and ours.max_tokens is None
    assert ours.logit_bias == {5: 100.0} and ours.allowed_token_ids == [5, 6, 7]
    assert (ours.logprobs, ours.prompt_logprobs) == (2, 1)
    for bad, what in (
        ({"bad_words": ["x"]}, "bad_words"),
        ({"structured_outputs": StructuredOutputsParams(regex="a+")}, "structured outputs"),
        ({"logprobs": -1}, "logprobs"),
    ):
        try:
            sampling_params(vsp(**bad))
        except NotImplementedError as e:
            assert what in str(e), e
        else:
            raise AssertionError(f"{bad} was accepted")
    from vllm.exceptions import VLLMValidationError

    from axonserve.frontends.vllm_plugin.platform import AxonCpuPlatform

    try:
        AxonCpuPlatform.validate_request({"type": "token", "prompt_token_ids": [1]}, vsp(bad_words=["x"]))
    except VLLMValidationError as e:
        assert e.parameter == "bad_words" and "bad_words" in str(e), e
    else:
        raise AssertionError("the platform let bad_words through")


def check_executor_rpcs(model: str) -> None:
    """RPCs are answered from axonserve's model config, or raise naming themselves; no ranks start."""
    from vllm.engine.arg_utils import EngineArgs

    from axonserve.frontends.vllm_plugin import startup
    from axonserve.frontends.vllm_plugin.executor import AxonExecutor

    kv_bytes = 1 << 20
    vc = EngineArgs(
        model=model,
        dtype="float32",
        max_model_len=64,
        seed=0,
        enforce_eager=True,
        distributed_executor_backend=EXECUTOR,
        kv_cache_memory_bytes=kv_bytes,
    ).create_engine_config()
    ex = AxonExecutor(vc)
    try:
        specs = ex.get_kv_cache_specs()
        assert len(specs) == 1 and len(specs[0]) == 2, specs
        spec = next(iter(specs[0].values()))
        assert spec.block_size == 16 and spec.num_kv_heads == 2 and spec.head_size == 16
        assert spec.page_size_bytes * 2 == startup.block_bytes(ex.axon_config), "vLLM's pages != our KV blocks"
        assert ex.determine_available_memory() == [kv_bytes]
        assert ex.get_supported_kv_cache_layouts() == [["LBNHC"]]
        assert ex.supported_tasks == ("generate",)
        for call, name in (
            (lambda: ex.collective_rpc("sleep"), "'sleep'"),
            (lambda: ex.collective_rpc("add_lora", args=(None,)), "'add_lora'"),
            (lambda: ex.save_sharded_state("/nonexistent"), "'save_sharded_state'"),
            (lambda: ex.collective_rpc(lambda w: 1), "callable"),
            (lambda: ex.set_kv_cache_layout("LBHNC"), "LBHNC"),
        ):
            try:
                call()
            except NotImplementedError as e:
                assert name in str(e), e
            else:
                raise AssertionError(f"{name} did not raise")
        try:
            ex.execute_model(sched())
        except RuntimeError as e:
            assert "initialize_from_config" in str(e)
        else:
            raise AssertionError("stepping before the ranks started did not raise")
    finally:
        ex.shutdown()


def check_unsupported_features(model: str) -> None:
    """Features the ranks do not implement are refused by name when the executor is made."""
    from vllm.engine.arg_utils import EngineArgs

    from axonserve.frontends.vllm_plugin.executor import AxonExecutor

    vc = EngineArgs(
        model=model,
        dtype="float32",
        max_model_len=64,
        seed=0,
        enforce_eager=True,
        kv_cache_dtype="fp8",
        distributed_executor_backend=EXECUTOR,
        kv_cache_memory_bytes=1 << 20,
    ).create_engine_config()
    try:
        AxonExecutor(vc).shutdown()
    except NotImplementedError as e:
        assert "--kv-cache-dtype fp8" in str(e), e
    else:
        raise AssertionError("an fp8 KV cache was accepted")


def check_version_guard(model: str) -> None:
    import vllm

    from axonserve.frontends.vllm_plugin.version import VllmVersionError, check_vllm_version

    assert check_vllm_version() == vllm.__version__
    real = vllm.__version__
    mods = [k for k in sys.modules if k.startswith("axonserve.frontends.vllm_plugin.") and not k.endswith(".version")]
    for k in mods:
        del sys.modules[k]
    vllm.__version__ = "0.33.0"
    try:
        importlib.import_module("axonserve.frontends.vllm_plugin.executor")
    except VllmVersionError as e:
        assert "0.33.0" in str(e) and ">=0.32" in str(e) and "<0.33" in str(e), e
    else:
        raise AssertionError("the executor imported under vLLM 0.33.0")
    finally:
        vllm.__version__ = real


def check_plugin_entry_point(model: str) -> None:
    from importlib.metadata import entry_points

    from axonserve.frontends import vllm_plugin

    eps = [e for e in entry_points(group="vllm.platform_plugins") if e.name == "axonserve"]
    assert eps and eps[0].value == "axonserve.frontends.vllm_plugin:register_platform", eps
    os.environ.pop("AXONSERVE_VLLM", None)
    assert eps[0].load()() is None, "the platform plugin must be inert unless AXONSERVE_VLLM=1"
    os.environ["AXONSERVE_VLLM"] = "1"
    assert vllm_plugin.register_platform() == vllm_plugin.PLATFORM
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert issubclass(resolve_obj_by_qualname(vllm_plugin.PLATFORM), CpuPlatform)


if __name__ == "__main__":
    model_dir, names = sys.argv[1], sys.argv[2:]
    for name in names:
        globals()[f"check_{name}"](model_dir)
        print(f"ok {name}", flush=True)
