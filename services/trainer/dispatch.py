"""Dispatch: the prompt dataset and the HTTP client that runs episodes on env workers.

``PromptDataset`` reads a JSONL file (``--data.prompt_dataset``, ``--data.input_key``,
``--data.label_key``) and walks it in a seeded order per episode; its position is one integer (the
number of prompts dispatched), saved in checkpoints.

``EpisodeDispatcher.run_group`` sends ``--rollout.n_samples_per_prompt`` episodes of one prompt to
``POST /v1/episodes:run`` on the least-busy worker of ``--envs.urls``. A 429 waits its Retry-After
and tries another replica (not counted as a failure); an episode that failed without writing a
trajectory is retried up to ``--envs.max_retries`` times. The result is how many trajectories of the
group were written, which the controller hands to the group assembler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("molt.trainer")


@dataclass
class Prompt:
    index: int
    prompt: Any
    label: Any


class DispatchError(ValueError):
    """An env worker refused an episode as malformed or unknown (4xx other than 429): a configuration error,
    retrying cannot help."""


class PromptDataset:
    def __init__(self, path: str, input_key: str, label_key: str | None, *, chat: bool, max_samples: int,
                 seed: int) -> None:
        rows = []
        with open(Path(path)) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if input_key not in row:
                    raise ValueError(f"{path}:{lineno} has no {input_key!r} (--data.input_key); keys: {sorted(row)}")
                prompt = row[input_key]
                if chat and isinstance(prompt, str):
                    prompt = [{"role": "user", "content": prompt}]
                rows.append((prompt, row.get(label_key, "") if label_key else ""))
                if len(rows) >= max_samples:
                    break
        if not rows:
            raise ValueError(f"--data.prompt_dataset {path} holds no prompts")
        self.rows, self.seed = rows, seed

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, position: int) -> Prompt:
        """The prompt at global position ``position`` (episode = position // len, seeded order per episode)."""
        episode, offset = divmod(position, len(self.rows))
        order = list(range(len(self.rows)))
        random.Random(self.seed + episode).shuffle(order)
        prompt, label = self.rows[order[offset]]
        return Prompt(position, prompt, label)


class EpisodeDispatcher:
    def __init__(self, envs_cfg, rollout_cfg, max_len: int, metrics=None) -> None:
        self.cfg = envs_cfg
        self.n = rollout_cfg.n_samples_per_prompt
        self.sampling = {"temperature": rollout_cfg.temperature, "top_p": rollout_cfg.top_p}
        if rollout_cfg.max_new_tokens:
            self.sampling["max_tokens"] = rollout_cfg.max_new_tokens
        self.max_len = max_len
        self.inflight = {url.rstrip("/"): 0 for url in envs_cfg.urls}
        self.client = httpx.AsyncClient(timeout=envs_cfg.timeout_s)
        self.slots = asyncio.Semaphore(envs_cfg.max_inflight * len(self.inflight))
        self.failed = 0

    def _pick(self, avoid: set[str]) -> str:
        choices = [u for u in self.inflight if u not in avoid] or list(self.inflight)
        return min(choices, key=lambda u: (self.inflight[u], random.random()))

    async def run_episode(self, body: dict) -> dict:
        """One episode; returns the worker's result (status ok|failed|timeout) or a synthetic failure."""
        tries, throttled = 0, set()
        while True:
            url = self._pick(throttled)
            self.inflight[url] += 1
            try:
                async with self.slots:
                    resp = await self.client.post(url + "/v1/episodes:run", json=body)
            except httpx.HTTPError as exc:
                result = {"status": "failed", "written": False, "error": f"{type(exc).__name__}: {exc}"}
            else:
                if resp.status_code == 429:
                    throttled.add(url)
                    if len(throttled) >= len(self.inflight):
                        throttled.clear()
                        await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                    continue
                if resp.status_code in (400, 404, 422):
                    raise DispatchError(f"env worker {url} refused the episode with HTTP {resp.status_code}: "
                                        f"{resp.text[:300]} (check --envs.agent and the dataset's prompts)")
                result = resp.json() if resp.status_code == 200 else {
                    "status": "failed", "written": False, "error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
            finally:
                self.inflight[url] -= 1
            if result.get("written") or tries >= self.cfg.max_retries:
                if not result.get("written"):
                    self.failed += 1
                    log.warning("episode %s/%s failed for good: %s", body["group_id"], body["sample_index"],
                                result.get("error") or result.get("status"))
                return result
            tries += 1

    async def run_group(self, prompt: Prompt, group_id: str) -> int:
        """All samples of one prompt; returns how many trajectories were written."""
        bodies = [{"agent": self.cfg.agent, "prompt": prompt.prompt, "label": prompt.label, "group_id": group_id,
                   "sample_index": k, "sampling_params": self.sampling, "max_length": self.max_len}
                  for k in range(self.n)]
        results = await asyncio.gather(*(self.run_episode(b) for b in bodies))
        return sum(1 for r in results if r.get("written"))

    async def close(self) -> None:
        await self.client.aclose()
