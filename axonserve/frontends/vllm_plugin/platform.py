"""`AxonCpuPlatform`: vLLM's CPU platform, with axonserve's executor and request checks.

Only what differs from `CpuPlatform`: the executor backend becomes `AxonExecutor` (vLLM's own
workers never start), and requests asking for sampling features the ranks do not implement
are refused at the door with a clear error, instead of failing the engine mid-step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from axonserve.frontends.vllm_plugin.version import check_vllm_version

check_vllm_version()

from vllm.platforms.cpu import CpuPlatform

from axonserve.frontends.vllm_plugin import EXECUTOR

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class AxonCpuPlatform(CpuPlatform):
    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        super().check_and_update_config(vllm_config)
        if vllm_config.model_config is None:  # vLLM also builds default, model-less configs
            return
        vllm_config.parallel_config.distributed_executor_backend = EXECUTOR

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        super().validate_request(processed_inputs, params)
        from vllm.exceptions import VLLMValidationError  # a 400 naming the parameter
        from vllm.sampling_params import SamplingParams

        if isinstance(params, SamplingParams):
            from axonserve.frontends.vllm_plugin.plan import unsupported

            bad = unsupported(params)
            if bad is not None:
                raise VLLMValidationError(bad[1], parameter=bad[0])
