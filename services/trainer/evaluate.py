"""``--eval.*``: Molt's evaluation, every ``--eval.steps`` train steps on ``--eval.dataset``.

Every prompt of the eval set runs ``--eval.n_samples_per_prompt`` episodes on the env workers with the eval
sampling params (``--eval.temperature``, ``--eval.top_p``, ``--eval.max_new_tokens``; unset: the rollout's).
Eval episodes are graded as usual but their gateway sessions are aborted, not finished, so nothing reaches
the trajectory stream or the loss. Metrics carry Molt's names, per ``datasource`` column (default
"default"): ``eval_<ds>_pass<n>`` (mean over prompts of the best reward), ``eval_<ds>_pass1`` (mean over
prompts of the mean reward), ``eval_<ds>_truncated_rate``, and over all: ``eval_truncated_rate``,
``eval_num_samples``, ``eval_failed`` (episodes that raised or timed out; left out of the means).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

from services.trainer.dispatch import EpisodeDispatcher, Prompt, PromptDataset

# As Molt: --data.max_samples caps the training prompts only; a small debug run still evaluates the whole
# eval set, so its pass@k stays comparable.
EVAL_ALL = 1 << 62
STOP_POLL_S = 0.5  # how often a running evaluation looks for a stop request


class Evaluator:
    def __init__(self, settings, dispatcher: EpisodeDispatcher) -> None:
        e, d, r = settings.eval, settings.data, settings.rollout
        self.cfg = e
        self.dataset = PromptDataset(
            e.dataset,
            d.input_key,
            d.label_key,
            chat=d.apply_chat_template,
            max_samples=EVAL_ALL,
            seed=0,
            tools_key=d.tools_key,
            image_key=d.image_key,
            max_images=d.max_images_per_prompt,
            flag="--eval.dataset",
            split=e.split,
        )
        self.dispatcher = dispatcher
        self.agent = settings.envs.agent
        self.max_len = d.max_len
        self.n = e.n_samples_per_prompt or r.n_samples_per_prompt
        self.groups_in_flight = e.batch_size or r.batch_size
        self.sampling = {
            "temperature": e.temperature if e.temperature is not None else r.temperature,
            "top_p": e.top_p if e.top_p is not None else r.top_p,
        }
        max_new = e.max_new_tokens or r.max_new_tokens
        if max_new:
            self.sampling["max_tokens"] = max_new

    def due(self, step: int) -> bool:
        return self.cfg.steps > 0 and step > 0 and step % self.cfg.steps == 0

    async def run(self, step: int, should_stop: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
        """Every eval prompt's ``n`` episodes, at most ``--eval.batch_size`` prompts' groups at a time; None when
        ``should_stop()`` turns true first (a SIGTERM: the trainer must save within its grace period, and a long
        evaluation would hold it past that)."""
        gate = asyncio.Semaphore(self.groups_in_flight)

        async def group(row: Prompt) -> list[tuple[Prompt, dict]]:
            async with gate:
                results = await asyncio.gather(*(self.dispatcher.run_episode(b) for b in self._bodies(row, step)))
            return [(row, res) for res in results]

        work = asyncio.ensure_future(asyncio.gather(*(group(row) for row in self.dataset.rows)))
        while not work.done():
            await asyncio.wait({work}, timeout=STOP_POLL_S)
            if should_stop() and not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                return None
        done = work.result()
        return eval_metrics([(row.datasource, row.index, res) for part in done for row, res in part], self.n)

    def _bodies(self, row: Prompt, step: int) -> list[dict]:
        """The ``n`` episode requests of one eval prompt (one group)."""
        extra = row.episode_fields()
        return [
            {
                "agent": self.agent,
                "prompt": row.prompt,
                "label": row.label,
                "eval": True,
                "group_id": f"eval-{step}-{row.index}",
                "sample_index": k,
                "sampling_params": self.sampling,
                "max_length": self.max_len,
                **extra,
            }
            for k in range(self.n)
        ]


def eval_metrics(outcomes: list[tuple[str, int, dict]], n: int) -> dict[str, float]:
    """``outcomes``: (datasource, prompt index, worker result) per episode."""
    rewards: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    truncated: dict[str, list[bool]] = defaultdict(list)
    lengths: dict[str, list[int]] = defaultdict(list)
    failed = 0
    for ds, index, res in outcomes:
        if res.get("status") != "ok":
            failed += 1
            continue
        rewards[ds][index].append(float(res.get("reward", 0.0)))
        truncated[ds].append(bool(res.get("truncated")))
        lengths[ds].append(int(res.get("response_tokens") or 0))
    out: dict[str, float] = {}
    for ds, by_prompt in rewards.items():
        out[f"eval_{ds}_pass1"] = sum(sum(v) / len(v) for v in by_prompt.values()) / len(by_prompt)
        if n > 1:
            out[f"eval_{ds}_pass{n}"] = sum(max(v) for v in by_prompt.values()) / len(by_prompt)
        out[f"eval_{ds}_truncated_rate"] = sum(truncated[ds]) / len(truncated[ds])
        out[f"eval_{ds}_response_length_mean"] = sum(lengths[ds]) / len(lengths[ds])
    done = [t for ts in truncated.values() for t in ts]
    every = [n for ns in lengths.values() for n in ns]
    out["eval_truncated_rate"] = sum(done) / len(done) if done else 0.0
    out["eval_response_length_mean"] = sum(every) / len(every) if every else 0.0
    out["eval_num_samples"] = float(len(done))
    out["eval_failed"] = float(failed)
    return out
