"""AsyncEngineClient against a scripted ROUTER that speaks the engine side of the bus contract.

These pin the client's half of the protocol (routing, aborts, liveness) in isolation; the
real scheduler is exercised by the HTTP integration tests.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from axonserve.frontends.client import AsyncEngineClient, EngineDeadError
from axonserve.frontends.tokenizer import Tokenizer
from axonserve.protocol import ClientToEngine, Codec
from axonserve.protocol.messages import (
    AbortRequest,
    AddRequest,
    EngineDead,
    EngineInfo,
    GetEngineInfo,
    Outputs,
    ParamError,
    RequestDelta,
    SamplingParams,
)

pytestmark = pytest.mark.timeout(60)


class ScriptedEngine:
    """A ROUTER that answers GetEngineInfo and records what clients send."""

    def __init__(self, address: str, model: str, max_model_len: int = 64):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(address)
        self.info = EngineInfo(model, "fake", max_model_len, 16, 100, 8, [2], 49152)
        self.adds: asyncio.Queue[AddRequest] = asyncio.Queue()
        self.aborts: asyncio.Queue[AbortRequest] = asyncio.Queue()
        self.answer_pings = True
        self.ident = b""
        self._codec = Codec(ClientToEngine)
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart()
            self.ident = ident
            msg, _ = self._codec.decode(frames)
            if isinstance(msg, GetEngineInfo) and self.answer_pings:
                await self.send(self.info)
            elif isinstance(msg, AddRequest):
                self.adds.put_nowait(msg)
            elif isinstance(msg, AbortRequest):
                self.aborts.put_nowait(msg)

    async def send(self, msg) -> None:
        await self.sock.send_multipart([self.ident, *Codec.encode(msg)])

    async def deltas(self, *deltas: RequestDelta) -> None:
        await self.send(Outputs(list(deltas)))

    def close(self) -> None:
        self._task.cancel()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.load(smollm2_dir)


@pytest.fixture
async def pair(tmp_path, tok, smollm2_dir):
    engine = ScriptedEngine(f"ipc://{tmp_path}/engine", smollm2_dir)
    client = await AsyncEngineClient.connect(
        f"ipc://{tmp_path}/engine", timeout=5, tokenizer=tok, ping_after_s=0.3, ping_timeout_s=0.6
    )
    yield engine, client
    client.close()
    engine.close()


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.hf.encode(text, add_special_tokens=False)


async def collect(gen) -> list:
    return [o async for o in gen]


async def test_streams_text_and_finishes(pair, tok):
    engine, client = pair
    task = asyncio.create_task(collect(client.generate("Hi", SamplingParams(max_tokens=10), "r1")))
    add = await engine.adds.get()
    assert add.request_id.startswith("r1@") and add.prompt_token_ids == tok.encode("Hi")
    toks = ids(tok, "Hello 😀 there")
    await engine.deltas(RequestDelta(add.request_id, toks[:2], num_prompt_tokens=1))
    await engine.deltas(RequestDelta(add.request_id, toks[2:], finish_reason="length", num_prompt_tokens=1))
    outs = await task
    assert "".join(o.text for o in outs) == outs[-1].output_text == "Hello 😀 there"
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == len(toks)
    assert [t for o in outs for t in o.token_ids] == toks


async def test_stop_string_aborts_engine_request(pair, tok):
    engine, client = pair
    params = SamplingParams(max_tokens=20, stop=["END"])
    task = asyncio.create_task(collect(client.generate("Hi", params, "r2")))
    rid = (await engine.adds.get()).request_id
    await engine.deltas(RequestDelta(rid, ids(tok, "one two EN")))
    await engine.deltas(RequestDelta(rid, ids(tok, "D three")))
    outs = await task
    assert outs[-1].output_text == "one two " and outs[-1].finish_reason == "stop"
    assert outs[-1].stop_reason == "END"
    assert (await asyncio.wait_for(engine.aborts.get(), 2)).request_ids == [rid]


async def test_break_aborts(pair, tok):
    engine, client = pair
    gen = client.generate([5, 6, 7], SamplingParams(max_tokens=20), "r3")

    async def reply() -> str:
        rid = (await engine.adds.get()).request_id
        await engine.deltas(RequestDelta(rid, [100]))
        return rid

    replier = asyncio.create_task(reply())
    async for _ in gen:
        break
    else:  # pragma: no cover
        pytest.fail("no output")
    await gen.aclose()
    rid = await replier
    assert (await asyncio.wait_for(engine.aborts.get(), 2)).request_ids == [rid]
    assert client.num_in_flight == 0


async def test_break_without_aclose_aborts(pair, tok):
    engine, client = pair

    async def first() -> None:
        async for _ in client.generate([5, 6], SamplingParams(max_tokens=20), "r3b"):
            break

    task = asyncio.create_task(first())
    rid = (await engine.adds.get()).request_id
    await engine.deltas(RequestDelta(rid, [100]))
    await task
    assert (await asyncio.wait_for(engine.aborts.get(), 2)).request_ids == [rid]


async def test_cancel_aborts(pair):
    engine, client = pair
    task = asyncio.create_task(collect(client.generate([5], SamplingParams(), "r4")))
    rid = (await engine.adds.get()).request_id
    task.cancel()
    assert (await asyncio.wait_for(engine.aborts.get(), 2)).request_ids == [rid]


async def test_client_abort_ends_generate(pair):
    engine, client = pair
    task = asyncio.create_task(collect(client.generate([5], SamplingParams(), "r5")))
    rid = (await engine.adds.get()).request_id
    await client.abort("r5")
    outs = await task
    assert outs[-1].finish_reason == "abort"
    assert (await engine.aborts.get()).request_ids == [rid]


async def test_reused_id_after_abort_gets_its_own_generation(pair, tok):
    """The id is the caller's, the engine's ids are fresh: the aborted request's late tokens and
    final abort (sent by the engine after the reuse began) never reach the new request."""
    engine, client = pair
    old = asyncio.create_task(collect(client.generate([5], SamplingParams(max_tokens=50), "same")))
    old_id = (await engine.adds.get()).request_id
    await client.abort("same")
    assert (await old)[-1].finish_reason == "abort"
    new = asyncio.create_task(collect(client.generate([6], SamplingParams(max_tokens=2), "same")))
    new_id = (await engine.adds.get()).request_id
    assert new_id != old_id and new_id.startswith("same@")
    await engine.deltas(RequestDelta(old_id, [100, 101]))  # late: the engine had not seen the abort yet
    await engine.deltas(RequestDelta(old_id, finish_reason="abort"))
    await engine.deltas(RequestDelta(new_id, ids(tok, " fresh"), finish_reason="length"))
    outs = await new
    assert outs[-1].finish_reason == "length" and outs[-1].output_text == " fresh"
    assert [t for o in outs for t in o.token_ids] == ids(tok, " fresh")


async def test_n_fans_out_with_seed_offsets(pair, tok):
    engine, client = pair
    task = asyncio.create_task(collect(client.generate([5], SamplingParams(n=3, seed=7, max_tokens=2), "r6")))
    adds = [await engine.adds.get() for _ in range(3)]
    base = adds[0].request_id.rsplit("-", 1)[0]
    assert base.startswith("r6@") and [a.request_id for a in adds] == [f"{base}-{i}" for i in range(3)]
    assert [a.params.seed for a in adds] == [7, 8, 9] and all(a.params.n == 1 for a in adds)
    for i, a in enumerate(adds):
        await engine.deltas(RequestDelta(a.request_id, ids(tok, f" c{i}"), finish_reason="length"))
    outs = await task
    assert sorted((o.index, o.output_text) for o in outs) == [(0, " c0"), (1, " c1"), (2, " c2")]
    assert {o.request_id for o in outs} == {"r6"}


async def test_engine_error_delta(pair):
    engine, client = pair
    task = asyncio.create_task(collect(client.generate([5], SamplingParams(), "r7")))
    rid = (await engine.adds.get()).request_id
    await engine.deltas(RequestDelta(rid, finish_reason="error", error="boom"))
    outs = await task
    assert outs[-1].finish_reason == "error" and outs[-1].error == "boom"
    assert not client.dead


async def test_engine_dead_fails_in_flight(pair):
    engine, client = pair
    task = asyncio.create_task(collect(client.generate([5], SamplingParams(), "r8")))
    await engine.adds.get()
    await engine.send(EngineDead("worker 0 crashed"))
    outs = await task
    assert outs[-1].finish_reason == "error" and "worker 0 crashed" in outs[-1].error
    assert client.dead
    with pytest.raises(EngineDeadError):
        client.generate([5], SamplingParams())


async def test_silent_engine_is_detected(pair):
    engine, client = pair
    engine.answer_pings = False
    task = asyncio.create_task(collect(client.generate([5], SamplingParams(), "r9")))
    await engine.adds.get()
    outs = await asyncio.wait_for(task, 5)
    assert outs[-1].finish_reason == "error" and "unresponsive" in outs[-1].error
    assert client.dead


async def test_pings_keep_a_slow_engine_alive(pair):
    engine, client = pair
    task = asyncio.create_task(collect(client.generate([5], SamplingParams(), "r10")))
    rid = (await engine.adds.get()).request_id
    await asyncio.sleep(1.5)  # several ping periods with no outputs, but pings answered
    assert not task.done()
    await engine.deltas(RequestDelta(rid, [7], finish_reason="length"))
    assert (await task)[-1].finish_reason == "length"


async def test_fail_all(pair):
    engine, client = pair
    tasks = [asyncio.create_task(collect(client.generate([5], SamplingParams(), f"f{i}"))) for i in range(3)]
    for _ in tasks:
        await engine.adds.get()
    client.fail_all("engine failure: worker-0: exited")
    for t in tasks:
        out = (await t)[-1]
        assert out.finish_reason == "error" and "worker-0" in out.error


async def test_validation(pair, tok):
    _, client = pair
    with pytest.raises(ParamError) as e:
        client.generate(list(range(1, 70)), SamplingParams())
    assert e.value.param == "input_tokens" and "64" in str(e.value) and "69" in str(e.value)
    with pytest.raises(ParamError) as e:
        client.generate(list(range(1, 60)), SamplingParams(max_tokens=10))
    assert e.value.param == "max_tokens" and "10 > 64 - 59" in str(e.value)
    with pytest.raises(ParamError) as e:
        client.generate([1], SamplingParams(temperature=-1))
    assert e.value.param == "temperature"
    with pytest.raises(ParamError):
        client.generate([], SamplingParams())
    assert client.validate(list(range(1, 11)), SamplingParams(max_tokens=None)).max_tokens == 54


async def test_connect_times_out(tmp_path, tok):
    with pytest.raises(TimeoutError, match="EngineInfo"):
        await AsyncEngineClient.connect(f"ipc://{tmp_path}/nobody", timeout=0.5, tokenizer=tok)


async def test_request_id_in_flight_is_refused(pair):
    """A second request may not reuse an id in flight (abort(id) would be ambiguous); an id that
    looks like another's choice (`r9-1`) is just another id; the first request is untouched."""
    engine, client = pair
    task = asyncio.create_task(collect(client.generate([5], SamplingParams(n=2, max_tokens=2), "r9")))
    adds = [await engine.adds.get() for _ in range(2)]
    with pytest.raises(ParamError, match="already in flight"):
        client.generate([6], SamplingParams(), "r9")
    # two generate() calls may both pass the early check; the one that starts second is refused
    first, second = client.generate([7], SamplingParams(), "r10"), client.generate([8], SamplingParams(), "r10")
    t10 = asyncio.create_task(collect(first))
    a10 = await engine.adds.get()
    assert a10.request_id.startswith("r10@")
    with pytest.raises(ParamError, match="already in flight"):
        await collect(second)
    for a in adds + [a10]:
        await engine.deltas(RequestDelta(a.request_id, [100], finish_reason="length"))
    assert len(await task) == 2 and len(await t10) == 1
    assert engine.adds.empty() and client.num_in_flight == 0
    again = asyncio.create_task(collect(client.generate([6], SamplingParams(), "r9")))  # free once finished
    rid = (await engine.adds.get()).request_id
    assert rid.startswith("r9@") and rid not in {a.request_id for a in adds}
    await engine.deltas(RequestDelta(rid, [100], finish_reason="length"))
    assert (await again)[-1].finish_reason == "length"
