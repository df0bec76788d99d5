"""Constrained decoding on the worker (structured_output/worker.py) driven by the real scheduler.

A random tiny Llama with SmolLM2's tokenizer and a vocabulary padded past the tokenizer's
(49216 > 49152 ids, like real checkpoints padded for tensor cores) samples freely, at several
seeds: whatever it picks, every output that ends by EOS must parse and validate, including
requests preempted (KV pool too small for all) and recomputed with their outputs replayed.
"""

from __future__ import annotations

import json
import re
import socket

import pytest
from neuron.conftest import make_runner

from axonserve.engine.request import Request
from axonserve.engine.scheduler import Scheduler, SchedulerConfig
from axonserve.frontends.tokenizer import Tokenizer
from axonserve.protocol.messages import ParamError, SamplingParams, StructuredOutputsParams
from axonserve.structured_output.grammar import check, compile_grammar, json_schema

jsonschema = pytest.importorskip("jsonschema")

TOKENIZER_VOCAB = 49152
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b", "c"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory, smollm2_dir) -> str:
    from conftest import make_tiny_llama  # the session conftest's builder (SmolLM2 tokenizer)

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-padded")), smollm2_dir, vocab_size=49216)


@pytest.fixture(scope="module")
def tok(padded_dir) -> Tokenizer:
    return Tokenizer.load(padded_dir)


def run(
    model_dir: str,
    reqs: list[tuple[str, list[int], SamplingParams]],
    num_kv_blocks: int = 256,
    block_size: int = 4,
    **runner_kw,
):
    """Serve `reqs` through the real Scheduler and ModelRunner in this process."""
    runner = make_runner(model_dir, num_kv_blocks=num_kv_blocks, block_size=block_size, **runner_kw)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=64,
            max_model_len=512,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            vocab_size=runner.vocab_size,
            eos_token_ids=frozenset(runner.eos_token_ids),
        )
    )
    for rid, prompt, params in reqs:
        sched.add(Request(rid, prompt, params.validate(), max_model_len=512))
    outs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    logprobs: dict[str, list] = {}
    resumed: set[str] = set()
    for _ in range(2000):
        plan = sched.schedule()
        if plan is None:
            break
        resumed.update(n.request_id for n in plan.new if len(n.token_ids) > n.num_prompt_tokens)
        result = runner.execute(plan)
        assert result.error is None, result.error
        for d in sched.update(result):
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)
            logprobs.setdefault(d.request_id, []).extend(d.logprobs or [])
            if d.finish_reason:
                finish[d.request_id] = d.finish_reason
    assert set(finish) == {rid for rid, _, _ in reqs}
    return outs, finish, logprobs, resumed, sched


def params(so: StructuredOutputsParams, seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if seed is None else 1.0, seed=seed, structured_outputs=so, **{"max_tokens": 120, **kw}
    )


def test_specs_are_checked_without_a_tokenizer():
    check(json_schema(PERSON))
    check(StructuredOutputsParams(kind="choice", spec='["yes", "no"]'))
    check(StructuredOutputsParams(kind="grammar", spec='root ::= "a" | "b"'))
    check(StructuredOutputsParams(kind="grammar", spec='start: "a" | "b"'))
    bad = [
        (StructuredOutputsParams(kind="json", spec='{"type": "foo"}'), "Invalid type"),
        (StructuredOutputsParams(kind="json", spec="{nope"), "not valid JSON"),
        (StructuredOutputsParams(kind="json", spec="[1]"), "object or a boolean"),
        (StructuredOutputsParams(kind="json", spec='{"$ref": "#/$defs/x"}'), "invalid JSON schema"),
        (StructuredOutputsParams(kind="regex", spec="a("), "invalid regex"),
        (StructuredOutputsParams(kind="choice", spec="[]"), "non-empty list"),
        (StructuredOutputsParams(kind="grammar", spec="start: undefined_rule"), "invalid grammar"),
        (StructuredOutputsParams(kind="xml", spec="<a/>"), "kind"),
    ]
    for so, why in bad:
        with pytest.raises(ParamError, match=why):
            check(so)
        with pytest.raises(ParamError):  # the frontend's validate() runs the same check
            SamplingParams(structured_outputs=so).validate()
    assert compile_grammar("json", json.dumps(PERSON)) is compile_grammar("json", json.dumps(PERSON))  # cached


def test_json_schema_always_valid_across_seeds_and_preemption(padded_dir, tok):
    so = json_schema(PERSON)
    reqs = [(f"s{seed}", list(range(10, 20 + seed)), params(so, seed)) for seed in range(10)]
    reqs.append(("greedy", [5, 6, 7], params(so, None)))
    # 40 blocks of 4 slots cannot hold 11 growing sequences: preemption by recompute happens
    outs, finish, _, resumed, sched = run(padded_dir, reqs, num_kv_blocks=40)
    assert sched.num_preemptions > 0 and resumed, "some request was recomputed with its outputs"
    for rid, ids in outs.items():
        assert finish[rid] == "stop", (rid, tok.decode(ids))
        assert ids[-1] == 2 and all(t < TOKENIZER_VOCAB for t in ids)  # padded ids never sampled
        value = json.loads(tok.decode(ids))
        jsonschema.validate(value, PERSON)
    assert len({tok.decode(ids) for ids in outs.values()}) > 5  # seeds really sample differently


