"""The engine thread under RolloutEngine (engine.py, whose docstring gives the design): building vLLM's
``LLMEngine``, the thread that steps it and runs commands between steps, and handing results to the loop."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import math
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from molt.vocab import model_vocab
from services.rollout import checkpoint
from services.rollout.config import RolloutSettings
from services.rollout.cpu_dtype import cpu_flags, cpu_serving_dtype
from services.rollout.images import ImageLimits
from services.rollout.params import Limits
from services.rollout.routing import RoutingRecorder
from services.rollout.stats import EngineStats, stat_logger_factory

log = logging.getLogger("molt.rollout")


@dataclass
class _Group:
    """The n samples of one request; its asyncio future resolves once, when the last sample ends."""

    future: asyncio.Future
    version: int
    jobs: list[_Job] = field(default_factory=list)
    remaining: int = 0
    error: BaseException | None = None
    on_tokens: Callable[[list[int], list[float]], None] | None = None
    """Called on the loop with each step's new tokens and logprobs (a streamed call, n = 1)."""
    top_k: int = 0
    """The request's ``top_logprobs``: how many alternatives to keep per token."""
    record_routing: list[int] | None = None
    """The prompt, when each sample's routed experts are to be recorded once it finishes (routing.py)."""


@dataclass
class _Job:
    """One engine request (one sample); engine-thread state."""

    group: _Group
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: Any = None


ENGINE_CHECK_S = 1.0
"""How often the pod checks that vLLM's engine processes (``--vllm.multiprocessing``) are alive."""

_NO_RESULT = object()  # marks fire-and-forget engine commands (requests resolve through their group)


def _top(step: dict, k: int) -> list[tuple[int, float]]:
    """The k best (token id, logprob) of one step's vLLM logprobs, best first. vLLM adds the sampled token when
    it is not among them (its rank says so); tokens a structured-output grammar masked (-inf) are left out."""
    best = sorted(step.items(), key=lambda e: e[1].rank if e[1].rank is not None else k + 1)
    return [(t, lp.logprob) for t, lp in best if lp.rank is not None and lp.rank <= k and lp.logprob > -math.inf]


def _resolve_groups(groups: list[_Group]) -> None:
    for group in groups:
        if not group.future.done():
            group.future.set_result(None)


def _deliver_progress(progress: list[tuple[Callable, list[int], list[float]]]) -> None:
    for on_tokens, ids, logprobs in progress:
        on_tokens(ids, logprobs)


def engine_env(mp: bool, kv_size_set: bool, on_cpu: bool, environ: Mapping[str, str]) -> dict[str, str | None]:
    """The variables set (None: unset) while vLLM builds the engine; it reads and caches its env then."""
    env: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if mp else "0"}
    if kv_size_set:  # an explicit KV size must win over the legacy VLLM_CPU_KVCACHE_SPACE (vLLM lets the env win)
        env["VLLM_CPU_KVCACHE_SPACE"] = None
    if on_cpu and "VLLM_USE_AOT_COMPILE" not in environ:
        # vLLM's AOT-compiled model does not load back on CPU, so every pod start compiled it again; its older
        # compile cache does load, and a restarted pod starts in seconds.
        env["VLLM_USE_AOT_COMPILE"] = "0"
    return env


