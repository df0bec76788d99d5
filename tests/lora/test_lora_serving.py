"""Multi-LoRA serving over HTTP, as vLLM's users drive it: `--enable-lora --lora-modules a=... b=...`,
`model` picks the adapter, `/v1/models` lists them, `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` change them at run time.

Adapters are random PEFT LoRAs (every Llama projection, B non-zero) on a tiny Llama; each served
text must equal transformers' greedy text with that adapter merged into the base
(`PeftModel.from_pretrained(base, dir).merge_and_unload()`). The first tests (names, flags) run
without starting an engine; the rest start the real server (tests/frontends/server.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import hf_greedy, make_tiny_model
from frontends.server import REPO, serve

from axonserve.lora.adapter import LoraError
from axonserve.lora.registry import (
    MAX_LORA_NAME_CHARS,
    LoraModule,
    LoraRegistry,
    check_name,
    check_startup_modules,
    parse_lora_module,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ("Once upon a time", "The capital of France is", "def fibonacci(n):")
CHAT = [{"role": "user", "content": "Tell me a story"}]
N_NEW = 10
KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


# --------------------------------------------------------------------------- fixtures


def make_adapter(model_dir: str, out_dir: str, seed: int, r: int = 8) -> str:
    """A random PEFT LoRA on every projection (init_lora_weights=False: B is not zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir) -> str:
    # N(0, 0.1) weights: logits well apart, so greedy texts have no near-ties; 4 query / 2 KV heads split over 2 ranks
    return make_tiny_model(str(tmp_path_factory.mktemp("lora-base")), "LlamaForCausalLM", tokenizer_dir=smollm2_dir)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(model_dir, str(root / name), seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}


@pytest.fixture(scope="module")
def bad_adapters(tmp_path_factory, model_dir) -> dict[str, str]:
    """Directories an admin might point at by mistake (or a client on purpose)."""
    root = tmp_path_factory.mktemp("bad-adapters")
    high = make_adapter(model_dir, str(root / "rank32"), 4, r=32)  # above --max-lora-rank 16
    missing = make_adapter(model_dir, str(root / "no-weights"), 5)
    os.unlink(os.path.join(missing, "adapter_model.safetensors"))
    junk = make_adapter(model_dir, str(root / "junk"), 6)
    with open(os.path.join(junk, "adapter_config.json"), "w") as f:
        f.write("{not json")
    other = make_tiny_model(str(root / "other-base"), "LlamaForCausalLM", intermediate_size=96)
    shape = make_adapter(other, str(root / "other-shape"), 7)  # made for another base model
    return {"rank": high, "missing": missing, "junk": junk, "shape": shape, "nowhere": str(root / "does-not-exist")}


def transformers_texts(model_dir: str, adapter: str | None, n: int = N_NEW) -> dict[str, str]:
    """prompt -> greedy text of the base model with `adapter` merged (None: the base), and
    "chat" -> the same for the chat prompt, rendered by the model's template."""
    import torch
    from transformers import AutoModelForCausalLM

    from axonserve.frontends.tokenizer import Tokenizer

    tok = Tokenizer.load(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    out = {p: tok.decode(hf_greedy(model, tok.encode(p), n)) for p in PROMPTS}
    out["chat"] = tok.decode(hf_greedy(model, tok.encode_chat(CHAT, add_generation_prompt=True), n))
    return out


@pytest.fixture(scope="module")
def want(model_dir, adapters) -> dict[str | None, dict[str, str]]:
    texts = {name: transformers_texts(model_dir, path) for name, path in adapters.items()}
    texts[None] = transformers_texts(model_dir, None)
    for name in adapters:  # the adapters really change the model
        assert texts[name] != texts[None], name
    assert texts["a"] != texts["b"]
    return texts


def complete(http: httpx.Client, model: str, prompt, **kw) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": N_NEW, "min_tokens": N_NEW, "temperature": 0, **kw}
    return http.post("/v1/completions", json=body)


def completion_text(http: httpx.Client, model: str, prompt: str) -> str:
    r = complete(http, model, prompt)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def chat_text(http: httpx.Client, model: str, stream: bool = False) -> str:
    body = {"model": model, "messages": CHAT, "max_tokens": N_NEW, "min_tokens": N_NEW, "temperature": 0}
    if not stream:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                assert chunk["model"] == model
                text += chunk["choices"][0]["delta"].get("content") or ""
    return text


def assert_error(r: httpx.Response, status: int, words: str = "") -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    assert words.lower() in err["message"].lower(), err


def serve_lora(model_dir: str, adapters: dict[str, str], *extra: str, names=("a", "b"), **kw):
    mods = [f"{n}={adapters[n]}" for n in names]
    args = ("--served-model-name", "tiny", "--num-kv-blocks", "256", "--max-num-seqs", "16")
    return serve(model_dir, *args, "--enable-lora", "--lora-modules", *mods, "--max-loras", "2", *extra, **kw)


# --------------------------------------------------------------------------- registry and flags (no engine)


def test_lora_modules_parse_both_forms():
    assert parse_lora_module("sql-lora=/p/q") == LoraModule("sql-lora", "/p/q")
    assert parse_lora_module("a=/p=q") == LoraModule("a", "/p=q")  # the first = splits
    j = parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "tiny"}')
    assert j == LoraModule("a", "/p", "tiny")
    assert parse_lora_module(j.to_arg()) == j and parse_lora_module("a=/p").to_arg() == "a=/p"
    for bad in ("a", "=/p", "a=", '{"name": "a"}', '{"name": "a", "path": "/p", "x": 1}', "{nope", "[1]"):
        with pytest.raises(LoraError):
            parse_lora_module(bad)


