"""Shared helpers of the trainer integration tests (no tests here): synthetic trajectories, a subprocess runner."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from molt.bus.redis_stream import RedisTrajectoryQueue
from molt.schema import Segment, Trajectory
from molt.serve import cpu_env

ROOT = Path(__file__).resolve().parents[2]


def synthetic_groups(num_groups: int, n: int, seed: int = 0, vocab: int = 1000) -> list[Trajectory]:
    """Random prompt + response tokens, reward = sample index (so group baselines are non-zero)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        prompt = rng.integers(3, vocab, 4 + g % 3)
        for k in range(n):
            resp = rng.integers(3, vocab, 3 + (g + 2 * k) % 6)
            tokens = np.concatenate([prompt, resp])
            logp = -rng.uniform(0.1, 3.0, len(resp))
            seg = Segment(tokens, [[len(prompt), len(tokens)]], logp, np.zeros(len(resp), dtype=int))
            out.append(Trajectory(f"g{g}-s{k}-{seed}", f"g{g}-{seed}", k, [seg], reward=float(k % 2)))
    return out


def put(redis_url: str, stream: str, trajs: list[Trajectory]) -> None:
    async def go():
        q = RedisTrajectoryQueue(redis_url, stream)
        await q.put_many(trajs)
        await q.close()

    asyncio.run(go())


def delete_stream(redis_url: str, stream: str) -> None:
    async def go():
        q = RedisTrajectoryQueue(redis_url, stream)
        await q.delete()
        await q.close()

    asyncio.run(go())


def stream_flags(model, redis_url: str, stream: str, tmp: Path, *extra: str) -> list[str]:
    """A stream-only trainer (no dispatch) resuming from ``tmp``/ckpt: RLOO over groups of 2, one group a step,
    consumer ``trainer-a``, its step audit in ``tmp``/audit.jsonl."""
    return [
        *("--actor.model_name_or_path", str(model), "--train.dispatch", "false"),
        *("--redis.url", redis_url, "--redis.stream", stream, "--train.consumer", "trainer-a"),
        *("--algo.advantage.estimator", "rloo", "--algo.kl.init_coef", "0", "--rollout.n_samples_per_prompt", "2"),
        *("--rollout.batch_size", "1", "--train.batch_size", "2", "--ckpt.load_enable"),
        *("--logger.steps_jsonl", str(tmp / "audit.jsonl"), "--fsdp.strategy", "torch"),
        *extra,
    ]


def lag(redis_url: str, stream: str):
    async def go():
        q = RedisTrajectoryQueue(redis_url, stream)
        try:
            return await q.lag()
        finally:
            await q.close()

    return asyncio.run(go())


def consumed(redis_url: str, stream: str, ids: list[str]) -> list[bool]:
    async def go():
        q = RedisTrajectoryQueue(redis_url, stream)
        try:
            return await q.consumed(ids)
        finally:
            await q.close()

    return asyncio.run(go())


def dispatch_flags(tmp_path: Path, prompts: int, model, redis_url: str, stream: str, *envs: str) -> list[str]:
    """The trainer flags a dispatch test starts from: ``prompts`` question/answer rows written to a JSONL dataset
    under ``tmp_path``, the model, the stream and the env workers at ``envs``."""
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"question": f"q{i}", "answer": i}) + "\n" for i in range(prompts)))
    return [
        *("--actor.model_name_or_path", str(model), "--redis.url", redis_url, "--redis.stream", stream),
        *("--data.prompt_dataset", str(dataset), "--data.input_key", "question", "--data.label_key", "answer"),
        *("--envs.urls", *envs),
    ]


def grpo_run_flags(n: int, steps: int) -> list[str]:
    """The small GRPO run the fault tests train: one prompt of ``n`` samples per dispatch, two per step, no KL."""
    return [
        *("--algo.advantage.estimator", "grpo", "--algo.kl.init_coef", "0"),
        *("--rollout.n_samples_per_prompt", str(n), "--rollout.batch_size", "1"),
        *("--train.batch_size", "2", "--train.num_steps", str(steps)),
    ]


def trainer_cmd(nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "services.trainer"]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc_per_node={nproc}", "-m", "services.trainer"]


def env() -> dict[str, str]:
    e = cpu_env({**os.environ, "PYTHONPATH": str(ROOT)})
    e.pop("MOLT_TRAINER_TEST_HOLD_BEFORE_ACK_STEP", None)
    return e


def run_trainer(flags: list[str], nproc: int = 1, timeout: float = 120, extra_env: dict | None = None):
    proc = subprocess.run(
        trainer_cmd(nproc) + flags,
        cwd=ROOT,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"trainer exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def audit(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_cli_in_sequence(argvs_json: str) -> None:
    """One rank of a torchrun launch: ``services.trainer``'s main on each argv in turn, so several runs pay the
    launch's start-up once. The process group is kept until the last run: torchrun's store serves one group."""
    import torch.distributed as dist

    from services.trainer.__main__ import main

    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        for argv in json.loads(argvs_json):
            main(argv)
    finally:
        dist.destroy_process_group = destroy
    destroy()


def run_trainer_cli_in_sequence(argvs: list[list[str]], nproc: int, timeout: float = 300):
    """``run_cli_in_sequence`` on ``nproc`` torchrun ranks; the finished process, or AssertionError with its stderr."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    code = "import sys; from tests.integration.trainer_testlib import run_cli_in_sequence as r; r(sys.argv[1])"
    cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", "--no-python", sys.executable, "-c", code]
    cmd.append(json.dumps(argvs))
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"trainer exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc
