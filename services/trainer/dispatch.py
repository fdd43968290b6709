"""Dispatch: the prompt dataset and the HTTP client that runs episodes on env workers.

``PromptDataset`` reads ``--data.prompt_dataset`` with ``molt.data.read_rows`` (a ``save_to_disk``
directory, parquet or JSONL, a file or a folder; ``--data.input_key``, ``--data.label_key``,
``--data.tools_key``, ``--data.image_key``) and walks it in a seeded order per episode; its position is one
integer (the number of prompts dispatched), saved in checkpoints.

``EpisodeDispatcher.run_group`` sends ``--rollout.n_samples_per_prompt`` episodes of one prompt to
``POST /v1/episodes:run`` on the least-busy worker of ``--envs.urls``. A 429 waits its Retry-After
and tries another replica (not counted as a failure); an unreachable worker (refused, reset, 502-504)
is an outage, waited out with capped exponential backoff (``--envs.retry_backoff_s`` doubling up to
``--envs.retry_backoff_max_s``) for as long as it lasts, and so is a worker's 503 for an episode that an
outage behind it stopped (the gateway or its pods unavailable); an episode that ran and wrote no trajectory is
retried up to ``--envs.max_retries`` times with the same backoff. The result is which samples of the
group were written, which the controller hands to the group assembler.

Each episode's HTTP timeout follows the worker that runs it: its /readyz reports its ``--envs.episode_timeout_s``
and ``--envs.finish_retry_s``, and the trainer waits their sum plus ``EPISODE_MARGIN_S`` (``--envs.timeout_s``
where longer), so a worker's limit is set in one place.

A failed episode's group is replaced by later prompts, so occasional failures cost only prompts; an env that
fails every episode would burn the whole dataset that way and train nothing. ``--envs.max_consecutive_failures``
training episodes failed for good in a row, with none written between them, stop the run with the last one's
error (as the env worker reported it: the exception's type and message, and the agent).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from molt.auth import INTERNAL_TOKEN_ENV, bearer_headers, internal_token_from_env
from molt.images import to_data_url

log = logging.getLogger("molt.trainer")
READY_POLL_S, READY_PROBE_TIMEOUT_S = 0.5, 5.0  # start-up wait for the env workers (EpisodeDispatcher.wait_ready)
# The worker's answer (its last gateway call, then the response) comes after its own limits: the trainer waits this
# much longer, so it never gives up on an episode the worker is still finishing.
EPISODE_MARGIN_S = 60.0
# The episode timeout for workers that report no limits on /readyz: their defaults (600 + 300) plus the margin.
FALLBACK_TIMEOUT_S = 960.0
CONNECT_TIMEOUT_S = 10.0
# Columns that hold the answer in common RL datasets (GSM8K, MATH, Molt's examples, verl's parquet).
LABEL_LIKE = frozenset({"answer", "label", "solution", "ground_truth", "reward_model"})


@dataclass
class Prompt:
    index: int
    prompt: Any
    label: Any
    tools: list[dict[str, Any]] | None = None
    datasource: str = "default"
    images: list[Any] | None = None
    """The row's images as the dataset holds them (``--data.image_key``); encoded when sent."""

    def episode_fields(self) -> dict[str, Any]:
        """The optional fields of this prompt's episode requests: tools, and images as data URLs."""
        fields: dict[str, Any] = {}
        if self.tools:
            fields["tools"] = self.tools
        if self.images:
            where = f"prompt row {self.index} images"
            fields["images"] = [to_data_url(image, f"{where}[{i}]") for i, image in enumerate(self.images)]
        return fields


def worker_limit_s(readyz: object) -> float | None:
    """How long one episode may take on an env worker whose /readyz answered ``readyz``: its
    ``episode_timeout_s`` plus ``finish_retry_s`` plus ``EPISODE_MARGIN_S``; None when it reports them not."""
    if not isinstance(readyz, dict):
        return None
    total = EPISODE_MARGIN_S
    for key in ("episode_timeout_s", "finish_retry_s"):
        v = readyz.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            return None
        total += v
    return total


class DispatchError(ValueError):
    """An env worker refused an episode as malformed or unknown (4xx other than 429): a configuration error,
    retrying cannot help."""


