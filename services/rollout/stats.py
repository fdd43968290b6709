"""The engine's own counters (``EngineStats``), written by the engine thread through vLLM's stat-logger hook
and read by ``/v1/stats``, ``/metrics`` and tests."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class EngineStats:
    """Written by the engine thread (vLLM's stat-logger hook), read by /metrics and tests."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    max_running: int = 0
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    idle_s: float = 0.0
    """Time the engine thread waited with nothing to run (a pod fed too slowly shows it here)."""
    step_s: float = 0.0
    """Time inside vLLM's step()."""
    idle_since: float | None = None
    """perf_counter() when the current idle wait began (None while busy)."""

    def snapshot(self) -> dict:
        """The counters, with idle_s including the idle wait in progress."""
        out = {k: v for k, v in self.__dict__.items() if k != "idle_since"}
        since = self.idle_since
        if since is not None:
            out["idle_s"] += time.perf_counter() - since
        return out


def stat_logger_factory(stats: EngineStats):
    """A vLLM stat-logger class that copies the scheduler's and iteration's figures into ``stats``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                stats.running = scheduler_stats.num_running_reqs
                stats.waiting = scheduler_stats.num_waiting_reqs
                stats.kv_cache_usage = scheduler_stats.kv_cache_usage
                stats.max_running = max(stats.max_running, stats.running)
            if iteration_stats is not None:
                stats.generated_tokens += iteration_stats.num_generation_tokens
                stats.prompt_tokens += iteration_stats.num_prompt_tokens

        def log_engine_initialized(self) -> None:
            pass

    return _Recorder
