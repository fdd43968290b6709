"""Rollout pods: sticky least-loaded choice, health probes, and one generate call with failure typing.

A session sticks to the pod of its first turn. When a call fails at the transport level (connection
refused or reset, timeout, 5xx, a malformed answer), the pod is marked unhealthy until its next good
probe and the caller (``generation.generate_with_failover``) resends the session's exact token prefix to
another pod. A 4xx from a pod is the request's fault and is surfaced as a 400, never retried elsewhere.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from molt.metrics import Metrics
from services.gateway.channel import PodChannel
from services.gateway.errors import GatewayError, PodUnavailable
from services.gateway.transport import HttpTransport, PodConnectionError, PodTransport, generate_body, json_loads

log = logging.getLogger("molt.gateway.pods")


@dataclass
class Pod:
    url: str
    healthy: bool = True
    inflight: int = 0
    sessions: int = 0
    policy_version: int | None = None
    last_error: str = ""
    channel: PodChannel | None = field(default=None, repr=False, compare=False)
    """This pod's generate stream; None: one HTTP request per call (--rollout.stream off, or a test transport)."""

    @property
    def load(self) -> tuple[int, int]:
        return self.inflight, self.sessions


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    pod: str
    wait_s: float = 0.0
    extra: dict = field(default_factory=dict)
    routed_experts: np.ndarray | None = None
    """int16 [prompt + generated tokens, layers, top_k] MoE expert ids (-1: not recorded), when asked for."""


class PodFailed(Exception):
    """The pod could not answer; the request may be resent to another pod."""

    def __init__(self, pod: Pod, reason: str) -> None:
        super().__init__(f"rollout pod {pod.url} failed: {reason}")
        self.pod = pod
        self.reason = reason


def _pod_error_fields(answer: dict | bytes) -> tuple[str, str | None]:
    """The pod's error ``code`` (e.g. ``invalid_image``) and its ``param`` in the client's terms: a sampling
    field keeps its name, an image is in ``messages``; a field the client did not name itself (the prompt's
    token ids, a constraint built from response_format or tool_choice) is left unnamed."""
    try:
        error = json.loads(answer)["error"] if isinstance(answer, bytes) else answer["error"]
        code, param = error.get("code"), error.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "invalid_request", None
    if isinstance(param, str) and param.startswith("images"):
        param = "messages"
    elif isinstance(param, str) and param.startswith("sampling_params.") and "structured_outputs" not in param:
        param = param.removeprefix("sampling_params.")
    else:
        param = None
    return (code if isinstance(code, str) and code else "invalid_request"), param


def _error_text(answer: dict | bytes) -> str:
    """A pod error's message: from the OpenAI error object of a stream answer line or a JSON body, else the raw
    text."""
    parsed: Any = answer
    if isinstance(answer, bytes):
        try:
            parsed = json.loads(answer)
        except ValueError:
            return answer[:500].decode(errors="replace")
    try:
        return str(parsed["error"]["message"])
    except (KeyError, TypeError):
        return repr(parsed)[:500]


def _token_ids(raw: object) -> list[int]:
    if type(raw) is list and all(type(t) is int for t in raw):
        return raw
    raise ValueError(f"token_ids must be a list of integers, got {str(raw)[:200]}")


def _logprob_list(raw: object, token_ids: list[int]) -> list[float]:
    """Accept plain floats, or per-token {id: logprob} / {"logprob": x} entries; each one finite."""
    if (
        type(raw) is list
        and len(raw) == len(token_ids)
        and all(type(x) is float for x in raw)
        and math.isfinite(sum(raw))
    ):  # the usual answer, checked in one pass (a NaN or inf makes the sum one)
        return raw
    if not isinstance(raw, list) or len(raw) != len(token_ids):
        raise ValueError(f"{0 if not isinstance(raw, list) else len(raw)} logprobs for {len(token_ids)} tokens")
    out = []
    for tok, lp in zip(token_ids, raw):
        if isinstance(lp, dict):
            lp = lp.get("logprob", lp.get(str(tok), lp.get(tok)))
            if isinstance(lp, dict):
                lp = lp.get("logprob")
        if not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"logprob for token {tok} is {lp!r}")
        out.append(float(lp))
    return out


