"""The frontend's adapter registry: served name -> `LoraSpec`, vLLM's `--lora-modules` and
`/v1/load_lora_adapter` surface.

No torch, no I/O of its own: adapters are validated by `adapter.read_adapter_config` before they
are registered (the caller runs it off the event loop). Every registration is hostile input, so
names are bounded (length, charset, never a base model's name) and so is the number of adapters.
`lora_id`s come from one counter for the registry's lifetime and are never reused: a name that is
unloaded and loaded again (perhaps from a changed directory) gets a new id, so the scheduler's
prefix cache and the ranks' adapter slots, both keyed by id, never mix two versions of a name.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from axonserve.lora.adapter import LoraError
from axonserve.protocol.messages import LoraSpec

if TYPE_CHECKING:
    from axonserve.neuron.config import ModelConfig

MAX_LORA_NAME_CHARS = 128
MAX_LORA_PATH_CHARS = 4096
# adapters registered at once (start-up and run-time loads together). Each costs the frontend a few
# hundred bytes and the ranks nothing until a request uses it; the bound stops a client that may load
# adapters from growing /v1/models and the registry without limit
MAX_REGISTERED_LORAS = 1024
# names as vLLM users write them ("sql-lora", "org/adapter-v2", "tuned:1"): no spaces or controls,
# nothing that needs quoting in a URL path or a log line
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
ENV_RUNTIME_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_from_env() -> bool:
    """vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter ("1" or "true")."""
    return os.environ.get(ENV_RUNTIME_UPDATING, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoraModule:
    """One `--lora-modules` entry (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None

    def to_arg(self) -> str:
        """The canonical string kept in `EngineConfig.lora_modules` (read back by `parse_lora_module`)."""
        if self.base_model_name is None:
            return f"{self.name}={self.path}"
        return json.dumps({"name": self.name, "path": self.path, "base_model_name": self.base_model_name})


def parse_lora_module(text: str) -> LoraModule:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            raise LoraError(f"--lora-modules: invalid JSON {text[:80]!r}") from None
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"}) if isinstance(obj, dict) else []
        if not isinstance(obj, dict) or unknown:
            raise LoraError(
                f"--lora-modules: a JSON entry takes name, path and base_model_name"
                f"{f' (not {unknown[0][:40]!r})' if unknown else ''}"
            )
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if not isinstance(name, str) or not isinstance(path, str) or not (base is None or isinstance(base, str)):
            raise LoraError("--lora-modules: name and path must be strings (base_model_name a string or absent)")
        return LoraModule(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise LoraError(f"--lora-modules: expected name=path or a JSON object, got {text[:80]!r}")
    return LoraModule(name, path)


def check_name(name: object, base_names: set[str] | frozenset[str] = frozenset()) -> str:
    """A valid adapter name, or LoraError saying why not."""
    if isinstance(name, str) and name in base_names:
        raise LoraError(f"the adapter name {name[:MAX_LORA_NAME_CHARS]!r} is the base model's name")
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_LORA_NAME_CHARS or not _NAME.fullmatch(name):
        raise LoraError(
            f"an adapter name is 1 to {MAX_LORA_NAME_CHARS} characters of A-Z a-z 0-9 . _ : / @ + -, "
            "starting with a letter or digit"
        )
    return name


def check_path(path: object) -> str:
    """The adapter directory as an absolute path (the worker ranks may not share our cwd)."""
    if not isinstance(path, str) or not 1 <= len(path) <= MAX_LORA_PATH_CHARS or "\x00" in path:
        raise LoraError(f"an adapter path is 1 to {MAX_LORA_PATH_CHARS} characters")
    return os.path.abspath(path)


@dataclass(frozen=True)
class LoraEntry:
    spec: LoraSpec
    parent: str  # the base model's served name (vLLM's ModelCard.parent)


class LoraRegistry:
    """Served adapter name -> LoraSpec for one server's lifetime (one per frontend)."""

    def __init__(self, base_names: set[str], base_name: str, max_adapters: int = MAX_REGISTERED_LORAS):
        self.base_names = frozenset(base_names)
        self.base_name = base_name  # the served name: each adapter's default parent
        self.max_adapters = max_adapters
        self._entries: dict[str, LoraEntry] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str | None) -> LoraSpec | None:
        entry = self._entries.get(name) if isinstance(name, str) else None
        return entry.spec if entry is not None else None

    def entries(self) -> list[LoraEntry]:
        return list(self._entries.values())

    def check_new(self, name: object) -> str:
        """LoraError unless `name` could be registered now (checked before the slow validation)."""
        name = check_name(name, self.base_names)
        if name in self._entries:
            raise LoraError(f"The lora adapter '{name}' has already been loaded.")
        if len(self._entries) >= self.max_adapters:
            raise LoraError(f"at most {self.max_adapters} LoRA adapters can be loaded; unload one first")
        return name

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoraSpec:
        """Register an adapter whose directory has been validated; a fresh lora_id."""
        name = self.check_new(name)
        parent = base_model_name if base_model_name in self.base_names else self.base_name
        spec = LoraSpec(name=name, lora_id=next(self._ids), path=check_path(path))
        self._entries[name] = LoraEntry(spec, parent)
        return spec

    def remove(self, name: str) -> LoraSpec | None:
        """The removed adapter's spec, None when no adapter has that name. Requests already started
        keep their spec (the engine holds it), so they finish with the adapter they began with."""
        entry = self._entries.pop(name, None)
        return entry.spec if entry is not None else None


def check_startup_modules(
    texts: list[str], *, enable_lora: bool, max_lora_rank: int, model_dir: str, base_names: set[str]
) -> list[str]:
    """Validate `--lora-modules` before anything starts: each entry parsed, its name checked (unique,
    not a base model's name), its directory read with `read_adapter_config` against the base model.
    Returns the canonical entries for `EngineConfig.lora_modules`; ValueError names the bad one."""
    from axonserve.lora.adapter import read_adapter_config

    if not texts:
        return []
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if len(texts) > MAX_REGISTERED_LORAS:
        raise ValueError(f"--lora-modules: at most {MAX_REGISTERED_LORAS} adapters")
    model = base_model_config(model_dir)
    out: list[str] = []
    seen: set[str] = set()
    for text in texts:
        try:
            mod = parse_lora_module(text)
            name = check_name(mod.name, base_names)
            if name in seen:
                raise LoraError(f"the adapter name {name!r} is given twice")
            seen.add(name)
            path = check_path(mod.path)
            read_adapter_config(path, max_lora_rank, model)
        except LoraError as e:
            raise ValueError(f"--lora-modules {text[:200]}: {e}") from None
        out.append(LoraModule(name, path, mod.base_model_name).to_arg())
    return out


def base_model_config(model_dir: str) -> ModelConfig | None:
    """The base model's shapes for the adapters' shape check (None when its config cannot be read:
    the ranks then check shapes when they load the adapter)."""
    from axonserve.neuron.config import ModelConfig

    if not os.path.isdir(model_dir):
        return None
    try:
        return ModelConfig.from_dir(model_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return None
