"""vLLM plugin frontend: vLLM's server, CLI and `LLM` API on axonserve's worker ranks.

The bridge sits at vLLM's executor seam (`executor.AxonExecutor`): vLLM keeps its scheduler,
tokenizer and KV block tables; axonserve's ranks own the KV tensors and the forward pass.
Select it with `--distributed-executor-backend axonserve.frontends.vllm_plugin.executor.AxonExecutor`,
or set AXONSERVE_VLLM=1 so the platform plugin (entry point `vllm.platform_plugins`) selects it.

Nothing else in axonserve imports this package, and this module imports no vLLM: vLLM loads
the entry point below in every process, so it stays cheap and inert unless asked for.
"""

from __future__ import annotations

import os

EXECUTOR = "axonserve.frontends.vllm_plugin.executor.AxonExecutor"
PLATFORM = "axonserve.frontends.vllm_plugin.platform.AxonCpuPlatform"
ENABLE_ENV = "AXONSERVE_VLLM"


def register_platform() -> str | None:
    """`vllm.platform_plugins` entry point: our platform when AXONSERVE_VLLM=1, else None.

    vLLM calls this more than once per process; VLLM_TARGET_DEVICE=cpu skips plugins entirely
    (then pass the executor with --distributed-executor-backend)."""
    if os.environ.get(ENABLE_ENV, "") not in ("1", "true", "yes"):
        return None
    from axonserve.frontends.vllm_plugin.version import check_vllm_version

    check_vllm_version()
    return PLATFORM