@contextmanager
def _env(**values: str | None):
    """Set (or unset, with None) environment variables for the duration of engine construction."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _quiet_checkpoint_casts():
    """While vLLM loads the checkpoint in this process: it has said once that it serves it in a narrower dtype
    ("Downcasting torch.float32 to torch.bfloat16"), then warns again for each tensor it casts. Weight syncs
    still warn: the trainer sends pods that agree on a dtype that dtype, so a cast there is worth a line."""
    logger = logging.getLogger("vllm.model_executor.models.utils")

    def drop(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Attempted to load weight ")

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class EngineThread:
    """The engine thread and its lifecycle (start, failure, close): the base of RolloutEngine.

    vLLM keeps one distributed state per process, so only one in-process engine may be open at a
    time (a second one would silently inherit the first one's parallel groups).
    """

    _open_inprocess: EngineThread | None = None

    def __init__(self, settings: RolloutSettings) -> None:
        if not settings.model.path:
            raise ValueError("RolloutEngine needs settings.model.path (a local HF model dir)")
        self.settings = settings
        self.stats = EngineStats()
        self.version = 0
        self.awaiting_weights = settings.weights.await_push  # --weights.await_push: not ready before a push
        self.weight_apply_s: list[float] = []
        self.aborts: dict[str, int] = {}
        self._expected = checkpoint.expected_parameters(settings.model.path)
        self.serving_dtype = ""
        """The one dtype of every floating engine parameter ("" when they differ), found at start."""
        self.vocab = ""
        """``molt.vocab.model_vocab`` of the model directory, found at start (the gateway checks it)."""
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._llm = None
        self._multiprocess = False
        self._engine_procs: list[multiprocessing.process.BaseProcess] = []
        self._watchdog: asyncio.Future | None = None
        self._limits: Limits | None = None
        self.image_limits: ImageLimits | None = None
        self._gate: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self._inflight: dict[str, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done_groups: list[_Group] = []  # engine thread: groups to hand to the loop after this step
        self._progress: list[tuple[Callable, list[int], list[float]]] = []  # engine thread: streamed tokens, ditto
        self.routing = RoutingRecorder()
        self.dead: BaseException | None = None
        self._failed = asyncio.Event()  # set when the engine thread dies (not on close)

    # ---- lifecycle

    @property
    def policy_version(self) -> int:
        return self.version

    @property
    def ready(self) -> bool:
        return self._llm is not None and self.dead is None and not self.awaiting_weights

    @property
    def limits(self) -> Limits:
        assert self._limits is not None, "engine not started"
        return self._limits

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop that started the engine (the engine thread hands results to it)."""
        assert self._loop is not None, "engine not started"
        return self._loop

    async def start(self) -> None:
        other = EngineThread._open_inprocess
        if other is not None and other is not self and not self.settings.vllm.multiprocessing:
            raise RuntimeError(
                f"another in-process vLLM engine is open ({other.settings.model.path}); close it first "
                "(one per process) or pass --vllm.multiprocessing"
            )
        self._loop = asyncio.get_running_loop()
        self._gate = asyncio.Event()
        self._gate.set()
        self._update_lock = asyncio.Lock()
        started: cf.Future = cf.Future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="rollout-engine", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(started)
        if not self._multiprocess:
            EngineThread._open_inprocess = self
        if self._engine_procs:
            self._watchdog = asyncio.ensure_future(self._watch_engine_processes())
        assert self._llm is not None  # the engine thread built it before resolving `started`
        per_worker = await self._call(lambda llm, jobs: llm.collective_rpc("rollout_param_dtypes"))
        dtypes = {d for names in per_worker for d in names}
        self.serving_dtype = dtypes.pop() if len(dtypes) == 1 else ""
        self.vocab = await asyncio.to_thread(model_vocab, self.settings.model.path)
        cfg = self._llm.model_config
        self._limits = Limits(
            vocab_size=cfg.get_vocab_size(),
            max_model_len=cfg.max_model_len,
            max_n=self.settings.rollout.max_n,
            max_prompt_tokens=self.settings.rollout.max_prompt_tokens,
            max_logprobs=self.settings.vllm.max_logprobs,
        )
        if cfg.is_multimodal_model:
            r = self.settings.rollout
            self.image_limits = ImageLimits(
                getattr(cfg.hf_config, "image_token_id", None),
                r.max_images_per_prompt,
                r.max_image_bytes,
                r.max_image_pixels,
            )
        log.info(
            "engine ready: %s (multiprocess=%s, vocab %d, context %d)",
            self.settings.model.path,
            self._multiprocess,
            self._limits.vocab_size,
            self._limits.max_model_len,
        )

    @property
    def failed(self) -> bool:
        """The engine thread died (a closed engine has not failed)."""
        return self._failed.is_set()

    async def wait_failed(self) -> BaseException:
        """Return once the engine thread has died (not on close): the pod cannot serve again and should exit."""
        await self._failed.wait()
        assert self.dead is not None
        return self.dead

    async def _watch_engine_processes(self) -> None:
        """An engine process that exits (killed by the OOM killer, a crash) is the engine's death: vLLM's client
        noticed nothing while idle and, mid-step, left the engine thread waiting for an answer that never comes.
        Fail every waiter with a 503 and let the pod exit (``wait_failed``)."""
        while self.dead is None:
            await asyncio.sleep(ENGINE_CHECK_S)
            gone = [p for p in self._engine_procs if not p.is_alive()]
            if gone and self.dead is None:
                self.dead = RuntimeError(
                    f"vLLM's engine process {gone[0].pid} ({gone[0].name}) exited with code {gone[0].exitcode}"
                )
                log.error("%s", self.dead)
                self._fail_inflight(self.dead)
                self._failed.set()

    async def stop_watching(self) -> None:
        """The pod is stopping: its engine processes may get the same SIGTERM and exit first; not a death."""
        if self._watchdog is not None:
            self._watchdog.cancel()

    async def close(self) -> None:
        await self.stop_watching()
        if self._thread is None:
            return
        self._cmds.put(None)
        # An engine thread stuck in a step whose engine process is gone never returns: do not wait long for it.
        await asyncio.to_thread(self._thread.join, 2 if self.failed else 60)
        self._thread = None
        if EngineThread._open_inprocess is self:
            EngineThread._open_inprocess = None

    def _build(self):
        from vllm import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        k = self.settings.vllm
        on_cpu = current_platform.is_cpu()
        mp = (not on_cpu) if k.multiprocessing is None else k.multiprocessing
        backend = k.distributed_executor_backend or ("mp" if mp or k.tensor_parallel_size > 1 else "uni")
        dtype = cpu_serving_dtype(k.dtype, cpu_flags()) if on_cpu else k.dtype
        if dtype != k.dtype:
            log.info(
                "--vllm.dtype %s: serving in %s, as this CPU has no bf16 multiply instructions (avx512_bf16, "
                "amx_bf16 or bf16), where bf16 runs emulated and many times slower; --vllm.dtype bfloat16 "
                "serves bf16 anyway",
                k.dtype,
                dtype,
            )
        args: dict[str, Any] = dict(
            model=str(self.settings.model.path),
            dtype=dtype,
            max_model_len=k.max_model_len,
            tensor_parallel_size=k.tensor_parallel_size,
            enable_expert_parallel=k.enable_expert_parallel,
            max_num_batched_tokens=k.max_num_batched_tokens,
            max_num_seqs=k.max_num_seqs,
            gpu_memory_utilization=k.gpu_memory_utilization,
            kv_cache_memory_bytes=k.kv_cache_memory_bytes,
            enforce_eager=k.enforce_eager,
            enable_prefix_caching=k.enable_prefix_caching,
            seed=k.seed,
            logprobs_mode=k.logprobs_mode,
            max_logprobs=k.max_logprobs,
            enable_return_routed_experts=k.enable_return_routed_experts or None,
            distributed_executor_backend=backend,
            disable_custom_all_reduce=k.disable_custom_all_reduce,
            decode_context_parallel_size=k.decode_context_parallel_size,
            mamba_ssm_cache_dtype=k.mamba_ssm_cache_dtype,
            disable_log_stats=False,
            worker_extension_cls="services.rollout.worker_ext.RolloutWorkerExtension",
        )
        assert self.settings.model.path is not None  # parse() exits without --model.path
        if checkpoint.is_vision_language(self.settings.model.path):
            args["limit_mm_per_prompt"] = {"image": self.settings.rollout.max_images_per_prompt, "video": 0}
        unset_is_vllms = ("block_size", "enable_chunked_prefill", "async_scheduling", "attention_backend")
        for name in (*unset_is_vllms, "mm_encoder_attn_backend", "gdn_prefill_backend"):  # unset: vLLM decides
            if getattr(k, name) not in (None, ""):  # Molt's scripts pass an empty value for "vLLM's choice"
                args[name] = getattr(k, name)
        if k.compilation_config:
            args["compilation_config"] = k.compilation_config
        if k.mtp_num_speculative_tokens:
            args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k.mtp_num_speculative_tokens}
        if on_cpu and k.kv_cache_memory_bytes is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            # vLLM would reserve --vllm.gpu_memory_utilization of all RAM: size from what the model needs.
            from services.rollout.kv_size import cpu_kv_cache_bytes

            args["kv_cache_memory_bytes"], why = cpu_kv_cache_bytes(
                str(self.settings.model.path), dtype, k.max_model_len, k.max_num_seqs
            )
            log.info(
                "KV cache %d MiB (%s); set --vllm.kv_cache_memory_bytes to choose",
                args["kv_cache_memory_bytes"] >> 20,
                why,
            )
        engine_args = EngineArgs(**{key: v for key, v in args.items() if v is not None})
        env = engine_env(mp, args["kv_cache_memory_bytes"] is not None, on_cpu, os.environ)
        before = set(multiprocessing.active_children())
        with _env(**env), _quiet_checkpoint_casts():
            vllm_config = engine_args.create_engine_config()
            llm = LLMEngine(
                vllm_config=vllm_config,
                executor_class=Executor.get_class(vllm_config),
                log_stats=True,
                stat_loggers=[stat_logger_factory(self.stats)],
                multiprocess_mode=mp,
            )
        self._multiprocess = mp
        # vLLM starts its engine processes with multiprocessing; those are the ones this pod depends on.
        self._engine_procs = [p for p in multiprocessing.active_children() if p not in before] if mp else []
        return llm

    # ---- engine thread

    def _run(self, started: cf.Future) -> None:
        try:
            self._llm = llm = self._build()
        except BaseException as exc:  # noqa: BLE001 - startup failure: surface it to start()
            started.set_exception(exc)
            return
        started.set_result(None)
        jobs: dict[str, _Job] = {}
        idle_poll_s = self.settings.rollout.idle_poll_ms / 1e3
        try:
            while True:
                if llm.has_unfinished_requests():
                    cmds = []
                else:
                    self.stats.idle_since = t0 = time.perf_counter()
                    cmds = [self._next_command(t0 + idle_poll_s)]
                    self.stats.idle_since = None
                    self.stats.idle_s += time.perf_counter() - t0
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    if cmd is None:
                        self.dead = RuntimeError("rollout engine closed")
                        self._fail_all(jobs, self.dead)
                        return
                    fn, fut = cmd
                    try:
                        result = fn(llm, jobs)
                    except BaseException as exc:
                        if fut is _NO_RESULT:
                            raise  # a request command failed outside its own error handling: engine bug
                        if not fut.done():
                            fut.set_exception(exc)
                    else:
                        if fut is not _NO_RESULT and not fut.done():
                            fut.set_result(result)
                if llm.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = llm.step()
                    self.stats.step_s += time.perf_counter() - t0
                    self._dispatch(outputs, jobs)
                    self.stats.steps += 1
                if self.routing.pending and not llm.has_unfinished_requests():
                    for job, routed in self.routing.record_all(llm, self._limits):
                        job.routed_experts = routed
                        self._finish(job, str(job.finish_reason), job.stop_reason)
                    for held in self.routing.take_held():
                        held(llm, jobs)
                self._deliver_done()
        except BaseException as exc:  # the engine died: fail every waiter, /readyz goes red
            log.exception("rollout engine failed")
            self.dead = exc
            self.loop.call_soon_threadsafe(self._failed.set)
            self._fail_all(jobs, RuntimeError(f"rollout engine failed: {exc!r}"))  # a 503, whatever the cause
            while True:  # answer late commands instead of hanging their callers
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd is not None and cmd[1] is not _NO_RESULT and not cmd[1].done():
                    cmd[1].set_exception(RuntimeError(f"rollout engine failed: {exc!r}"))
        finally:
            self._llm_shutdown(llm)

    def _next_command(self, poll_until: float):
        """The next command: polled for until ``poll_until`` (``--rollout.idle_poll_ms``), then waited for."""
        while time.perf_counter() < poll_until:
            try:
                return self._cmds.get_nowait()
            except queue.Empty:
                _yield()  # releases the GIL: the event loop thread parses the request this poll is waiting for
        return self._cmds.get()

    def _llm_shutdown(self, llm) -> None:
        shutdown = getattr(llm.engine_core, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # best effort at exit; nothing depends on it
                log.warning("engine shutdown raised", exc_info=True)

    def _fail_all(self, jobs: dict[str, _Job], exc: BaseException) -> None:
        for job in [*jobs.values(), *self.routing.drop_pending()]:
            job.group.error = exc
            self._finish(job, "abort", None)
        jobs.clear()
        self._deliver_done()
        # Requests whose add command never ran: fail them on the loop, where _submit registers them.
        self.loop.call_soon_threadsafe(self._fail_inflight, exc)

    def _fail_inflight(self, exc: BaseException) -> None:
        for future in self._inflight.values():
            if not future.done():
                future.set_exception(RuntimeError(f"rollout engine stopped: {exc!r}"))

    def _finish(self, job: _Job, finish_reason: str, stop_reason) -> None:
        job.finish_reason, job.stop_reason = finish_reason, stop_reason
        job.group.remaining -= 1
        if job.group.remaining == 0:
            self._done_groups.append(job.group)

    def _deliver_done(self) -> None:
        """One loop wake-up per engine step for all requests that ended in it (not one per request); the tokens
        streamed calls got in it go first, so a call's last tokens arrive before its answer."""
        if self._progress:
            progress, self._progress = self._progress, []
            self.loop.call_soon_threadsafe(_deliver_progress, progress)
        if self._done_groups:
            groups, self._done_groups = self._done_groups, []
            self.loop.call_soon_threadsafe(_resolve_groups, groups)

    def _dispatch(self, outputs, jobs: dict[str, _Job]) -> None:
        for out in outputs:
            job = jobs.get(out.request_id)
            if job is None:
                continue
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            job.token_ids.extend(ids)
            if comp.logprobs is not None:
                job.logprobs.extend(d[t].logprob for t, d in zip(ids, comp.logprobs))
                if job.group.top_k:
                    job.top.extend(_top(d, job.group.top_k) for d in comp.logprobs)
            if job.prompt_token_ids is None and out.prompt_token_ids is not None:
                job.prompt_token_ids = list(out.prompt_token_ids)
            if job.group.on_tokens is not None and ids:
                self._progress.append((job.group.on_tokens, ids, job.logprobs[len(job.logprobs) - len(ids) :]))
            if out.prompt_logprobs and job.prompt_logprobs is None:
                toks = out.prompt_token_ids or []
                job.prompt_logprobs = [d[t].logprob for t, d in zip(toks[1:], out.prompt_logprobs[1:])]
            if out.finished:
                job.routed_experts = getattr(comp, "routed_experts", None)
                del jobs[out.request_id]
                if job.group.record_routing is not None and job.routed_experts is None:
                    job.finish_reason, job.stop_reason = str(comp.finish_reason), comp.stop_reason
                    self.routing.wait(job)  # finished once its routing is recorded, with the engine empty
                    continue
                self._finish(job, str(comp.finish_reason), comp.stop_reason)

    def _call(self, fn: Callable) -> asyncio.Future:
        """Run fn(llm, jobs) on the engine thread between two steps."""
        if self.dead is not None:
            raise RuntimeError(f"rollout engine failed: {self.dead!r}")
        fut: cf.Future = cf.Future()
        self._cmds.put((fn, fut))
        return asyncio.wrap_future(fut)
