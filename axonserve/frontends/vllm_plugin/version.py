"""The vLLM releases this bridge was checked against, and the guard that refuses any other.

The bridge reaches below vLLM's public API (Executor, SchedulerOutput, ModelRunnerOutput,
KVCacheSpec): those shapes change between minor releases (0.11 -> 0.32 broke vllm-neuron in
five places), so an unchecked vLLM fails at import with this message, not mid-request.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

VLLM_RANGE = ">=0.32,<0.33"  # keep equal to the `vllm` extra in pyproject.toml
_SPEC = SpecifierSet(VLLM_RANGE)


class VllmVersionError(ImportError):
    pass


def check_vllm_version(version: str | None = None) -> str:
    """Raise VllmVersionError unless `version` (default: the installed vLLM's) is in VLLM_RANGE."""
    if version is None:
        try:
            from vllm import __version__ as version
        except ImportError as e:
            raise VllmVersionError(
                f"axonserve's vLLM plugin needs vLLM {VLLM_RANGE} (pip install 'axonserve[vllm]'): {e}"
            ) from e
    try:
        v = Version(version)
    except InvalidVersion as e:
        raise VllmVersionError(f"cannot parse the installed vLLM version {version!r}") from e
    if Version(v.public) not in _SPEC:  # a local tag (0.32.0+cpu) is the same release
        raise VllmVersionError(
            f"vLLM {version} is installed, but axonserve's vLLM plugin supports only vLLM {VLLM_RANGE}: "
            f"its executor bridge uses vLLM internals that change between minor releases. "
            f"Install a supported vLLM (pip install 'axonserve[vllm]') or an axonserve release made for {version}."
        )
    return version
