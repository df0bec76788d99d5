"""The child-process entry's environment defaults."""

from __future__ import annotations

import subprocess
import sys

from axonserve.actors.entry import quiet_openmp


def test_openmp_waits_passively_unless_the_user_chose():
    env: dict[str, str] = {}
    quiet_openmp(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}):
        env = dict(chosen)
        quiet_openmp(env)
        assert env == chosen


def test_the_policy_reaches_libgomp_when_set_before_torch():
    """libgomp reads OMP_WAIT_POLICY when it loads (with torch): the entry sets it before any actor
    imports torch. The check is libgomp's own dump of its settings (OMP_DISPLAY_ENV=verbose): its
    spin count is 0 when waiting is passive, 300000 by default (it shows 'PASSIVE' either way)."""
    code = (
        "import os; from axonserve.actors.entry import quiet_openmp; quiet_openmp(); "
        "os.environ['OMP_DISPLAY_ENV'] = 'verbose'; import torch; torch.ones(4).sum()"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "GOMP_SPINCOUNT = '0'" in out.stderr, out.stderr[-2000:]
