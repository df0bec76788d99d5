"""`POST /v1/embeddings` end to end: `axonserve serve all-MiniLM-L6-v2` (the real model, picked
as an embed-task model from its architecture) and the official `openai` client. Vectors must
equal transformers + sentence-transformers' mean pooling + normalize to 1e-5."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch
from embedding_reference import hf_encoder, minilm_dir, st_embed

from .server import REPO, serve

pytestmark = pytest.mark.timeout(300)
ATOL = 1e-5
NAME = "minilm"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences to vectors.",
    "Hi",
    "A considerably longer sentence, with punctuation; numbers like 3.14159 and 2026.",
]


@pytest.fixture(scope="module")
def server():
    with serve("all-MiniLM-L6-v2", "--served-model-name", NAME, "--max-num-seqs", "16") as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, **body) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/embeddings", json={"model": NAME, **body}, timeout=60)


def vectors(resp) -> torch.Tensor:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return torch.tensor([d.embedding for d in resp.data], dtype=torch.float32)


def tokens(text: str) -> list[int]:
    return hf_encoder(minilm_dir())[1].encode(text)


def test_models_lists_the_embedding_model(server):
    card = httpx.get(server.base_url + "/v1/models").json()["data"][0]
    assert card["id"] == NAME and card["max_model_len"] == 512


def test_single_and_batch_match_transformers(oai):
    one = oai.embeddings.create(model=NAME, input=TEXTS[0])  # the client asks for base64 by default
    assert one.object == "list" and one.model == NAME and len(one.data[0].embedding) == 384
    torch.testing.assert_close(vectors(one)[0], st_embed(minilm_dir(), TEXTS[:1])[0], atol=ATOL, rtol=0)
    assert one.usage.prompt_tokens == len(tokens(TEXTS[0])) == one.usage.total_tokens
    batch = oai.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    torch.testing.assert_close(vectors(batch), st_embed(minilm_dir(), TEXTS), atol=ATOL, rtol=0)
    assert batch.usage.prompt_tokens == sum(len(tokens(t)) for t in TEXTS)


def test_token_id_inputs(oai):
    ids = [tokens(t) for t in TEXTS[:2]]
    single = oai.embeddings.create(model=NAME, input=ids[0], encoding_format="float")
    many = oai.embeddings.create(model=NAME, input=ids, encoding_format="float")
    ref = st_embed(minilm_dir(), TEXTS[:2])
    torch.testing.assert_close(vectors(single)[0], ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(vectors(many), ref, atol=ATOL, rtol=0)
    assert many.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_base64_is_the_float32_bytes_of_the_float_answer(server):
    f = post(server, input=TEXTS[1], encoding_format="float").json()
    b = post(server, input=TEXTS[1], encoding_format="base64").json()
    raw = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    assert raw.tolist() == np.asarray(f["data"][0]["embedding"], dtype=np.float32).tolist()
    assert f["usage"] == b["usage"] == {"prompt_tokens": len(tokens(TEXTS[1])), "total_tokens": len(tokens(TEXTS[1]))}


def test_normalize_false_gives_the_raw_mean(server):
    r = post(server, input=TEXTS[:2], encoding_format="float", normalize=False)
    got = torch.tensor([d["embedding"] for d in r.json()["data"]])
    torch.testing.assert_close(got, st_embed(minilm_dir(), TEXTS[:2], normalize=False), atol=ATOL, rtol=0)
    assert (got.norm(dim=-1) - 1).abs().min() > 1e-3


def test_concurrent_requests_batch_and_still_match(server):
    texts = [f"{t} (variant {i})" for i in range(3) for t in TEXTS]
    aoai = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def run():
        return await asyncio.gather(*(aoai.embeddings.create(model=NAME, input=t) for t in texts))

    outs = asyncio.run(run())
    got = torch.stack([vectors(o)[0] for o in outs])
    torch.testing.assert_close(got, st_embed(minilm_dir(), texts), atol=ATOL, rtol=0)


def test_longest_prompt_fits_one_more_is_400_with_the_numbers(oai, server):
    ids = [101] + [2088] * 510 + [102]  # 512 tokens: every position
    r = oai.embeddings.create(model=NAME, input=ids, encoding_format="float")
    assert r.usage.prompt_tokens == 512 and len(r.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model=NAME, input=[ids + [2088]])
    assert "512" in e.value.message and "513" in e.value.message
    long_text = "word " * 600
    resp = post(server, input=["short", long_text])
    assert resp.status_code == 400 and "512" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "hi", "dimensions": 128}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[101, 102], []]}, "input"),
        ({"input": [101, 99999, 102]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
        ({"input": ["hi"] * 129}, "input"),  # --max-request-fanout (128): one request, at most 128 vectors
        ({"input": [[101, 102]] * 1000}, "input"),
        ({"input": "hi", "request_id": "a b"}, "request_id"),
    ],
)
def test_bad_requests_are_400(server, body, param):
    r = post(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and param in (err["param"] or err["message"])


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="nope", input="hi")


def test_generation_endpoints_refuse_an_embedding_model(oai):
    with pytest.raises(openai.BadRequestError, match="embedding model.*Completions API"):
        oai.completions.create(model=NAME, prompt="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="embedding model.*Chat Completions API"):
        oai.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])


def test_embeddings_refused_by_a_generate_model(tiny_llama_dir):
    with serve(tiny_llama_dir, "--served-model-name", "tiny", "--num-kv-blocks", "64", "--max-model-len", "128") as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="generative model.*Embeddings API"):
            client.embeddings.create(model="tiny", input="hello")
        assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).choices[0].text is not None


def test_task_flags():
    from axonserve.cli import requested_task

    assert requested_task("auto", "auto") == "auto"
    assert requested_task("auto", "pooling") == requested_task("embedding", "auto") == "embed"
    assert requested_task("generate", "generate") == "generate"
    with pytest.raises(ValueError, match="contradicts"):
        requested_task("generate", "pooling")
    cmd = [sys.executable, "-m", "axonserve.cli", "serve", "all-MiniLM-L6-v2", "--runner", "generate", "--port", "0"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "serves only the embed task" in r.stdout + r.stderr
