"""Hostile image inputs (issue 27): each is a fast OpenAI-error 400 from a real server, which
stays healthy and keeps serving a concurrent normal request.

Decompression bombs (a ~10 KB PNG declaring 10000x10000 pixels) are refused from the header,
before decoding; a request's decoded bytes are budgeted before each image is decoded; image
URLs resolving to loopback (or any private) address are refused after DNS unless
--allow-private-image-urls, without the image host ever being contacted; a server dripping a
byte a second is cut off at the total fetch deadline; an oversized body without
Content-Length is cut off while streaming; fetch errors never echo addresses or ports.

Two servers (strict: the defaults; lenient: --allow-private-image-urls, so the hostile image
host on 127.0.0.1 can be reached), plus unit tests of the same pieces without a server."""

from __future__ import annotations

import concurrent.futures as cf
import http.server as http_server
import io
import shutil
import struct
import subprocess
import threading
import time
import zlib
from collections import Counter

import httpx
import pytest
from conftest import data_url, png_bytes
from frontends.server import serve
from frontends.test_openai_api import _error

from axonserve.config import EngineConfig
from axonserve.multimodal import frontend as mm
from axonserve.protocol.messages import ParamError

FETCH_TIMEOUT_S = 2.0
BUDGET = 4_000_000  # decoded bytes per request on the strict server: two 800x800 RGB images, not three
SERVER_ARGS = (
    "--served-model-name",
    "m",
    "--num-kv-blocks",
    "400",
    "--block-size",
    "4",
    "--max-model-len",
    "256",
    "--threads",
    "1",
    "--image-fetch-timeout-s",
    str(FETCH_TIMEOUT_S),
    "--max-image-bytes",
    "200000",
)


# --------------------------------------------------------------------------- hostile inputs


