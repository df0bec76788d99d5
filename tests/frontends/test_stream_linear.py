"""A stream's per-token work must not grow with its length (issue 27 item 7).

Work is counted, never timed (the machine's speed swings 2x): tokens handed to the tokenizer's
decode, characters the stop-string search and the tool-call scanner examined. Each check streams
4,000 tokens and asserts the total is linear (< c * tokens) and that the second 2,000 tokens cost
about what the first 2,000 did; a per-delta re-scan of the text would make the second half cost
about three times the first. The end-to-end test streams 4,000 tokens through a real server with
four stop strings that never match.
"""

from __future__ import annotations

import json

import openai
import pytest

from axonserve.frontends.detokenizer import IncrementalDetokenizer
from axonserve.frontends.openai.tools import HermesToolParser, Llama3JsonToolParser, ToolCallFormatter
from axonserve.frontends.tokenizer import Tokenizer

from .server import serve

N = 4000
STOPS = ["STOP!", "<never>", "zq#zq", "\n\n\n\n"]


class CountingTokenizer(Tokenizer):
    """Counts decode calls and the token ids they were given."""

    def __init__(self, hf):
        super().__init__(hf)
        self.calls = 0
        self.ids = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        self.ids += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> CountingTokenizer:
    return CountingTokenizer(Tokenizer.load(smollm2_dir).hf)


def body_ids(tok: Tokenizer, n: int) -> list[int]:
    """n tokens of varied text (multi-byte characters included) holding no stop string."""
    text = "".join(
        f"Paragraph {i}: the quick brown fox — café, 中文, 😀 — jumps over {i * 7} dogs.\n" for i in range(n // 10)
    )
    ids = tok.hf.encode(text, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def assert_linear(at_half: int, at_end: int, per_token: float, what: str):
    first, second = at_half, at_end - at_half
    assert at_end < per_token * N, f"{what}: {at_end} for {N} tokens"
    assert 0.8 < second / first < 1.25, f"{what}: first half {first}, second half {second}"


def test_detokenizer_work_per_token_is_constant(tok):
    ids = body_ids(tok, N) + tok.hf.encode(" STOP! and after", add_special_tokens=False)
    full = tok.hf.decode(ids)
    d = IncrementalDetokenizer(tok, tok.encode("Prompt:"), stop=STOPS)
    tok.calls = tok.ids = 0
    pieces, marks = [], {}
    for i, t in enumerate(ids):
        out = d.step([t])
        pieces.append(out.text)
        if i + 1 in (N // 2, N):
            marks[i + 1] = (tok.ids, d.scanned_chars)
        if out.stop_string is not None:
            break
    assert d.stop_string == "STOP!" and d.num_output_tokens > N
    assert "".join(pieces) == d.text == full[: full.index("STOP!")]
    (ids_half, scan_half), (ids_end, scan_end) = marks[N // 2], marks[N]
    # two decodes of a window of a few tokens per token; a whole-output decode would be ~N/2
    assert_linear(ids_half, ids_end, 8, "token ids decoded")
    # each stop string searched in the new chars + len(stop) - 1 before them (~2.5 chars/token),
    # plus the check of the text's end against stop-string prefixes
    assert_linear(scan_half, scan_end, 100, "chars scanned for stop strings")
    assert tok.calls <= 2 * d.num_output_tokens


def test_only_a_possible_stop_prefix_is_held_back(tok):
    """Text that cannot start a stop string goes out at once; a possible start waits."""
    d = IncrementalDetokenizer(tok, [], stop=["STOP!", "<never>"])
    ids = tok.hf.encode("hello world ST", add_special_tokens=False)
    assert "".join(d.step([t]).text for t in ids) == "hello world "  # "ST" may start "STOP!"
    assert d.step(tok.hf.encode("ep", add_special_tokens=False)).text == "STep"
    d = IncrementalDetokenizer(tok, [], stop=["STOP!"], include_stop_str_in_output=True)
    assert d.step(ids).text == "hello world ST"  # an included stop string is never held back


def hermes_output(tok: Tokenizer) -> str:
    calls = []
    i = 0
    while len(tok.hf.encode("".join(calls), add_special_tokens=False)) < N + 100:
        args = {"city": f"Paris-{i}", "days": i % 7 + 1, "note": 'a}"b{ ' * (i % 3), "tags": [i, "x"]}
        calls.append(f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': args})}\n</tool_call>\n")
        i += 50
    return "Let me check a few cities.\n" + "".join(calls)


def llama3_output(tok: Tokenizer) -> str:
    lines = [f'line {i}: {"x" * (i % 13)} "quoted" {{brace}}' for i in range(N // 16)]
    return '<|python_tag|>{"name": "write_file", "parameters": {"path": "a.txt", "lines": ' + json.dumps(lines) + "}}"


@pytest.mark.parametrize(
    "parser,output,calls", [(HermesToolParser, hermes_output, "many"), (Llama3JsonToolParser, llama3_output, "one")]
)
def test_tool_call_stream_work_per_token_is_constant(tok, parser, output, calls):
    """Through the detokenizer into the tool formatter, token by token: many calls, or one huge call."""
    text = output(tok)
    ids = tok.hf.encode(text, add_special_tokens=False)
    assert len(ids) > N
    d = IncrementalDetokenizer(tok, [])
    fmt = ToolCallFormatter(parser())
    content, got, marks, widest = "", {}, {}, 0
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = d.step([t], finished=last)
        c, frags, reason = fmt.delta(0, out.text, "stop" if last else None)
        content += c
        for f in frags or []:
            got.setdefault(f.index, [f.function.name, ""])[1] += f.function.arguments or ""
        scanned, buffered = fmt.stream_work(0)
        widest = max(widest, buffered)
        if i + 1 in (N // 2, N):
            marks[i + 1] = scanned
    assert reason == "tool_calls"
    w_content, w_calls, _ = ToolCallFormatter(parser()).message(text, "stop")
    assert (content or None, [tuple(v) for _, v in sorted(got.items())]) == (
        w_content,
        [(c.function.name, c.function.arguments) for c in w_calls],
    )
    assert len(got) > 20 if calls == "many" else len(got) == 1
    assert_linear(marks[N // 2], marks[N], 16, "chars scanned by the tool-call parser")
    # the scanner keeps only text it may still read or send (a possible partial tag, unsent
    # arguments), not the output so far: appending a delta copies a few dozen chars at most
    assert widest < 100, widest


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, smollm2_dir) -> str:
    from conftest import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-long")), smollm2_dir, max_position_embeddings=4608)


@pytest.mark.timeout(600)
def test_server_streams_4000_tokens_with_stop_strings(long_model):
    args = ("--max-num-seqs", "4", "--max-model-len", "4352", "--num-kv-blocks", "600", "--served-model-name", "tiny")
    kw = dict(
        model="tiny",
        prompt="The sky is",
        max_tokens=N,
        temperature=0,
        seed=3,
        stop=STOPS,
        extra_body={"ignore_eos": True},
    )
    with serve(long_model, *args) as srv:
        oai = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        whole = oai.completions.create(**kw)
        chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == N
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"] and chunks[-1].usage.completion_tokens == N
    assert text == whole.choices[0].text and len(text) > N  # nothing held back or cut