def test_adapter_names_are_bounded():
    assert check_name("org/sql-lora_v2.1:x@y+z") == "org/sql-lora_v2.1:x@y+z"
    bad = ("", "a b", "-a", "a\nb", "ü", "a" * (MAX_LORA_NAME_CHARS + 1), 3, None, "a\x00")
    for name in bad:
        with pytest.raises(LoraError):
            check_name(name)
    with pytest.raises(LoraError, match="base model"):
        check_name("tiny", {"tiny"})


def test_registry_ids_are_never_reused():
    reg = LoraRegistry({"tiny", "/models/tiny"}, "tiny", max_adapters=2)
    a = reg.add("a", "/x/a")
    b = reg.add("b", "rel/b", base_model_name="tiny")
    assert (a.lora_id, b.lora_id) == (1, 2) and b.path == os.path.abspath("rel/b")
    assert reg.get("a") == a and reg.get("tiny") is None and reg.get(None) is None
    with pytest.raises(LoraError, match="already been loaded"):
        reg.add("a", "/x/a")
    with pytest.raises(LoraError, match="at most 2"):
        reg.add("c", "/x/c")
    with pytest.raises(LoraError, match="base model"):
        reg.check_new("/models/tiny")
    assert reg.remove("a") == a and reg.remove("a") is None and "a" not in reg
    again = reg.add("a", "/x/a")  # the same name back: a new id (prefix cache and slots never mix versions)
    assert again.lora_id == 3 and again.path == a.path
    assert [e.parent for e in reg.entries()] == ["tiny", "tiny"]


def test_startup_modules_are_validated(model_dir, adapters, bad_adapters):
    got = check_startup_modules(
        [f"a={adapters['a']}", json.dumps({"name": "b", "path": adapters["b"], "base_model_name": "tiny"})],
        enable_lora=True,
        max_lora_rank=16,
        model_dir=model_dir,
        base_names={"tiny", model_dir},
    )
    assert got == [f"a={adapters['a']}", LoraModule("b", adapters["b"], "tiny").to_arg()]
    kw = dict(enable_lora=True, max_lora_rank=16, model_dir=model_dir, base_names={"tiny"})
    cases = [
        ([f"a={bad_adapters['rank']}"], "max-lora-rank"),
        ([f"a={bad_adapters['missing']}"], "adapter_model.safetensors"),
        ([f"a={bad_adapters['junk']}"], "not valid JSON"),
        ([f"a={bad_adapters['nowhere']}"], "not a directory"),
        ([f"a={bad_adapters['shape']}"], "the base model needs"),
        ([f"tiny={adapters['a']}"], "base model"),
        ([f"a={adapters['a']}", f"a={adapters['b']}"], "twice"),
    ]
    for texts, words in cases:
        with pytest.raises(ValueError, match=words):
            check_startup_modules(texts, **kw)
    with pytest.raises(ValueError, match="--enable-lora"):
        check_startup_modules([f"a={adapters['a']}"], **{**kw, "enable_lora": False})