def _routed_experts(raw: object) -> np.ndarray | None:
    """A pod output's ``{"dtype", "shape", "data": base64}`` routed experts as int16 [tokens, layers, top_k]."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("dtype") != "int16":
        raise ValueError(f"routed_experts must be int16 bytes + shape, got {str(raw)[:200]}")
    shape = raw.get("shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(type(n) is int and n >= 0 for n in shape)):
        raise ValueError(f"routed_experts shape {shape!r} is not [tokens, layers, top_k]")
    return np.frombuffer(base64.b64decode(raw["data"]), "<i2").reshape(shape)


def _readyz(body: bytes) -> tuple[str, int | None]:
    """The vocabulary fingerprint ("" when none) and the bound on top_logprobs (None when none) a pod's /readyz
    reports."""
    try:
        data = json.loads(body)
    except ValueError:
        return "", None
    data = data if isinstance(data, dict) else {}
    vocab, bound = data.get("vocab"), data.get("max_logprobs")
    return vocab if isinstance(vocab, str) else "", bound if type(bound) is int else None


class PodPool:
    def __init__(
        self,
        urls: list[str],
        client: PodTransport,
        metrics: Metrics,
        health_interval_s: float = 2.0,
        stream: bool = True,
        return_routed_experts: bool = False,
        vocab: str = "",
        top_logprobs: int = 0,
    ) -> None:
        self.pods = {u: Pod(u) for u in urls}
        self.vocab = vocab
        """The gateway's ``molt.vocab.vocab_fingerprint``: a pod whose /readyz reports another is never routed to."""
        self.top_logprobs = top_logprobs
        """--rollout.top_logprobs: a pod whose /readyz reports a lower bound would refuse every captured turn."""
        self.return_routed_experts = return_routed_experts
        self.client = client
        self.metrics = metrics
        self.health_interval_s = health_interval_s
        self.policy_version = 0
        for pod in self.pods.values():
            metrics["molt_gateway_pod_healthy"].labels(pod.url).set(1)
            # read when /metrics is scraped, not set twice per call (each set takes the gauge's lock)
            metrics["molt_gateway_pod_inflight_requests"].labels(pod.url).set_function(lambda p=pod: p.inflight)
            if stream and isinstance(client, HttpTransport):
                assert client.timeout.connect is not None and client.timeout.total is not None  # set by HttpTransport
                pod.channel = PodChannel(pod.url, client.timeout.connect, client.timeout.total, client.pod_token)

    def get(self, url: str) -> Pod:
        return self.pods[url]

    def pick(self, exclude: set[str] | frozenset[str] = frozenset()) -> Pod:
        """The least-loaded healthy pod (in-flight requests, then sticky sessions, then random)."""
        candidates = [p for p in self.pods.values() if p.healthy and p.url not in exclude]
        if not candidates:
            if not self.pods:
                raise PodUnavailable("no rollout pods configured: pass --rollout.urls http://HOST:PORT")
            raise PodUnavailable("no healthy rollout pod is available; retry shortly")
        best = min(p.load for p in candidates)
        return random.choice([p for p in candidates if p.load == best])

    def set_health(self, pod: Pod, healthy: bool, reason: str = "") -> None:
        if pod.healthy != healthy:
            log.warning("rollout pod %s is now %s %s", pod.url, "healthy" if healthy else "unhealthy", reason)
        pod.healthy = healthy
        pod.last_error = reason
        self.metrics["molt_gateway_pod_healthy"].labels(pod.url).set(1 if healthy else 0)

    async def generate(
        self,
        pod: Pod,
        prompt_ids: list[int],
        sampling_params: dict,
        on_tokens: Callable[[list[int], list[float]], None] | None = None,
        images: list[str] | None = None,
    ) -> list[Generation]:
        """One generate call, over the pod's stream where it has one; one Generation per output (n > 1 only
        for session-less requests). ``on_tokens`` gets the tokens as the pod generates them where the pod is
        reached over its stream (else nothing: the Generation alone holds them). With ``images`` (base64 files,
        one per image token in the prompt, in order) each Generation's ``extra["prompt_token_ids"]`` is the
        prompt as the model saw it (image tokens expanded)."""
        body = generate_body(prompt_ids, sampling_params)
        if self.return_routed_experts:
            body = body[:-1] + b',"return_routed_experts":true}'
        if images:
            body = body[:-1] + b',"images":' + json.dumps([{"data": b} for b in images]).encode() + b"}"
        answer: dict | bytes
        with self._calling(pod):
            if pod.channel is not None:
                status, answer, start, answered = await pod.channel.generate(body, on_tokens)
            else:
                start = time.perf_counter()
                status, answer, answered = await self.client.post_json(pod.url + "/v1/generate", body)
        wait_s = answered - start  # until the answer arrived: any wait on the event loop after that is ours
        self._check_status(pod, status, answer)
        try:
            data = json_loads(answer) if isinstance(answer, bytes) else answer
            version = int(data.get("policy_version", 0))
            gens = []
            for out in data["outputs"]:
                ids = _token_ids(out["token_ids"])
                finish = out.get("finish_reason") or "stop"
                if isinstance(finish, dict):
                    finish = finish.get("type", "stop")
                gens.append(
                    Generation(
                        ids,
                        _logprob_list(out.get("logprobs"), ids),
                        str(finish),
                        int(out.get("policy_version", version)),
                        pod.url,
                        wait_s,
                        routed_experts=_routed_experts(out.get("routed_experts")),
                    )
                )
            for gen, out in zip(gens, data["outputs"]):
                top = out.get("top_logprobs")
                if top is not None:
                    if type(top) is not list or len(top) != len(gen.token_ids):  # rows the capture cannot align
                        raise ValueError(f"top_logprobs must be one row per token ({len(gen.token_ids)})")
                    gen.extra["top_logprobs"] = top
            if not gens:
                raise ValueError("no outputs")
            if images:
                seen = _token_ids(data.get("prompt_token_ids"))
                for gen in gens:
                    gen.extra["prompt_token_ids"] = seen
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            # Never record tokens we cannot align with logprobs: treat it as a failed pod.
            self.set_health(pod, False, f"malformed answer: {exc}")
            raise PodFailed(pod, f"malformed /v1/generate answer ({exc})") from None
        pod.policy_version = version
        self.policy_version = max(self.policy_version, version)
        return gens

    @contextlib.contextmanager
    def _calling(self, pod: Pod) -> Iterator[None]:
        """One call in flight on ``pod``; a connection failure marks it unhealthy and is its PodFailed."""
        pod.inflight += 1
        try:
            yield
        except PodConnectionError as exc:
            self.set_health(pod, False, str(exc))
            raise PodFailed(pod, str(exc)) from None
        finally:
            pod.inflight -= 1

    def _check_status(self, pod: Pod, status: int, answer: dict | bytes) -> None:
        """PodFailed (and the pod marked unhealthy) for a pod's own failure, a 400 GatewayError for a request it
        refused."""
        if status >= 500 or status == 401:  # 401: this gateway lacks the pod's service token, not the caller's fault
            self.set_health(pod, False, f"HTTP {status}")
            raise PodFailed(pod, f"HTTP {status}: {_error_text(answer)}")
        if status >= 400:
            code, param = _pod_error_fields(answer)
            raise GatewayError(400, f"rollout pod rejected the request: {_error_text(answer)}", code=code, param=param)

    async def prompt_logprobs(
        self, pod: Pod, token_ids: list[int], routed: bool = False
    ) -> tuple[list[float], int, np.ndarray | None]:
        """One prefill pass over ``token_ids`` (POST /v1/prompt_logprobs): log p(t_i | t_<i) for i >= 1, the
        policy version that computed them and, with ``routed``, the MoE routing of every token from the same pass
        (int16 [tokens, layers, top_k]; None when the pod sent none). Fails as ``generate`` does: PodFailed for the
        pod's own failure (marked unhealthy until its next good probe), a 400 GatewayError for a request it
        refuses."""
        body = (
            b'{"token_ids":' + msgspec.json.encode(token_ids) + (b',"return_routed_experts":true}' if routed else b"}")
        )
        with self._calling(pod):
            status, answer, _ = await self.client.post_json(pod.url + "/v1/prompt_logprobs", body)
        self._check_status(pod, status, answer)
        try:
            data = json_loads(answer)
            version = data["policy_version"]
            if type(version) is not int or version < 0:
                raise ValueError(f"policy_version {version!r}")
            logprobs = _logprob_list(data["logprobs"], token_ids[1:])
            if logprobs and max(logprobs) > 1e-4:  # the schema's bound: a record the trainer would refuse
                raise ValueError(f"a logprob above 0 ({max(logprobs)})")
            rows = _routed_experts(data.get("routed_experts")) if routed else None
            if rows is not None and rows.shape[0] != len(token_ids):
                raise ValueError(f"{rows.shape[0]} routed-experts rows for {len(token_ids)} tokens")
        except (ValueError, KeyError, TypeError) as exc:
            self.set_health(pod, False, f"malformed answer: {exc}")
            raise PodFailed(pod, f"malformed /v1/prompt_logprobs answer ({exc})") from None
        return logprobs, version, rows

    def close(self) -> None:
        for pod in self.pods.values():
            if pod.channel is not None:
                pod.channel.close()

    # ---- health

    async def probe(self, pod: Pod) -> None:
        try:
            status, body = await self.client.get(pod.url + "/readyz", timeout_s=2.0)
            ok, why = status == 200, f"readyz HTTP {status}"
        except PodConnectionError as exc:
            ok, why = False, str(exc)
        theirs, bound = _readyz(body) if ok else ("", None)
        if self.vocab and theirs not in ("", self.vocab):
            ok = False
            why = (
                f"it serves another vocabulary than the gateway's --model.path (fingerprint {theirs}, the "
                f"gateway's {self.vocab}): the ids the gateway sends would mean other tokens there; start the "
                "pod and the gateway on the same model"
            )
        elif bound is not None and bound < self.top_logprobs:
            ok = False
            why = (
                f"it returns at most {bound} alternatives per token, fewer than the gateway's --rollout.top_logprobs "
                f"{self.top_logprobs}: start the pod with --vllm.max_logprobs {self.top_logprobs}"
            )
        self.set_health(pod, ok, "" if ok else why)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(p) for p in self.pods.values()))

    async def health_loop(self) -> None:
        """Probes every pod each ``health_interval_s``; the first round is the caller's (``probe_all`` before
        serving), so no request reaches a pod that is down or serves another vocabulary."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.probe_all()
