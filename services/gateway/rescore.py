"""--rollout.rescore_logprobs: at finish, each trainable segment's action logprobs are re-read through one
prefill pass on a pod (POST /v1/prompt_logprobs) and recorded instead of the decode-time ones.

Why: the trainer recomputes logprobs with a prefill-like forward. Where the engine's decode and prefill kernels
differ numerically (recurrent linear attention, e.g. Qwen3.x GDN), decode-time logprobs carry that kernel noise
into the mismatch KL and the importance ratio; prefill-time ones do not.

The replacement has to mean the same thing as what it replaces, so a segment keeps its decode logprobs, counted
by reason, unless all of this holds:

- ``sampling``: every turn drew from the model's own distribution (``plain_sampling``). vLLM's prompt logprobs
  are the raw log-softmax of the logits (prompt tokens skip the sampler), while the pods' decode logprobs are
  vLLM's processed ones (--vllm.logprobs_mode processed_logprobs): after temperature, top-k/top-p/min-p, penalties,
  logit bias, min_tokens and a grammar's mask. The two agree only when none of these changes the distribution.
- ``images``: the endpoint takes token ids only. A segment with MoE routing (--rollout.return_routed_experts)
  gets the routing of the same prefill pass with its logprobs, as the trainer replays the routing its logprobs
  came from; ``routed_experts``: the pod sent no routing with them.
- ``version``: every action token's policy version is the one the answering pod computed with.
- ``pod_error`` / ``refused``: no healthy pod answered, or the pod refused the segment (e.g. one that fills the
  pod's whole context: vLLM takes no prompt of --vllm.max_model_len tokens).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

import numpy as np

from molt.metrics import Metrics
from molt.schema import Segment, Trajectory
from services.gateway.errors import GatewayError, PodUnavailable
from services.gateway.pods import PodFailed, PodPool
from services.gateway.session import Session

log = logging.getLogger("molt.gateway")

# A pod's sampling params at the values that leave the model's distribution as it is (the pod's defaults).
_NEUTRAL = {
    "temperature": 1.0,
    "top_p": 1.0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
}


def plain_sampling(sp: dict) -> bool:
    """Whether a generate call with the pod sampling params ``sp`` samples from the model's own distribution, so
    that its processed logprobs are the raw log-softmax a prefill pass computes: temperature 1, no top-k, top-p or
    min-p cut, no penalty, no logit bias, no min_tokens (it masks the stop tokens), no grammar. ``top_k`` above
    the vocabulary keeps every token but is counted as a cut: the gateway does not know the vocabulary's size."""
    return (
        all(sp.get(k) in (None, v) for k, v in _NEUTRAL.items())
        and sp.get("top_k") in (None, -1, 0)
        and not sp.get("logit_bias")
        and not sp.get("structured_outputs")
    )


def action_positions(seg: Segment) -> np.ndarray:
    """int64[A]: the index in ``token_ids`` of each action token, in ``logprobs``' order."""
    return np.concatenate([np.arange(a, b) for a, b in seg.action_spans.tolist()])


def kept_before_scoring(seg: Segment, plain: bool) -> str | None:
    """Why ``seg`` keeps its decode logprobs without asking a pod (None: it is scored)."""
    if seg.images:
        return "images"
    if not plain:
        return "sampling"
    if seg.versions.min() != seg.versions.max():  # no one pod version can match every token
        return "version"
    return None


def replace_logprobs(
    seg: Segment, prefill: list[float], version: int, routing: np.ndarray | None = None
) -> float | None:
    """Put the prefill logprobs (``prefill[i - 1]`` is token i's) at ``seg``'s action tokens, and the pass's
    ``routing`` in place of a segment's own, when they come from the version that sampled them; the largest
    |decode - prefill|, or None when the versions differ."""
    if seg.versions.min() != version or seg.versions.max() != version:
        return None
    new = np.asarray(prefill, dtype="<f4")[action_positions(seg) - 1]
    gap = float(np.abs(new.astype(np.float64) - seg.logprobs.astype(np.float64)).max())
    seg.logprobs = new
    if routing is not None:
        seg.routed_experts = np.ascontiguousarray(routing, dtype="<i2")
    return gap


async def _prefill(
    pool: PodPool, token_ids: list[int], prefer: str | None, routed: bool
) -> tuple[list[float], int, np.ndarray | None] | str:
    """The prefill logprobs of ``token_ids``, their version and (``routed``) routing from the session's pod where
    it is healthy (the pod most likely still on the version that sampled them), else from the others in turn; or
    why none came."""
    tried: set[str] = set()
    while True:
        pod = pool.pods.get(prefer) if prefer else None
        if pod is None or not pod.healthy or pod.url in tried:
            try:
                pod = pool.pick(exclude=tried)
            except PodUnavailable:
                return "pod_error"
        try:
            return await pool.prompt_logprobs(pod, token_ids, routed)
        except PodFailed as exc:
            log.info("rescoring on %s failed (%s); trying another pod", pod.url, exc.reason)
            tried.add(pod.url)
        except GatewayError as exc:  # the request's fault (as for generate): not retried on another pod
            log.info("rollout pod %s refused a rescore: %s", pod.url, exc.message)
            return "refused"


async def _rescore_segment(pool: PodPool, seg: Segment, prefer: str | None) -> str | float:
    routed = seg.routed_experts is not None
    answer = await _prefill(pool, seg.token_ids.tolist(), prefer, routed)
    if isinstance(answer, str):
        return answer
    if routed and answer[2] is None:  # logprobs of one pass with the routing of another: not what replay needs
        return "routed_experts"
    gap = replace_logprobs(seg, *answer)
    return "version" if gap is None else gap


async def rescore(pool: PodPool, metrics: Metrics, finished: list[tuple[Session, Trajectory]]) -> None:
    """Rescore the trainable segments of the ``finished`` sessions' trajectories in place, all at once. Only the
    trajectories change: a finish retried after a 503 builds them again from the sessions and rescores anew."""
    jobs: list[Awaitable[str | float]] = []
    kept: list[str] = []
    for s, t in finished:
        states = [st for st in s.capture.segments if st.spans]  # the order Capture.trainable_segments keeps
        assert len(states) == len(t.segments)
        for st, seg in zip(states, t.segments):
            reason = kept_before_scoring(seg, st.plain)
            if reason is None:
                jobs.append(_rescore_segment(pool, seg, s.pod))
            else:
                kept.append(reason)
    outcomes = await asyncio.gather(*jobs)
    for outcome in outcomes:
        if isinstance(outcome, str):
            kept.append(outcome)
        else:
            metrics["molt_gateway_rescored_segments_total"].inc()
            metrics["molt_gateway_rescore_max_abs_diff"].observe(outcome)
    for reason in kept:
        metrics.child("molt_gateway_rescore_kept_segments_total", reason).inc()
    failed = sum(o in ("pod_error", "refused") for o in outcomes)
    if failed:
        log.warning(
            "could not rescore %d of %d segments (no pod answered, or it refused them): they keep their decode "
            "logprobs (--rollout.rescore_logprobs)",
            failed,
            len(outcomes),
        )
