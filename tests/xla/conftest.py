"""Fixtures for the XLA backend tests: the torch-xla venv and how to run things in it.

pytest runs in axonserve's .venv (torch 2.13, no torch-xla); `--device xla` runs in .venv-xla
(torch 2.9.0 + torch-xla 2.9.0: scripts/setup-xla builds it, and returns at once when it is
current). Servers start from that venv's interpreter; checks that need torch-xla in-process run as
scripts in it (`run_in_xla`) and print one JSON line. When the venv cannot be built (no network, say)
the tests skip with the reason, except under CI, where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.environ.get("AXONSERVE_XLA_VENV") or os.path.join(REPO, ".venv-xla")


XLA_ENV = {"PJRT_DEVICE": "CPU", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # PJRT on the CPU


@pytest.fixture(scope="session")
def xla_python() -> str:
    from conftest import build_lane_venv

    build_lane_venv("setup-xla", "AXONSERVE_XLA_VENV", VENV, "XLA tests")
    return os.path.join(VENV, "bin", "python")


def run_in_xla(python: str, script: str, *args: str, timeout: float = 600) -> dict:
    """Run tests/xla/<script> in the XLA venv; its last stdout line is a JSON object."""
    r = subprocess.run(
        [python, os.path.join(os.path.dirname(__file__), script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=REPO,
        env={**os.environ, **XLA_ENV, "PYTHONPATH": REPO},
    )
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])