@pytest.mark.timeout(300)
def test_bad_lora_flags_exit_2(model_dir, adapters, bad_adapters):
    """Refused by the launcher before any process starts, with the reason, as other bad flags are."""
    cases = [
        (["--lora-modules", f"a={adapters['a']}"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", f"a={bad_adapters['rank']}"], "exceeds --max-lora-rank 16"),
        (["--enable-lora", "--lora-modules", f"tiny={adapters['a']}"], "base model"),
        (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
    ]
    for flags, words in cases:
        cmd = [sys.executable, "-m", "axonserve.cli", "serve", model_dir, "--served-model-name", "tiny", *flags]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (flags, r.stdout[-2000:], r.stderr[-2000:])
        assert words in r.stdout + r.stderr, (flags, r.stdout[-2000:], r.stderr[-2000:])


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(model_dir, adapters, want):
    """Adapters a and b from the start, runtime updating on, behind an API key."""
    with serve_lora(model_dir, adapters, "--allow-runtime-lora-updating", "--api-key", KEY) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120, headers=AUTH) as c:
        yield c


@pytest.mark.timeout(600)
def test_concurrent_adapters_equal_transformers(http, want):
    """Requests for a, b and the base model at once (they share steps): each its own model's text."""
    jobs = [(m, p) for p in PROMPTS for m in ("a", "b", "tiny")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: completion_text(http, *job), jobs))
    for (m, p), text in zip(jobs, got):
        assert text == want[None if m == "tiny" else m][p], (m, p)


@pytest.mark.timeout(600)
def test_chat_batch_prompts_and_n_carry_the_adapter(http, want):
    jobs = [("a", False), ("a", True), ("b", True), ("tiny", True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: chat_text(http, *job), jobs))
    for (m, _), text in zip(jobs, got):
        assert text == want[None if m == "tiny" else m]["chat"], m
    # a batch of prompts, two choices each (greedy: equal), all with adapter b
    r = complete(http, "b", list(PROMPTS[:2]), n=2)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in choices] == [want["b"][p] for p in PROMPTS[:2] for _ in range(2)]
    # streamed completion
    text = ""
    body = {"model": "a", "prompt": PROMPTS[0], "max_tokens": N_NEW, "min_tokens": N_NEW, "temperature": 0}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == want["a"][PROMPTS[0]]


def test_models_lists_adapters(http, server, adapters):
    data = http.get("/v1/models").json()["data"]
    cards = {c["id"]: c for c in data}
    assert data[0]["id"] == "tiny" and data[0]["parent"] is None
    for name in ("a", "b"):
        assert cards[name]["parent"] == "tiny" and cards[name]["root"] == adapters[name]
        assert cards[name]["object"] == "model"
    assert httpx.get(server.base_url + "/v1/models").status_code == 401  # behind the key like the rest


def test_unknown_model_is_404(http):
    assert_error(complete(http, "no-such-adapter", "hi"), 404, "The model `no-such-adapter` does not exist.")
    r = http.post("/v1/chat/completions", json={"model": "A", "messages": CHAT})  # names are case-sensitive
    assert_error(r, 404, "does not exist")


@pytest.mark.timeout(600)
def test_load_serve_unload_at_run_time(http, server, adapters, want, model_dir):
    path = adapters["c"]
    # the key guards the admin routes too
    r = httpx.post(server.base_url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": path})
    assert r.status_code == 401
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": path})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully.", r.text
    assert "c" in {c["id"] for c in http.get("/v1/models").json()["data"]}
    assert completion_text(http, "c", PROMPTS[1]) == want["c"][PROMPTS[1]]
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": path}), 400, "already")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully.", r.text
    assert_error(complete(http, "c", "hi"), 404, "does not exist")
    assert "c" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
    assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}), 404, "cannot be found")
    # the name comes back (a fresh id), from another directory: the new adapter's text, not the old one's
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["b"]})
    assert r.status_code == 200, r.text
    assert completion_text(http, "c", PROMPTS[1]) == want["b"][PROMPTS[1]]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200


@pytest.mark.timeout(600)
def test_unload_while_running_finishes_the_request(http, model_dir, adapters):
    """A stream for c keeps its adapter after c is unloaded mid-stream (the engine holds its spec)."""
    n = 24
    ref = transformers_texts(model_dir, adapters["c"], n)[PROMPTS[2]]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]}).status_code == 200
    body = {"model": "c", "prompt": PROMPTS[2], "max_tokens": n, "min_tokens": n, "temperature": 0, "stream": True}
    text, finish, unloaded = "", None, False
    with http.stream("POST", "/v1/completions", json=body) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text, finish = text + choice["text"], choice["finish_reason"] or finish
            if not unloaded:  # after the first chunk: the request is in the engine
                r = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
                assert r.status_code == 200, r.text
                unloaded = True
    assert unloaded and finish == "length" and text == ref
    assert_error(complete(http, "c", "hi"), 404)


