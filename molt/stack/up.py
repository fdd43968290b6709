"""`molt up`: the whole stack on one machine, as local processes, until the recipe's steps are done.

Start order: Redis (embedded unless --redis-url), rollout pods, gateway, env workers, trainer; each
must answer /readyz before the next starts. Logs go to one run folder (printed at start and end),
with `steps.jsonl` (one line per trainer step), `reward.png` and `summary.json` at the end. Ctrl-C or
a failed service stops everything in reverse order (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from molt.net import free_port
from molt.serve import CPU_ENV, redis_problem
from molt.stack.procs import ManagedProcess, ServiceFailed, Supervisor
from molt.stack.recipes import RECIPES, ROOT, Recipe, gateway_context_args, write_prompts
from molt.stack.report import Progress, finish_report, scrape


def build_model(recipe: Recipe, cache: Path) -> Path:
    key = "-".join(a.lstrip("-") for a in recipe.model)
    out = cache / key
    if not (out / "config.json").exists():
        print(f"[molt up] building model {' '.join(recipe.model)} -> {out}", flush=True)
        subprocess.run([sys.executable, "-m", "molt.models", *recipe.model, "--out", str(out)], check=True)
    return out


@dataclass
class UpOptions:
    recipe: str = "tiny"
    run_dir: Path | None = None
    steps: int | None = None
    redis_url: str | None = None
    num_pods: int | None = None
    async_queue_size: int | None = None
    force_sync: bool = False
    extra: dict[str, list[str]] | None = None
    progress: bool = True
    ready_timeout_s: float = 240.0


@dataclass
class StackPlan:
    """One local run: the model, the agent modules, and each service's own flags (wiring is added here)."""

    name: str
    """Run folder prefix (runs/<name>-<time>)."""
    model: Path
    agents: dict[str, Path]
    """Agent name -> module, loaded by every env worker; the trainer dispatches to ``agent``."""
    agent: str
    trainer: list[str] = field(default_factory=list)
    rollout: list[str] = field(default_factory=list)
    gateway: list[str] = field(default_factory=list)
    envs: list[str] = field(default_factory=list)
    num_pods: int = 1
    num_envs: int = 1
    steps: int | None = None
    """--train.num_steps; None: until the dataset is exhausted."""
    trainer_threads: int = 1
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the env workers (e.g. MODEL_PATH, which Molt's example agents read)."""
    run_dir: Path | None = None
    redis_url: str | None = None
    progress: bool = True
    ready_timeout_s: float = 240.0


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def check_redis(url: str | None) -> None:
    """An explicit --redis-url must answer before anything is built or started (one line, status 2)."""
    problem = redis_problem(url, "--redis-url")
    if problem:
        print(f"molt: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def mode_args(opts: UpOptions) -> list[str]:
    """The trainer flags of `--async-queue-size Q` and `--sync`."""
    args = []
    if opts.async_queue_size is not None:
        args += ["--train.async_queue_size", str(opts.async_queue_size)]
    if opts.force_sync:  # Molt: strictly on-policy is force_sync_mode with a queue of one batch
        args += ["--train.async_queue_size", "1", "--train.force_sync_mode", "true"]
    return args


def run_stack(opts: UpOptions) -> dict:
    """`molt up --recipe NAME`: a recipe's plan."""
    if opts.recipe not in RECIPES:
        raise SystemExit(f"unknown recipe {opts.recipe!r}: choose one of {', '.join(RECIPES)}")
    check_redis(opts.redis_url)
    recipe = RECIPES[opts.recipe]
    run_dir = opts.run_dir or ROOT / "runs" / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    extra = opts.extra or {}
    trainer = [
        "--data.prompt_dataset",
        str(write_prompts(recipe, run_dir / "prompts.jsonl")),
        "--ckpt.path",
        str(run_dir / "ckpt"),
        "--ckpt.output_dir",
        str(run_dir / "model"),
        *recipe.trainer,
    ]
    trainer += mode_args(opts)
    plan = StackPlan(
        name=recipe.name,
        model=build_model(recipe, ROOT / ".cache" / "models"),
        agents={recipe.name: ROOT / recipe.agent},
        agent=recipe.name,
        trainer=trainer + extra.get("trainer", []),
        rollout=recipe.rollout + extra.get("rollout", []),
        gateway=recipe.gateway + extra.get("gateway", []),
        envs=recipe.envs + extra.get("envs", []),
        num_pods=opts.num_pods or recipe.num_pods,
        steps=opts.steps or recipe.steps,
        trainer_threads=recipe.trainer_threads,
        run_dir=run_dir,
        redis_url=opts.redis_url,
        progress=opts.progress,
        ready_timeout_s=opts.ready_timeout_s,
    )
    return run_plan(plan)


def run_plan(plan: StackPlan) -> dict:
    """Start Redis, pods, gateway, env workers and the trainer for ``plan``; wait for the trainer; stop all."""
    check_redis(plan.redis_url)
    run_dir = plan.run_dir or ROOT / "runs" / f"{plan.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[molt up] {plan.name}, {plan.steps or 'all'} steps; run folder {run_dir}", flush=True)
    env = {**CPU_ENV, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    # Pods and trainer (only they) share a fresh weight-sync token: other local users cannot swap weights.
    weights_env = {**env, "MOLT_WEIGHTS_TOKEN": secrets.token_urlsafe(32)}
    model = plan.model
    stream = f"molt:run:{run_dir.name}"
    sup = Supervisor()

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    progress = Progress(run_dir / "steps.jsonl", plan.steps, enabled=plan.progress)
    trainer = None
    try:
        redis_url = plan.redis_url
        if not redis_url:
            port = free_port()
            redis_url = f"redis://127.0.0.1:{port}/0"
            from molt.bus.embedded import find_redis_server

            sup.start(
                ManagedProcess(
                    "redis",
                    [
                        find_redis_server(),
                        "--bind",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                    ],
                    run_dir / "redis.log",
                )
            )
            _wait_tcp(port)
        pods = []
        for i in range(plan.num_pods):
            http, grpc = free_port(), free_port()
            pods.append((f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}"))
            sup.start(
                ManagedProcess(
                    f"rollout-{i}",
                    _py(
                        "services.rollout",
                        "--model.path",
                        str(model),
                        "--server.port",
                        str(http),
                        "--grpc.port",
                        str(grpc),
                        *plan.rollout,
                    ),
                    run_dir / f"rollout-{i}.log",
                    f"http://127.0.0.1:{http}",
                    weights_env,
                ),
                plan.ready_timeout_s,
            )
        gw_port = free_port()
        gateway_url = f"http://127.0.0.1:{gw_port}"
        sup.start(
            ManagedProcess(
                "gateway",
                _py(
                    "services.gateway",
                    "--model.path",
                    str(model),
                    "--rollout.urls",
                    ",".join(p[0] for p in pods),
                    "--redis.url",
                    redis_url,
                    "--redis.stream",
                    stream,
                    "--server.port",
                    str(gw_port),
                    *gateway_context_args(plan.rollout),
                    *plan.gateway,
                ),
                run_dir / "gateway.log",
                gateway_url,
                env,
            ),
            plan.ready_timeout_s,
        )
        envs_urls = []
        agent_flags = [a for name, path in plan.agents.items() for a in ("--agent", f"{name}={path}")]
        for i in range(plan.num_envs):
            env_port = free_port()
            envs_urls.append(f"http://127.0.0.1:{env_port}")
            sup.start(
                ManagedProcess(
                    f"envs-{i}" if plan.num_envs > 1 else "envs",
                    _py(
                        "services.envs",
                        *agent_flags,
                        "--gateway.url",
                        gateway_url,
                        "--server.port",
                        str(env_port),
                        *plan.envs,
                    ),
                    run_dir / (f"envs-{i}.log" if plan.num_envs > 1 else "envs.log"),
                    envs_urls[-1],
                    {**env, **plan.env},
                ),
                plan.ready_timeout_s,
            )
        metrics_port = free_port()
        trainer_flags = [
            "--model.path",
            str(model),
            "--redis.url",
            redis_url,
            "--redis.stream",
            stream,
            "--rollout.urls",
            ",".join(p[0] for p in pods),
            "--envs.urls",
            ",".join(envs_urls),
            "--envs.agent",
            plan.agent,
            "--metrics.port",
            str(metrics_port),
            "--logger.steps_jsonl",
            str(progress.path),
            "--logger.eval_jsonl",
            str(run_dir / "eval.jsonl"),
            *plan.trainer,
        ]
        if plan.steps:
            trainer_flags += ["--train.num_steps", str(plan.steps)]
        trainer = sup.start(
            ManagedProcess(
                "trainer",
                _py("services.trainer", *trainer_flags),
                run_dir / "trainer.log",
                None,
                {**weights_env, "OMP_NUM_THREADS": str(plan.trainer_threads)},
            )
        )
        trainer_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        while trainer.alive():
            for p in sup.procs:
                if p is not trainer and not p.alive():
                    raise ServiceFailed(f"{p.name} died while training; log {p.log_path}:\n{p.tail()}")
            progress.poll(trainer_metrics)
            time.sleep(1.0)
        progress.poll(trainer_metrics)
        trainer.check()
        gateway_counts = scrape(f"{gateway_url}/metrics")
        pod_versions = [scrape(f"{http}/metrics").get("molt_rollout_policy_version") for http, _ in pods]
        summary = finish_report(run_dir, progress, gateway_counts, time.monotonic() - started, plan.name, pod_versions)
        print(f"[molt up] done: {json.dumps(summary)}", flush=True)
        return summary
    except KeyboardInterrupt:
        print("\n[molt up] interrupted: stopping the stack", flush=True)
        return {"interrupted": True}
    finally:
        codes = sup.stop_all()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        print(f"[molt up] stopped {', '.join(f'{k}={v}' for k, v in codes.items())}; run folder {run_dir}", flush=True)


def _wait_tcp(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ServiceFailed(f"redis did not listen on {port}")


__all__ = ["StackPlan", "UpOptions", "run_plan", "run_stack"]