class PromptDataset:
    def __init__(
        self,
        path: str,
        input_key: str,
        label_key: str | None,
        *,
        chat: bool,
        max_samples: int,
        seed: int,
        tools_key: str | None = None,
        flag: str = "--data.prompt_dataset",
        split: str = "train",
        image_key: str = "images",
        max_images: int = 0,
        probs: str | None = None,
    ) -> None:
        """``max_images`` > 0 reads each row's ``image_key`` (one image or a list; a row with more than
        ``max_images`` is an error naming it); 0 reads no images (Molt's --data.max_images_per_prompt).
        ``path`` may name several comma-separated datasets, mixed by ``probs`` (``molt.data.read_mixed_rows``)."""
        from molt.data import read_mixed_rows

        rows = []
        unread = 0  # rows whose images --data.max_images_per_prompt 0 leaves unread
        for n, row in enumerate(read_mixed_rows(path, probs, split, max_samples, seed, flag)):
            if input_key not in row:
                raise ValueError(
                    f"{flag} {path}: row {n} has no {input_key!r} (--data.input_key); keys: {sorted(row)}"
                )
            prompt = row[input_key]
            if chat and isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            if not chat and isinstance(prompt, list):
                # As Molt: completion-style data is a pre-rendered string; messages without the flag
                # would reach the model untemplated.
                raise ValueError(
                    f"{flag} {path}: row {n}'s {input_key!r} holds chat messages: pass --data.apply_chat_template"
                )
            if label_key and label_key not in row:
                raise ValueError(
                    f"{flag} {path}: row {n} has no {label_key!r} (--data.label_key); keys: {sorted(row)}"
                )
            tools = row.get(tools_key) if tools_key else None
            if isinstance(tools, str):  # Molt's datasets may store the tool schemas as a JSON string
                tools = json.loads(tools) if tools.strip() else None
            images = row.get(image_key) if max_images else None
            unread += bool(not max_images and row.get(image_key))
            if images is not None and not isinstance(images, list | tuple):
                images = [images]
            if images and len(images) > max_images:
                raise ValueError(
                    f"{flag} {path}: row {n} has {len(images)} images in {image_key!r}; "
                    f"--data.max_images_per_prompt is {max_images}"
                )
            rows.append(
                Prompt(
                    n,
                    prompt,
                    row[label_key] if label_key else "",
                    tools or None,
                    str(row.get("datasource") or "default"),
                    list(images) if images else None,
                )
            )
        if not rows:
            raise ValueError(f"{flag} {path} holds no prompts")
        if unread:
            # As Molt, 0 is text-only; said once, since a vision-language run would otherwise train blind.
            log.warning(
                "%s %s: %d of %d rows hold images in %r that are not read: --data.max_images_per_prompt is 0 "
                "(text-only); set it to the most images a row holds for a vision-language model",
                flag,
                path,
                unread,
                len(rows),
                image_key,
            )
        labelled = sorted(LABEL_LIKE & set(row)) if not label_key else []
        if labelled:
            # Every label would be "" and a label-checking reward would score nothing, silently.
            log.warning(
                "%s %s has a %r column but no --data.label_key: every prompt's label is empty; pass "
                "--data.label_key %s if the env's reward reads it",
                flag,
                path,
                labelled[0],
                labelled[0],
            )
        self.rows, self.seed = rows, seed
        self._order: tuple[int, list[int]] = (-1, [])

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, position: int) -> int:
        """The dataset row at global position ``position`` (episode = position // len, seeded order per
        episode). The order of the current episode is kept: shuffling the whole dataset per prompt is O(n)."""
        episode, offset = divmod(position, len(self.rows))
        if self._order[0] != episode:
            order = list(range(len(self.rows)))
            random.Random(self.seed + episode).shuffle(order)
            self._order = (episode, order)
        return self._order[1][offset]

    def get(self, position: int) -> Prompt:
        """The prompt at global position ``position`` (its ``index``; ``row`` tells which row it is)."""
        row = self.rows[self.row(position)]
        return Prompt(position, row.prompt, row.label, row.tools, row.datasource, row.images)