def bomb_png(width: int, height: int) -> bytes:
    """A real decompression bomb: a 1-bit grayscale PNG of zeros, a few KB that Pillow would
    decode to width*height bytes (and to 3x that as RGB)."""
    z = zlib.compressobj(9)
    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def solid_png(width: int, height: int, color=(200, 30, 60)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


class ImageHost:
    """A local HTTP server for image URLs that misbehaves on request: /img.png (a good PNG),
    /drip (a byte a second), /dripheaders (a header line every half second), /big (1 MB of
    body, no Content-Length), /bigchunked (the same, chunked), /redirect. Counts hits by path."""

    def __init__(self):
        self.hits: Counter[str] = Counter()
        host = self

        class Handler(http_server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 - http.server's name
                path = self.path.split("?")[0]
                host.hits[path] += 1
                try:
                    self._serve(path)
                except OSError:  # the fetcher hung up on us: that is the point
                    pass
                self.close_connection = True

            def _serve(self, path: str) -> None:
                w = self.wfile
                if path == "/img.png":
                    body = png_bytes(11)
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    w.write(body)
                elif path == "/drip":
                    self.send_response(200)
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    for b in png_bytes(11)[:60]:
                        w.write(bytes([b]))
                        w.flush()
                        time.sleep(1)
                elif path == "/dripheaders":
                    w.write(b"HTTP/1.1 200 OK\r\n")
                    for i in range(60):
                        w.write(f"X-Drip-{i}: y\r\n".encode())
                        w.flush()
                        time.sleep(0.5)
                elif path in ("/big", "/bigchunked"):
                    chunked = path == "/bigchunked"
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    if chunked:
                        self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    block = b"\0" * 10_000
                    for _ in range(100):
                        w.write(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
                    if chunked:
                        w.write(b"0\r\n\r\n")
                elif path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", "http://10.0.0.1/cat.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

            def log_message(self, *args):
                pass

        self.srv = http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.srv.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture(scope="module")
def image_host():
    host = ImageHost()
    yield host
    host.close()


# --------------------------------------------------------------------------- without a server


@pytest.mark.parametrize(
    "addr, public",
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("::ffff:8.8.8.8", True),
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("255.255.255.255", False),
        ("240.0.0.1", False),
        ("192.0.2.1", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:169.254.169.254", False),
        ("2002:7f00:1::1", False),
        ("64:ff9b::a00:1", False),
        ("not-an-ip", False),
    ],
)
def test_address_classes(addr, public):
    assert mm.is_public_address(addr) is public


def cfg(**kw) -> EngineConfig:
    base = dict(
        model="",
        allowed_media_domains=["127.0.0.1", "localhost"],
        image_fetch_timeout_s=FETCH_TIMEOUT_S,
        max_image_bytes=200_000,
    )
    return EngineConfig(**{**base, **kw})


@pytest.fixture
def loads(monkeypatch):
    """Counts Pillow decodes (ImageFile.load), to show a refused image was never decoded."""
    from PIL import ImageFile

    calls = []
    real = ImageFile.ImageFile.load

    def load(self):
        if self.tile:  # something left to decode
            calls.append(self.size)
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


def test_bomb_is_refused_from_its_header(loads):
    bomb = bomb_png(10_000, 10_000)
    assert len(bomb) < 50_000
    t0 = time.monotonic()
    with pytest.raises(ParamError, match="10000x10000 pixels") as e:
        mm.load_image(data_url(bomb), cfg())
    assert e.value.param == "messages" and time.monotonic() - t0 < 2 and loads == []
    with pytest.raises(ParamError, match="pixels"):  # past PIL's own bomb limit too
        mm.load_image(data_url(bomb_png(20_000, 20_000)), cfg())
    with pytest.raises(ParamError, match="pixels"):  # the cap is the flag's
        mm.load_image(data_url(solid_png(100, 100)), cfg(max_image_pixels=9_999))


def test_decode_budget_is_charged_before_decoding(loads):
    budget = mm.DecodeBudget(BUDGET)
    img = data_url(solid_png(800, 800))
    mm.load_image(img, cfg(), budget)
    mm.load_image(img, cfg(), budget)
    assert budget.used == 2 * 800 * 800 * 3 and len(loads) == 2
    with pytest.raises(ParamError, match="decode to more than") as e:
        mm.load_image(img, cfg(), budget)
    assert e.value.param == "messages" and len(loads) == 2  # the third was never decoded


def test_only_the_first_frame_of_an_animation_is_decoded():
    from PIL import Image

    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=10)
    img = mm.load_image(data_url(buf.getvalue(), "image/gif"), cfg())
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (255, 0, 0)


def test_fetch_checks_the_resolved_address(image_host):
    before = sum(image_host.hits.values())
    for host in ("127.0.0.1", "localhost"):
        with pytest.raises(ParamError, match="private, loopback or link-local") as e:
            mm.load_image(image_host.url("/img.png", host), cfg())
        assert "127.0.0.1" not in str(e.value) and str(image_host.port) not in str(e.value)
    assert sum(image_host.hits.values()) == before  # never contacted
    img = mm.load_image(image_host.url("/img.png"), cfg(allow_private_image_urls=True))
    assert img.size == (40, 48)


def test_fetch_deadline_is_total(image_host):
    """Headers dripped every 0.5 s: each read is well within any per-read timeout, the whole is not."""
    t0 = time.monotonic()
    with pytest.raises(ParamError, match="could not fetch image: timed out"):
        mm.load_image(image_host.url("/dripheaders"), cfg(allow_private_image_urls=True))
    assert time.monotonic() - t0 < FETCH_TIMEOUT_S + 1.5


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_connects_to_the_checked_address_with_the_urls_host_name(tmp_path, monkeypatch):
    """https://localhost:PORT: resolved and checked here, connected to by address, while SNI, the
    certificate check and the Host header still name `localhost`."""
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    seen = {}
    body = png_bytes(5)

    class Handler(http_server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen["host"] = self.headers["Host"]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    ctx.sni_callback = lambda sock, name, _ctx: seen.__setitem__("sni", name)
    srv = http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    real_context = ssl.create_default_context
    monkeypatch.setattr(mm.ssl, "create_default_context", lambda: real_context(cafile=str(cert)))
    try:
        c = cfg(allow_private_image_urls=True)
        assert mm.load_image(f"https://localhost:{port}/img.png", c).size == (40, 48)
        assert seen == {"sni": "localhost", "host": f"localhost:{port}"}
        with pytest.raises(ParamError, match="could not fetch image: TLS failed"):  # the cert names localhost only
            mm.load_image(f"https://127.0.0.1:{port}/img.png", c)
        with pytest.raises(ParamError, match="private"):
            mm.load_image(f"https://localhost:{port}/img.png", cfg())
    finally:
        srv.shutdown()
        srv.server_close()


# --------------------------------------------------------------------------- real servers


def post_chat(http: httpx.Client, content: list, n: int = 2) -> httpx.Response:
    return http.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": n, "temperature": 0},
    )


def img(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def normal_chat(http: httpx.Client) -> None:
    r = post_chat(
        http, [{"type": "text", "text": "What is in "}, img(data_url(png_bytes(3))), {"type": "text", "text": "?"}]
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def refused(http: httpx.Client, content: list, why: str, within: float, port: int | None = None) -> dict:
    """A 400 OpenAI error naming `messages` whose message holds `why`, answered within `within`
    seconds while a normal image chat runs alongside; /health is 200 afterwards."""
    with cf.ThreadPoolExecutor(2) as pool:
        t0 = time.monotonic()
        hostile = pool.submit(post_chat, http, content)
        normal = pool.submit(normal_chat, http)
        r = hostile.result()
        took = time.monotonic() - t0
        normal.result()
    err = _error(r, 400)
    assert why in err["message"] and err["param"] == "messages" and err["type"] == "BadRequestError", err
    assert took < within, f"{took:.1f}s: {err}"
    if port is not None:  # nothing of the connection is echoed
        assert "127.0.0.1" not in err["message"] and str(port) not in err["message"], err
    assert http.get("/health").status_code == 200
    return err


@pytest.fixture(scope="module")
def strict(tiny_llava_dir):
    args = (
        *SERVER_ARGS,
        "--allowed-media-domains",
        "127.0.0.1",
        "localhost",
        "--max-image-decoded-bytes-per-request",
        str(BUDGET),
    )
    with serve(tiny_llava_dir, *args) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        yield c
        assert srv.proc.poll() is None, srv.log_tail()


@pytest.mark.timeout(240)
def test_strict_server_refuses_bombs_budgets_and_private_urls(strict, image_host):
    bomb = data_url(bomb_png(10_000, 10_000))
    refused(strict, [img(bomb)], "10000x10000 pixels", within=5)
    refused(strict, [img(data_url(bomb_png(30_000, 30_000)))], "pixels", within=5)
    eight_bombs = [img(bomb)] * 8  # the most images a request may hold: each refused at its header
    refused(strict, eight_bombs, "pixels", within=5)

    mid = img(data_url(solid_png(800, 800)))
    assert post_chat(strict, [mid, mid]).status_code == 200  # two fit the budget
    refused(strict, [mid, mid, mid], "decode to more than", within=5)

    before = sum(image_host.hits.values())
    for host in ("127.0.0.1", "localhost"):
        refused(
            strict,
            [img(image_host.url("/img.png", host))],
            "private, loopback or link-local",
            within=5,
            port=image_host.port,
        )
    assert sum(image_host.hits.values()) == before  # the image host was never contacted
    normal_chat(strict)


@pytest.fixture(scope="module")
def lenient(tiny_llava_dir):
    args = (*SERVER_ARGS, "--allowed-media-domains", "127.0.0.1", "--allow-private-image-urls")
    with serve(tiny_llava_dir, *args) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        yield c
        assert srv.proc.poll() is None, srv.log_tail()


@pytest.mark.timeout(240)
def test_lenient_server_fetches_with_deadline_and_size_cap(lenient, image_host):
    r = post_chat(lenient, [{"type": "text", "text": "Look: "}, img(image_host.url("/img.png"))])
    assert r.status_code == 200, r.text
    assert image_host.hits["/img.png"] >= 1

    within = FETCH_TIMEOUT_S + 3
    for path in ("/drip", "/dripheaders"):
        refused(lenient, [img(image_host.url(path))], "could not fetch image: timed out", within, port=image_host.port)
    # two dripping URLs share the request's deadline (not one each)
    refused(
        lenient, [img(image_host.url("/drip")), img(image_host.url("/drip"))], "timed out", within, port=image_host.port
    )
    for path in ("/big", "/bigchunked"):
        refused(lenient, [img(image_host.url(path))], "larger than 200000 bytes", within=5, port=image_host.port)
    refused(lenient, [img(image_host.url("/redirect"))], "redirects are not followed", within=5, port=image_host.port)
    refused(lenient, [img(image_host.url("/missing.png"))], "HTTP status 404", within=5, port=image_host.port)
    closed = _closed_port()
    refused(
        lenient,
        [img(f"http://127.0.0.1:{closed}/img.png")],
        "could not fetch image: connection failed",
        within=5,
        port=closed,
    )
    normal_chat(lenient)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