def test_regex_choice_grammar_and_json_object(padded_dir, tok):
    specs = {
        "regex": (
            StructuredOutputsParams(kind="regex", spec=r"[0-9]{3}-[a-z]{2,4}"),
            lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", s),
        ),
        "choice": (
            StructuredOutputsParams(kind="choice", spec='["yes", "no", "maybe"]'),
            lambda s: s in ("yes", "no", "maybe"),
        ),
        "gbnf": (
            StructuredOutputsParams(kind="grammar", spec='root ::= pair pair? pair? "!"\npair ::= "ab" | "cd"'),
            lambda s: re.fullmatch(r"(ab|cd){1,3}!", s),
        ),
        "array": (
            json_schema(
                {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 1,
                    "maxItems": 4,
                }
            ),
            lambda s: isinstance(json.loads(s), list) and 1 <= len(json.loads(s)) <= 4,
        ),
    }
    reqs = [
        (f"{name}-{seed}", [11, 12, 13 + i], params(so, seed))
        for i, (name, (so, _)) in enumerate(specs.items())
        for seed in (None, 1, 2)
    ]
    # any JSON object is unbounded (a random model may write a string forever), but greedy closes it
    reqs.append(("object", [11, 12], params(json_schema({"type": "object"}), None)))
    outs, finish, _, _, _ = run(padded_dir, reqs)
    for rid, ids in outs.items():
        text = tok.decode(ids)
        assert finish[rid] == "stop", (rid, text)
        ok = (lambda s: isinstance(json.loads(s), dict)) if rid == "object" else specs[rid.rsplit("-", 1)[0]][1]
        assert ok(text), (rid, text)


def test_logprobs_describe_the_constrained_distribution(padded_dir, tok):
    so = StructuredOutputsParams(kind="choice", spec='["yes", "no"]')
    outs, finish, lps, _, _ = run(padded_dir, [("c", [20, 21], params(so, 3, logprobs=5))])
    first = lps["c"][0]
    finite = [(t, v) for t, v in zip(first.top_ids, first.top_logprobs) if v != float("-inf")]
    assert finite and all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t, _ in finite)
    assert abs(sum(2.718281828**v for _, v in finite) - 1.0) < 1e-3  # renormalised over allowed tokens
    assert finish["c"] == "stop" and tok.decode(outs["c"]) in ("yes", "no")


def test_complete_grammar_ends_despite_min_tokens(padded_dir, tok):
    so = StructuredOutputsParams(kind="choice", spec='["yes", "no"]')
    outs, finish, _, _, _ = run(padded_dir, [("m", [30, 31], params(so, None, min_tokens=6, max_tokens=20))])
    # EOS is the only token the grammar allows once it is complete, so it wins over min_tokens
    # (the scheduler ends the request at the first EOS allowed by min_tokens)
    assert finish["m"] == "stop" and len(outs["m"]) == 6 and tok.decode(outs["m"]) in ("yes", "no")


def _tp_rank(rank: int, model_dir: str, port: int, reqs, out) -> None:
    import torch.distributed as dist

    outs = run(model_dir, reqs, num_workers=2, threads=1, rank=rank, dist_init=f"tcp://127.0.0.1:{port}")[0]
    out.put((rank, outs))
    dist.barrier()  # neither rank may leave while the other still talks to it (gloo aborts)
    dist.destroy_process_group()


def test_tensor_parallel_rank0_masks_and_every_rank_follows(padded_dir, tok):
    import torch.multiprocessing as mp

    so = json_schema(PERSON)
    reqs = [(f"s{seed}", [40 + seed, 41, 42], params(so, seed)) for seed in range(3)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, padded_dir, port, reqs, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    assert results[0] == results[1]
    for ids in results[0].values():
        jsonschema.validate(json.loads(tok.decode(ids)), PERSON)


def test_grammar_tokenizer_from_tokenizer_json_matches_transformers(smollm2_dir, tmp_path):
    """The worker builds llguidance's tokenizer from tokenizer.json without transformers; it must
    be the one transformers' tokenizer gives (every token's bytes, special flags, tokenization),
    and defer to transformers where tokenizer_config.json adds a token the file lacks."""
    import shutil

    import llguidance.hf

    from axonserve.frontends.tokenizer import load_hf_tokenizer
    from axonserve.structured_output.worker import _tokenizer_json_llg

    padded = TOKENIZER_VOCAB + 64
    fast = _tokenizer_json_llg(smollm2_dir, padded, [2])
    ref = llguidance.hf.from_tokenizer(load_hf_tokenizer(smollm2_dir), n_vocab=padded, eos_token=[2])
    assert fast is not None and fast.vocab_size == ref.vocab_size == padded and fast.eos_token == ref.eos_token
    ids = range(TOKENIZER_VOCAB)
    assert [fast.decode_bytes([i]) for i in ids] == [ref.decode_bytes([i]) for i in ids]
    assert [fast.is_special_token(i) for i in ids] == [ref.is_special_token(i) for i in ids]
    for text in ("Hello world <|im_start|>user", '{"name": "Zoë", "age": 42}', "  \n\tx"):
        assert fast.tokenize_str(text) == ref.tokenize_str(text)

    d = tmp_path / "extra"
    shutil.copytree(smollm2_dir, d, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.setdefault("added_tokens_decoder", {})[str(TOKENIZER_VOCAB)] = {"content": "<|extra|>", "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert _tokenizer_json_llg(str(d), padded, [2]) is None
    (d / "tokenizer.json").unlink()
    assert _tokenizer_json_llg(str(d), padded, [2]) is None
