"""How `molt up` starts each process of the local stack: its command line, log and environment, from the run's
plan and the addresses known so far (``Services``); a restart (``molt.stack.watch.revive``) reuses the process's
own command."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from molt.stack.gpus import GpuPlacement, trainer_command
from molt.stack.procs import ManagedProcess
from molt.stack.recipes import gateway_context_args

if TYPE_CHECKING:
    from molt.stack.up import StackPlan

# The trainer is stopped first on Ctrl-C and finishes its step and checkpoint: a tiny model's step takes
# seconds, a larger one's a minute.
TRAINER_STOP_GRACE_S = 120.0


def python_m(module: str, *args: str) -> list[str]:
    """``python -m module args`` with this interpreter (the stack's venv)."""
    return [sys.executable, "-m", module, *args]


def pod_seed_args(rollout: list[str], i: int) -> list[str]:
    """Pod ``i``'s flags with engine seed base + i, as Molt seeds its engines: unseeded requests draw from the
    engine's generator, and pods started with one seed would sample the same first completions."""
    args, base = list(rollout), 0
    for k, a in enumerate(rollout):
        name, eq, value = a.partition("=")
        if name == "--vllm.seed":
            raw = value if eq else (rollout[k + 1] if k + 1 < len(rollout) else "")
            if not raw.lstrip("-").isdigit():
                return list(rollout)  # not a number: the pod refuses it with the flag's own message
            base = int(raw)
            args = rollout[:k] + rollout[k + (1 if eq else 2) :]
            break
    return [*args, "--vllm.seed", str(base + i)]


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def pod_urls(ports: list[int]) -> tuple[str, str]:
    """A pod's HTTP URL and gRPC (weight sync) address, from its two ports."""
    return url(ports[0]), f"127.0.0.1:{ports[1]}"


@dataclass
class Services:
    """The stack's processes as ``molt.stack.watch`` starts them; the addresses are filled in as services come up."""

    plan: StackPlan
    run_dir: Path
    gpus: GpuPlacement | None
    env: dict[str, str]
    weights_env: dict[str, str]
    steps: list[str]
    steps_jsonl: Path
    redis_url: str = ""
    pods: list[tuple[str, str]] = field(default_factory=list)
    """(HTTP URL, gRPC address) of each pod."""
    gateway_url: str = ""
    envs_urls: list[str] = field(default_factory=list)
    stream: str = field(init=False)

    def __post_init__(self) -> None:
        self.redis_url = self.plan.redis_url or ""
        self.stream = f"molt:run:{self.run_dir.name}"

    def redis(self, port: int) -> ManagedProcess:
        from molt.bus.embedded import find_redis_server

        # An append-only file in the run folder: rollouts generated but not yet trained when the run stops are
        # trained after `--resume` instead of generated again. No snapshots (`--save ""`).
        aof = ("--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.run_dir))
        cmd = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), *aof]
        return ManagedProcess("redis", cmd, self.run_dir / "redis.log")

    def pod(self, i: int) -> Callable[[int, int], ManagedProcess]:
        def make(http: int, grpc: int) -> ManagedProcess:
            cmd = python_m(
                "services.rollout",
                *("--model.path", str(self.plan.model), "--server.port", str(http), "--grpc.port", str(grpc)),
                *pod_seed_args(self.plan.rollout, i),
            )
            env = {**self.weights_env, "CUDA_VISIBLE_DEVICES": self.gpus.pods[i]} if self.gpus else self.weights_env
            return ManagedProcess(f"rollout-{i}", cmd, self.run_dir / f"rollout-{i}.log", url(http), env)

        return make

    def gateway(self, port: int) -> ManagedProcess:
        cmd = python_m(
            "services.gateway",
            *("--model.path", str(self.plan.model), "--rollout.urls", ",".join(p[0] for p in self.pods)),
            *("--redis.url", self.redis_url, "--redis.stream", self.stream, "--server.port", str(port)),
            *gateway_context_args(self.plan.rollout, self.plan.gateway),
            *self.plan.gateway,
        )
        return ManagedProcess("gateway", cmd, self.run_dir / "gateway.log", url(port), self.env)

    def envs(self, i: int) -> Callable[[int], ManagedProcess]:
        def make(port: int) -> ManagedProcess:
            name = f"envs-{i}" if self.plan.num_envs > 1 else "envs"
            agents = [a for agent, path in self.plan.agents.items() for a in ("--agent", f"{agent}={path}")]
            cmd = python_m("services.envs", *agents, "--gateway.url", self.gateway_url, "--server.port", str(port))
            env = {**self.env, **self.plan.env}
            return ManagedProcess(name, [*cmd, *self.plan.envs], self.run_dir / f"{name}.log", url(port), env)

        return make

    def trainer(self, port: int) -> ManagedProcess:
        plan = self.plan
        args = [
            *("--model.path", str(plan.model), "--redis.url", self.redis_url, "--redis.stream", self.stream),
            *("--rollout.urls", ",".join(p[0] for p in self.pods), "--envs.urls", ",".join(self.envs_urls)),
            *("--envs.agent", plan.agent, "--logger.steps_jsonl", str(self.steps_jsonl)),
            *("--logger.eval_jsonl", str(self.run_dir / "eval.jsonl"), "--metrics.port", str(port)),
            *plan.trainer,
            *self.steps,
        ]
        cmd = trainer_command(args, self.gpus.trainer_ranks if self.gpus else 1, TRAINER_STOP_GRACE_S)
        env = {**self.weights_env, "OMP_NUM_THREADS": str(plan.trainer_threads)}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus.trainer
        return ManagedProcess(
            "trainer", cmd, self.run_dir / "trainer.log", None, env, stop_grace_s=TRAINER_STOP_GRACE_S
        )