class EpisodeDispatcher:
    def __init__(self, envs_cfg, rollout_cfg, max_len: int, metrics=None) -> None:
        self.cfg = envs_cfg
        self.n = rollout_cfg.n_samples_per_prompt
        self.sampling = {"temperature": rollout_cfg.temperature, "top_p": rollout_cfg.top_p}
        if rollout_cfg.max_new_tokens:
            self.sampling["max_tokens"] = rollout_cfg.max_new_tokens
        self.max_len = max_len
        self.inflight = {url.rstrip("/"): 0 for url in envs_cfg.urls}
        # Env workers guarded by the service token (MOLT_INTERNAL_TOKEN) need it on every episode.
        # No pool cap of httpx's own (100): ``slots`` bounds the episodes in flight, which may be more, and one
        # waiting for a pooled connection would time out as if its worker were down.
        self.client = httpx.AsyncClient(
            timeout=envs_cfg.timeout_s or FALLBACK_TIMEOUT_S,
            headers=bearer_headers(internal_token_from_env()),
            limits=httpx.Limits(max_connections=None),
        )
        self.worker_limits: dict[str, float] = {}
        """Per worker URL, the longest episode its /readyz reported (``worker_limit_s``)."""
        self.slots = asyncio.Semaphore(envs_cfg.max_inflight * len(self.inflight))
        self.failed = 0
        self.consecutive_failures = 0  # training episodes failed for good since the last one written
        self.last_failure: str | None = None
        self.outage_retries = 0
        self.unreachable: set[str] = set()

    async def wait_ready(self, stopping: Callable[[], bool]) -> None:
        """Before the first episode: until some env worker's /readyz answers other than an outage would (refused,
        502-504; a worker answers 503 until its gateway and the gateway's pods can serve). Services start in any
        order (Kubernetes, `molt up`): episodes sent earlier would each meet the outage and its backoff. Logged
        once; ``stopping`` ends the wait. Every worker is probed, so each one's limits are known (``_probe``)."""
        logged = False
        while self.inflight and not stopping():
            urls = list(self.inflight)
            answers = await asyncio.gather(*(self._probe(url) for url in urls))
            if None in answers:
                return
            if not logged:
                log.info("waiting for an env worker to be ready (%s: %s)", urls[0], answers[0])
                logged = True
            await asyncio.sleep(READY_POLL_S)

    async def _probe(self, url: str) -> str | None:
        """Probe ``url``'s /readyz: None when it answered other than an outage would (learning its limits from a
        200), else why not."""
        try:
            resp = await self.client.get(url + "/readyz", timeout=READY_PROBE_TIMEOUT_S)
        except httpx.TransportError as exc:
            return f"{type(exc).__name__}: {exc}"
        if resp.status_code in (502, 503, 504):
            return f"HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code == 200:
            try:
                self._learn(url, resp.json())
            except ValueError:  # a worker of one's own making may answer other than JSON
                pass
        return None

    def _learn(self, url: str, readyz: object) -> None:
        """Record the limits a worker reported; only ever raised (a Service's pods may differ mid-rollout)."""
        limit = worker_limit_s(readyz)
        if limit is None or limit <= self.worker_limits.get(url, 0.0):
            return
        self.worker_limits[url] = limit
        assert isinstance(readyz, dict)  # worker_limit_s read it
        limits = f"its --envs.episode_timeout_s {readyz['episode_timeout_s']:g} + --envs.finish_retry_s "
        limits += f"{readyz['finish_retry_s']:g} + {EPISODE_MARGIN_S:g} s"
        configured = self.cfg.timeout_s
        if configured is not None and configured < limit:
            log.warning(
                "env worker %s may take %g s per episode (%s); the trainer's --envs.timeout_s %g would cut such "
                "episodes and run them again: waiting %g s (raise --envs.timeout_s, or leave it unset to follow "
                "the workers)",
                url,
                limit,
                limits,
                configured,
                limit,
            )
        else:
            log.info("episodes on env worker %s: HTTP timeout %g s (%s)", url, self.episode_timeout_s(url), limits)

    def episode_timeout_s(self, url: str) -> float:
        """The HTTP timeout of an episode on ``url``: what the worker reported (or, unprobed, the most any other
        did), at least ``--envs.timeout_s``. An explicit value below a worker's is raised, not obeyed: the worker
        bounds its episodes itself, so a shorter cut would only run a finishing episode again (and a refusal would
        stop a run whose workers were merely reconfigured)."""
        limit = self.worker_limits.get(url) or max(self.worker_limits.values(), default=None)
        configured = self.cfg.timeout_s
        if limit is None:
            return configured or FALLBACK_TIMEOUT_S
        return max(configured or 0.0, limit)

    def _pick(self, avoid: set[str]) -> str:
        choices = [u for u in self.inflight if u not in avoid] or list(self.inflight)
        return min(choices, key=lambda u: (self.inflight[u], random.random()))

    async def _backoff(self, delay: float) -> float:
        await asyncio.sleep(delay * random.uniform(0.8, 1.2))
        return min(delay * 2, self.cfg.retry_backoff_max_s)

    async def run_episode(self, body: dict) -> dict:
        """One episode; returns the worker's result (status ok|failed|timeout) or a synthetic failure.

        An outage (no worker reachable, or 502/503/504) is waited out however long it lasts, with capped
        exponential backoff: an outage must not burn the dataset. An episode that ran and wrote nothing is
        retried ``--envs.max_retries`` times with the same backoff before it counts as failed."""
        failures, throttled, down = 0, set[str](), set[str]()
        delay = self.cfg.retry_backoff_s
        while True:
            url = self._pick(throttled | down)
            self.inflight[url] += 1
            outage, timed_out = None, False
            timeout_s = self.episode_timeout_s(url)
            try:
                async with self.slots:
                    # A worker that does not accept the connection is down (an outage), however long episodes run.
                    timeout = httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S)
                    resp = await self.client.post(url + "/v1/episodes:run", json=body, timeout=timeout)
            except httpx.TimeoutException as exc:  # the episode outlived episode_timeout_s(url)
                error = (
                    f"{type(exc).__name__}: no answer within {timeout_s:g} s (the episode timeout, --envs.timeout_s)"
                )
                result = {"status": "failed", "written": False, "error": error}
                if isinstance(exc, httpx.ConnectTimeout):
                    outage = str(exc)
                else:
                    timed_out = True
            except httpx.TransportError as exc:  # refused, reset, worker died mid-episode
                outage = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code == 429:
                    throttled.add(url)
                    if len(throttled) >= len(self.inflight):
                        throttled.clear()
                        await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                    continue
                if resp.status_code == 401:  # a deployment mistake: every episode would be refused alike
                    raise DispatchError(
                        f"env worker {url} refused the episode with HTTP 401: {resp.text[:300]} (give the trainer "
                        f"the {INTERNAL_TOKEN_ENV} the env workers run with)"
                    )
                if resp.status_code in (400, 404, 422):
                    raise DispatchError(
                        f"env worker {url} refused the episode with HTTP {resp.status_code}: "
                        f"{resp.text[:300]} (check --envs.agent and the dataset's prompts)"
                    )
                if resp.status_code in (502, 503, 504):
                    outage = f"HTTP {resp.status_code}: {resp.text[:200]}"
                result = (
                    resp.json()
                    if resp.status_code == 200
                    else {"status": "failed", "written": False, "error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
                )
            finally:
                self.inflight[url] -= 1
            if timed_out:  # the worker may have restarted with a longer limit since it was last probed
                await self._probe(url)
            if outage is not None:
                if url not in self.unreachable:  # once per outage, not once per episode
                    self.unreachable.add(url)
                    log.warning("env worker %s, or a service behind it, unavailable (%s): episodes wait", url, outage)
                down.add(url)
                self.outage_retries += 1
                if len(down) >= len(self.inflight):  # every replica is down: back off, then try them all again
                    down.clear()
                    delay = await self._backoff(delay)
                continue
            if url in self.unreachable:
                self.unreachable.discard(url)
                log.warning("env worker %s is back", url)
            if result.get("written") or (body.get("eval") and result.get("status") == "ok"):
                if not body.get("eval"):
                    self.consecutive_failures = 0
                return result  # an eval episode writes nothing by design
            if failures >= self.cfg.max_retries:
                self._failed_for_good(body, url, failures + 1, result)
                return result
            failures += 1
            delay = await self._backoff(delay)

    def _failed_for_good(self, body: dict, url: str, tries: int, result: dict) -> None:
        """Count a failed episode; raise ``DispatchError`` once too many training episodes failed in a row."""
        self.failed += 1
        reason = result.get("error") or result.get("status")
        where = f"episode {body['group_id']}/{body['sample_index']} of agent {body['agent']!r} on {url}"
        log.warning("%s failed for good after %d tries: %s", where, tries, reason)
        if body.get("eval"):  # evaluation failures show in the eval metrics; the counter guards training
            return
        self.consecutive_failures += 1
        self.last_failure = f"{where}: {reason}"
        limit = self.cfg.max_consecutive_failures
        if limit and self.consecutive_failures >= limit:
            raise DispatchError(
                f"{self.consecutive_failures} episodes in a row failed for good ({tries} tries each, "
                f"--envs.max_retries {self.cfg.max_retries}) and none wrote a trajectory; the last, "
                f"{self.last_failure} (fix the env, its traceback is in the env worker's log; "
                f"--envs.max_consecutive_failures {limit} sets how many failures in a row stop the run, 0 never)"
            )

    async def run_group(self, prompt: Prompt, group_id: str, samples: list[int] | None = None) -> list[int]:
        """The episodes ``samples`` (default: all) of one prompt; returns the sample indices written."""
        samples = list(range(self.n)) if samples is None else samples
        bodies = [
            {
                "agent": self.cfg.agent,
                "prompt": prompt.prompt,
                "label": prompt.label,
                "group_id": group_id,
                "sample_index": k,
                "sampling_params": self.sampling,
                "max_length": self.max_len,
            }
            for k in samples
        ]
        extra = prompt.episode_fields()
        for b in bodies:
            b.update(extra)
        results = await asyncio.gather(*(self.run_episode(b) for b in bodies))
        return [k for k, r in zip(samples, results) if r.get("written")]

    async def close(self) -> None:
        await self.client.aclose()
