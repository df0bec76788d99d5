"""`AxonExecutor`: vLLM's scheduler and KV block tables on top, axonserve's worker ranks below.

Use it with `--distributed-executor-backend axonserve.frontends.vllm_plugin.executor.AxonExecutor`
(or `LLM(..., distributed_executor_backend=...)`, or AXONSERVE_VLLM=1 with the platform plugin).
vLLM's EngineCore calls this where it would call its own multiprocess executor: every step's
`SchedulerOutput` goes out as one axonserve `StepPlan` on the plan socket and rank 0's
`StepResult` comes back as a `ModelRunnerOutput` (plan.py / output.py translate). The ranks
own the KV tensors and the forward pass; vLLM keeps scheduling, tokenization, stop checks and
block tables. Every control RPC vLLM makes is either answered here or raises
NotImplementedError naming it, so a vLLM that starts calling something new fails loudly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import structlog

from axonserve.frontends.vllm_plugin.version import check_vllm_version

check_vllm_version()

from vllm.v1.executor.abstract import Executor
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes

from axonserve.frontends.vllm_plugin import startup
from axonserve.frontends.vllm_plugin.mirror import Mirror
from axonserve.frontends.vllm_plugin.output import runner_output
from axonserve.frontends.vllm_plugin.plan import step_plan
from axonserve.frontends.vllm_plugin.ranks import RankGroup, RanksFailed
from axonserve.protocol.messages import ProfileAck, ProfileCommand, StepResult

log = structlog.get_logger()

AXON_BLOCK_SIZE = 16  # axonserve's default, used when the user gave vLLM no --block-size


class AxonExecutor(Executor):
    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        startup.check_supported(self.vllm_config)
        cc = self.cache_config
        block_size = cc.block_size if cc.user_specified_block_size and cc.block_size else AXON_BLOCK_SIZE
        self.axon_config = startup.engine_config(self.vllm_config, block_size)
        self.world = self.axon_config.num_workers
        self.ranks: RankGroup | None = None
        self.mirror = Mirror()
        self.step_id = 0
        self._failure_callback: Callable[[], None] | None = None
        self._profile_seq = 0
        self._rpcs: dict[str, Callable[..., Any]] = {
            "get_kv_cache_spec": lambda: startup.kv_cache_spec(self.axon_config),
            "determine_available_memory": lambda: startup.available_kv_bytes(self.vllm_config, self.axon_config),
            "get_supported_kv_cache_layouts": lambda: [startup.KV_LAYOUT],
            "set_kv_cache_layout": self._set_kv_cache_layout,
            "update_max_model_len": self._update_max_model_len,
            "initialize_from_config": self._initialize_from_config,
            "compile_or_warm_up_model": lambda: CompilationTimes(language_model=0.0, encoder=0.0),
            "get_supported_tasks": lambda: ("generate",),
            "list_loras": set,  # none can be loaded: add_lora is not supported
            # the ranks hold no multimodal or encoder cache, and every step completes before
            # the next is planned, so there is nothing to reset or wait for
            "reset_mm_cache": lambda: None,
            "reset_encoder_cache": lambda: None,
            "synchronize_device": lambda: None,
        }
        log.info(
            "vllm_plugin.executor",
            model=self.axon_config.model,
            dtype=self.axon_config.dtype,
            ranks=self.world,
            block_size=block_size,
            max_model_len=self.axon_config.max_model_len,
        )

    # ------------------------------------------------------------------ control plane

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
    ) -> Any:
        """Answer vLLM's worker RPCs for the axonserve ranks: one reply per rank (vLLM 'worker')."""
        if not isinstance(method, str):
            raise NotImplementedError(
                f"axonserve's vLLM executor cannot run a callable on its ranks ({getattr(method, '__name__', method)})"
            )
        handler = self._rpcs.get(method)
        if handler is None:
            raise NotImplementedError(f"axonserve's vLLM executor does not support the worker RPC {method!r}")
        reply = handler(*args, **(kwargs or {}))
        replies = [reply] * self.world
        if not non_block:
            return replies
        future: Future = Future()
        future.set_result(replies)
        return future

    def _set_kv_cache_layout(self, name: str) -> None:
        if name != startup.KV_LAYOUT:
            raise NotImplementedError(f"axonserve's ranks hold their KV cache as {startup.KV_LAYOUT}, not {name}")

    def _update_max_model_len(self, n: int) -> None:
        if self.ranks is not None:
            raise NotImplementedError("update_max_model_len after axonserve's ranks started")
        self.axon_config.max_model_len = n

    def _initialize_from_config(self, kv_cache_configs: list) -> None:
        """Start the ranks with exactly vLLM's KV block count (see startup.py)."""
        blocks = {c.num_blocks for c in kv_cache_configs}
        if len(blocks) != 1:
            raise NotImplementedError(f"vLLM sized the ranks' KV pools differently: {sorted(blocks)}")
        if self.ranks is not None:
            raise NotImplementedError("initialize_from_config twice (KV cache re-allocation)")
        self.axon_config.num_kv_blocks = blocks.pop()
        self.ranks = RankGroup(self.axon_config)
        info = self.ranks.start(self._ranks_failed)
        if int(info["num_kv_blocks"]) != self.axon_config.num_kv_blocks:
            raise RuntimeError(
                f"rank 0 allocated {info['num_kv_blocks']} KV blocks, vLLM planned {self.axon_config.num_kv_blocks}"
            )
        if int(info["max_model_len"]) < int(self.axon_config.max_model_len or 0):
            raise RuntimeError(
                f"the ranks serve {info['max_model_len']} tokens, vLLM plans {self.axon_config.max_model_len}"
            )

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        self._failure_callback = callback

    def _ranks_failed(self, reason: str) -> None:
        if self._failure_callback is not None:
            self._failure_callback()

    def check_health(self) -> None:
        if self.ranks is not None and self.ranks.failure is not None:
            raise RanksFailed(self.ranks.failure)

    def shutdown(self) -> None:
        if self.ranks is not None:
            self.ranks.stop()

    # ------------------------------------------------------------------ data plane

    def execute_model(self, scheduler_output, non_block: bool = False) -> Any:
        """One vLLM step on the ranks: the plan out, rank 0's result back (synchronously: a CPU
        step leaves vLLM nothing to overlap it with)."""
        out = self._step(scheduler_output)
        if not non_block:
            return out
        future: Future = Future()
        future.set_result(out)
        return future

    def _step(self, so) -> ModelRunnerOutput:
        if self.ranks is None:
            raise RuntimeError("vLLM stepped before initialize_from_config started axonserve's ranks")
        plan = step_plan(so, self.step_id + 1, self.mirror)
        if plan is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.step_id += 1
        self.ranks.send(plan)
        result = self.ranks.recv(f"step {plan.step_id}")
        if not isinstance(result, StepResult) or result.step_id != plan.step_id:
            raise RanksFailed(
                f"axonserve rank 0 answered out of turn: expected step {plan.step_id}, got {result!r:.200}"
            )
        if result.error:
            raise RanksFailed(f"axonserve rank 0 failed step {plan.step_id}: {result.error}")
        return runner_output(plan, result, self.mirror)

    def sample_tokens(self, grammar_output, non_block: bool = False) -> Any:
        raise NotImplementedError(
            "sample_tokens: axonserve's ranks sample within execute_model (structured outputs are not supported)"
        )

    def take_draft_token_ids(self) -> None:
        return None  # no speculative decoding

    def profile(self, is_start: bool = True, profile_prefix: str | None = None, **_: Any) -> None:
        """vLLM's /start_profile and /stop_profile -> torch.profiler on every rank."""
        if not self.axon_config.profile_dir:
            raise RuntimeError("profiling is disabled: configure vLLM's torch profiler directory")
        if self.ranks is None:
            raise RuntimeError("profile before axonserve's ranks started")
        self._profile_seq += 1
        action = "start" if is_start else "stop"
        self.ranks.send(ProfileCommand(action, self._profile_seq, stamp=time.time_ns()))
        ack = self.ranks.recv(f"profiler {action}", timeout=120.0)
        if not isinstance(ack, ProfileAck) or ack.seq != self._profile_seq:
            raise RanksFailed(f"axonserve rank 0 answered out of turn: expected profiler ack #{self._profile_seq}")
        if ack.error:
            raise RuntimeError(f"profiler {action} failed on axonserve's ranks: {ack.error}")
        log.info("vllm_plugin.profiler", action=action, files=ack.files)