@pytest.mark.timeout(300)
def test_bad_adapters_are_400_and_the_server_keeps_serving(http, bad_adapters, adapters, want):
    cases = [
        ({"lora_name": "bad", "lora_path": bad_adapters["rank"]}, 400, "max-lora-rank"),
        ({"lora_name": "bad", "lora_path": bad_adapters["missing"]}, 400, "adapter_model.safetensors"),
        ({"lora_name": "bad", "lora_path": bad_adapters["junk"]}, 400, "not valid json"),
        ({"lora_name": "bad", "lora_path": bad_adapters["nowhere"]}, 400, "not a directory"),
        ({"lora_name": "bad", "lora_path": bad_adapters["shape"]}, 400, "the base model needs"),
        ({"lora_name": "bad", "lora_path": "x" * 5000}, 400, "adapter path"),
        ({"lora_name": "tiny", "lora_path": adapters["c"]}, 400, "base model"),
        ({"lora_name": "a b", "lora_path": adapters["c"]}, 400, "adapter name"),
        ({"lora_name": "a", "lora_path": adapters["c"]}, 400, "already been loaded"),
        ({"lora_name": "bad"}, 400, "must be provided"),
        ({"lora_name": 7, "lora_path": adapters["c"]}, 400, ""),
        ({"lora_name": "bad", "lora_path": adapters["c"], "extra": 1}, 400, "extra"),
    ]
    for body, status, words in cases:
        assert_error(http.post("/v1/load_lora_adapter", json=body), status, words)
    assert_error(http.post("/v1/load_lora_adapter", content=b"{nope"), 400)
    assert_error(http.post("/v1/unload_lora_adapter", json={}), 400, "lora_name")
    assert "bad" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
    assert completion_text(http, "a", PROMPTS[0]) == want["a"][PROMPTS[0]]


@pytest.mark.timeout(300)
def test_adapter_broken_after_loading_fails_only_its_requests(http, adapters, want, tmp_path):
    """A directory that passed the load check and is then corrupted (or moved) before a rank reads
    its weights: that request is a 400 error JSON, streamed or not, and everyone else is served."""
    import shutil

    path = shutil.copytree(adapters["c"], str(tmp_path / "d"))
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": path}).status_code == 200
    with open(os.path.join(path, "adapter_model.safetensors"), "r+b") as f:
        f.truncate(64)
    assert_error(complete(http, "d", PROMPTS[0]), 400)
    r = complete(http, "d", PROMPTS[0], stream=True)
    assert_error(r, 400)
    assert completion_text(http, "a", PROMPTS[0]) == want["a"][PROMPTS[0]]
    assert completion_text(http, "tiny", PROMPTS[0]) == want[None][PROMPTS[0]]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200


@pytest.mark.timeout(600)
def test_two_ranks_serve_adapters(model_dir, adapters, want):
    """Tensor parallel over 2 ranks, two adapters and the base model at once; without runtime
    updating the load/unload routes are not there (404, as in vLLM)."""
    with serve_lora(model_dir, adapters, "--tensor-parallel-size", "2") as srv:
        with httpx.Client(base_url=srv.base_url, timeout=120) as http:
            jobs = [(m, p) for p in PROMPTS for m in ("a", "b", "tiny")]
            with ThreadPoolExecutor(len(jobs)) as pool:
                got = list(pool.map(lambda job: completion_text(http, *job), jobs))
            for (m, p), text in zip(jobs, got):
                assert text == want[None if m == "tiny" else m][p], (m, p)
            body = {"lora_name": "c", "lora_path": adapters["c"]}
            assert_error(http.post("/v1/load_lora_adapter", json=body), 404)
            assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}), 404)
            assert completion_text(http, "a", PROMPTS[0]) == want["a"][PROMPTS[0]]  # a still there


@pytest.mark.timeout(300)
def test_lora_off_never_serves_an_adapter_name(model_dir, adapters):
    """Without --enable-lora an adapter's name is an unknown model (never the base model's text);
    vLLM's environment switch alone neither mounts the load route nor stops the server starting."""
    args = ("--served-model-name", "tiny", "--num-kv-blocks", "64")
    with serve(model_dir, *args, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=120) as http:
            assert_error(complete(http, "a", "hi"), 404, "does not exist")
            body = {"lora_name": "a", "lora_path": adapters["a"]}
            assert_error(http.post("/v1/load_lora_adapter", json=body), 404)
            assert [c["id"] for c in http.get("/v1/models").json()["data"]] == ["tiny"]
