"""Images through the OpenAI chat API on a real server with an encoder pool of 2: outputs
equal transformers' LLaVA, a repeated image is an encoder-cache hit (Prometheus counter),
http(s) image URLs only from allowed hosts, and bad images are OpenAI-error 400s."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import functools
import http.server as http_server
import threading

import httpx
import pytest
from conftest import data_url, hf_llava_greedy, png_bytes
from frontends.server import serve
from frontends.test_openai_api import _error, _metric
from integration.test_faults import wait_until

from multimodal.test_llava_engine import render

N = 6


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server for image URLs: /img/<seed>.png is png_bytes(seed)."""

    class Handler(http_server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path.startswith("/redirect"):
                self.send_response(302)
                self.send_header("Location", "http://images.example.com/cat.png")
                self.end_headers()
                return
            seed = int(self.path.rsplit("/", 1)[1].split(".")[0])
            body = png_bytes(seed)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def server(tiny_llava_dir):
    args = (
        "--encoder-workers",
        "2",
        "--served-model-name",
        "m",
        "--num-kv-blocks",
        "400",
        "--block-size",
        "4",
        "--max-model-len",
        "256",
        "--allowed-media-domains",
        "127.0.0.1",
        "--max-images-per-request",
        "3",
        "--threads",
        "1",
        "--max-image-bytes",
        "200000",
        "--allow-private-image-urls",
    )  # the test's image host is on the loopback
    with serve(tiny_llava_dir, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(http: httpx.Client, *parts, n: int = N) -> httpx.Response:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return post_chat(http, content, n)


def post_chat(http: httpx.Client, content: list, n: int = N) -> httpx.Response:
    return http.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": n,
            "min_tokens": n,
            "temperature": 0,
        },
    )


@functools.lru_cache(maxsize=None)
def reference(model_dir: str, parts: tuple) -> str:
    """transformers' greedy text for a user message of text parts and image-seed parts (ints)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msg = [{"role": "user", "content": as_parts(parts)}]
    text, imgs = render(tok, msg, "<image>")
    _, toks = hf_llava_greedy(model_dir, text, imgs, N)
    return tok.decode(toks, skip_special_tokens=True)


def as_parts(parts: tuple) -> list:
    """Content parts for text (str) and image seeds (int)."""
    return [{"type": "text", "text": p} if isinstance(p, str) else image_part(data_url(png_bytes(p))) for p in parts]


@pytest.mark.timeout(300)
def test_concurrent_image_and_text_chats_match_transformers(http, tiny_llava_dir):
    cases = [
        ("What is in ", 11, "?"),
        ("Compare ", 12, " with ", 13, "."),
        ("No picture here, just words.",),
        (14, "Caption it."),
    ]
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        resps = list(pool.map(lambda c: ask(http, *as_parts(c)), cases))
    for case, r in zip(cases, resps):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == reference(tiny_llava_dir, case)


@pytest.mark.timeout(120)
def test_repeated_image_is_an_encoder_cache_hit(http, tiny_llava_dir):
    hits0 = _metric(http, "axonserve:mm_encoder_cache_hits_total")
    first = ask(http, "One: ", image_part(data_url(png_bytes(21))))
    again = ask(http, "Two: ", image_part(data_url(png_bytes(21))))
    assert first.status_code == again.status_code == 200
    assert again.json()["choices"][0]["message"]["content"] == reference(tiny_llava_dir, ("Two: ", 21))
    wait_until(lambda: _metric(http, "axonserve:mm_encoder_cache_hits_total") >= hits0 + 1, 10, "a cache hit")


@pytest.mark.timeout(120)
def test_image_url_from_an_allowed_host(http, tiny_llava_dir, image_host):
    r = ask(http, "What is in ", image_part(f"{image_host}/img/11.png"), "?")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == reference(tiny_llava_dir, ("What is in ", 11, "?"))


def test_image_url_redirects_are_not_followed(http, image_host):
    assert (
        "redirects are not followed"
        in _error(ask(http, "Look: ", image_part(f"{image_host}/redirect")), 400)["message"]
    )


@pytest.mark.parametrize(
    "url, why",
    [
        ("https://images.example.com/cat.png", "not in --allowed-media-domains"),
        ("ftp://127.0.0.1/cat.png", "scheme"),
        ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"this is not an image").decode(), "cannot decode the image"),
        ("data:text/plain;base64,aGVsbG8=", "data:image/"),
        ("data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * 300_000).decode(), "larger than"),
    ],
)
def test_bad_images_are_400(http, server, url, why):
    r = ask(http, "Look: ", image_part(url))
    assert why in _error(r, 400)["message"]


def test_image_limits_and_stray_image_tokens_are_400(http):
    img = image_part(data_url(png_bytes(1)))
    assert "at most 3 images" in _error(ask(http, img, img, img, img), 400)["message"]
    assert "image tokens" in _error(ask(http, "text with <image> in it ", img), 400)["message"]
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
    )
    assert _error(r, 400)
    assert http.get("/health").status_code == 200
