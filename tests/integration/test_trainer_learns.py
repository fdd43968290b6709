"""On a toy task, a tiny model fed through the real Redis stream learns: mean reward rises clearly.

The trainer runs in-process (a world of one) and publishes every new policy to a callback; a
producer thread samples groups from the latest published weights with plain transformers sampling
(temperature 1, no processors, so rollout log-probs are exact), scores them, and writes trajectories
to the stream strictly on-policy (``--train.force_sync_mode``: batch k waits for version k), so the
trainer's recomputed log-probs must match the sampler's (mismatch KL ~ 0). Toy reward: the fraction of
generated tokens whose id is below half the vocabulary (random init starts near 0.5).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from molt.bus.redis_stream import RedisTrajectoryQueue
from molt.config import parse_settings
from molt.schema import Segment, Trajectory
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.model import init_distributed
from services.trainer.publish import CallbackPublisher
from services.trainer.trainer import Trainer

STEPS, GROUPS, N, NEW_TOKENS, PROMPT = 16, 4, 4, 8, 4


class Producer(threading.Thread):
    def __init__(self, model_dir, redis_url, stream, steps: int = STEPS):
        super().__init__(daemon=True)
        self.steps = steps
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.half = self.model.config.vocab_size // 2
        self.redis_url, self.stream = redis_url, stream
        self.version, self.pending = 0, None
        self.cond = threading.Condition()
        self.rewards: list[float] = []
        self.error: BaseException | None = None
        self.rng = torch.Generator().manual_seed(0)

    def publish(self, version, tensors):  # trainer side (CallbackPublisher)
        with self.cond:
            self.pending = (version, {k: v.clone() for k, v in tensors.items()})
            self.cond.notify_all()

    @torch.no_grad()
    def sample(self, batch: int):
        prompts = torch.randint(3, self.model.config.vocab_size, (GROUPS, PROMPT), generator=self.rng)
        ids = prompts.repeat_interleave(N, dim=0)
        logps = []
        for _ in range(NEW_TOKENS):
            logp = torch.log_softmax(self.model(input_ids=ids).logits[:, -1].float(), dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=self.rng)
            logps.append(logp.gather(-1, tok))
            ids = torch.cat([ids, tok], dim=1)
        logps = torch.cat(logps, dim=1)
        trajs = []
        for i in range(GROUPS * N):
            gen = ids[i, PROMPT:]
            reward = float((gen < self.half).float().mean())
            self.rewards.append(reward)
            seg = Segment(
                ids[i].numpy(), [[PROMPT, PROMPT + NEW_TOKENS]], logps[i].numpy(), np.full(NEW_TOKENS, self.version)
            )
            trajs.append(Trajectory(f"b{batch}-{i}", f"b{batch}-g{i // N}", i % N, [seg], reward))
        return trajs

    def run(self):
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test
            self.error = exc

    async def _run(self):
        q = RedisTrajectoryQueue(self.redis_url, self.stream)
        for batch in range(self.steps):
            with self.cond:  # force_sync_mode: batch k is generated with the weights of version k
                while self.version < batch:
                    if self.pending is None:
                        self.cond.wait(timeout=60)
                    if self.pending is not None:
                        self.version, sd = self.pending
                        self.pending = None
                        self.model.load_state_dict(sd, strict=False)
            await q.put_many(self.sample(batch))
        await q.close()


def test_mean_reward_rises_through_the_stream(tiny_qwen3, redis_url, stream_name, tmp_path):
    settings = parse_settings(
        TrainerSettings,
        [
            "--actor.model_name_or_path",
            str(tiny_qwen3),
            "--train.dispatch",
            "false",
            "--redis.url",
            redis_url,
            "--redis.stream",
            stream_name,
            "--algo.advantage.estimator",
            "grpo",
            "--algo.kl.init_coef",
            "0",
            "--rollout.n_samples_per_prompt",
            str(N),
            "--rollout.batch_size",
            str(GROUPS),
            "--train.batch_size",
            str(GROUPS * N),
            "--train.micro_batch_size",
            str(GROUPS * N),
            "--actor.adam.lr",
            "1e-2",
            "--train.force_sync_mode",
            "--train.num_steps",
            str(STEPS),
            "--ckpt.path",  # its final model goes next to it, not into the working directory
            str(tmp_path / "ckpt" / "checkpoints"),
            "--fsdp.strategy",
            "torch",
            "--algo.advantage.is_correction_level",
            "token",
            "--algo.advantage.is_correction_mode",
            "trunc",
        ],
        environ={},
    )
    validate_settings(settings)
    producer = Producer(tiny_qwen3, redis_url, stream_name)
    info = init_distributed()
    trainer = Trainer(settings, info, publisher=CallbackPublisher(producer.publish))
    try:
        port = trainer.start_server()
        producer.start()
        start = time.monotonic()
        summary = trainer.run()
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz").json()
    finally:
        trainer.close()
        dist.destroy_process_group()
        asyncio.run(_delete(redis_url, stream_name))
    producer.join(timeout=30)
    assert producer.error is None, producer.error
    assert summary["steps"] == STEPS and ready["policy_version"] == STEPS
    per_batch = np.array(producer.rewards).reshape(STEPS, GROUPS * N).mean(axis=1)
    first, last = per_batch[:3].mean(), per_batch[-3:].mean()
    print(f"reward per batch {np.round(per_batch, 3)} in {time.monotonic() - start:.1f}s")
    assert last > first + 0.25, per_batch
    # Observability: staleness histogram, mismatch KL per pod, queue lag, loss terms.
    assert "molt_trainer_staleness_versions_bucket" in text
    assert 'molt_trainer_mismatch_kl{rollout_url="unknown"}' in text
    mismatch = float(text.split('molt_trainer_mismatch_kl{rollout_url="unknown"} ')[1].split()[0])
    assert abs(mismatch) < 1e-4  # exact sampler, same weights: trainer and rollout log-probs agree
    fresh = float(text.split("\nmolt_trainer_mismatch_kl_fresh ")[1].split()[0])  # numerics only: also ~0
    assert abs(fresh) < 1e-4
    assert f'molt_trainer_staleness_versions_bucket{{le="0.0"}} {STEPS * GROUPS * N * NEW_TOKENS}.0' in text
    assert 'molt_trainer_loss{term="policy_loss"}' in text and "molt_queue_pending_entries" in text
    assert 'molt_trainer_step_seconds_count{phase="train"} 16.0' in text


async def _delete(url, stream):
    q = RedisTrajectoryQueue(url, stream)
    await q.delete()
    await q.close()
