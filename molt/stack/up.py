"""`molt up`: the whole stack on one machine, as local processes, until the recipe's steps are done.

Start order: Redis (embedded unless --redis-url), rollout pods, gateway, env workers, trainer; each
must answer /readyz before the next starts. Logs go to one run folder (printed at start and end),
with `steps.jsonl` (one line per trainer step), `reward.png` and `summary.json` at the end. Ctrl-C or
a failed service stops everything in reverse order (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from molt.net import free_port
from molt.stack.procs import ManagedProcess, ServiceFailed, Supervisor
from molt.stack.recipes import RECIPES, ROOT, Recipe, write_prompts
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


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def run_stack(opts: UpOptions) -> dict:
    if opts.recipe not in RECIPES:
        raise SystemExit(f"unknown recipe {opts.recipe!r}: choose one of {', '.join(RECIPES)}")
    recipe = RECIPES[opts.recipe]
    steps = opts.steps or recipe.steps
    run_dir = opts.run_dir or ROOT / "runs" / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[molt up] recipe {recipe.name}, {steps} steps; run folder {run_dir}", flush=True)
    env = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    extra = opts.extra or {}
    model = build_model(recipe, ROOT / ".cache" / "models")
    prompts = write_prompts(recipe, run_dir / "prompts.jsonl")
    stream = f"molt:run:{run_dir.name}"
    sup = Supervisor()
    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    progress = Progress(run_dir / "steps.jsonl", steps, enabled=opts.progress)
    trainer = None
    try:
        redis_url = opts.redis_url
        if not redis_url:
            port = free_port()
            redis_url = f"redis://127.0.0.1:{port}/0"
            from molt.bus.embedded import find_redis_server

            sup.start(ManagedProcess("redis", [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port),
                                               "--save", "", "--appendonly", "no"], run_dir / "redis.log"))
            _wait_tcp(port)
        pods = []
        for i in range(opts.num_pods or recipe.num_pods):
            http, grpc = free_port(), free_port()
            pods.append((f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}"))
            sup.start(ManagedProcess(f"rollout-{i}", _py("services.rollout", "--model.path", str(model),
                                                         "--server.port", str(http), "--grpc.port", str(grpc),
                                                         *recipe.rollout, *extra.get("rollout", [])),
                                     run_dir / f"rollout-{i}.log", f"http://127.0.0.1:{http}/readyz", env),
                      opts.ready_timeout_s)
        gw_port = free_port()
        gateway_url = f"http://127.0.0.1:{gw_port}"
        sup.start(ManagedProcess("gateway", _py("services.gateway", "--model.path", str(model), "--rollout.urls",
                                                ",".join(p[0] for p in pods), "--redis.url", redis_url,
                                                "--redis.stream", stream, "--server.port", str(gw_port),
                                                *recipe.gateway, *extra.get("gateway", [])),
                                 run_dir / "gateway.log", f"{gateway_url}/readyz", env), opts.ready_timeout_s)
        env_port = free_port()
        envs_url = f"http://127.0.0.1:{env_port}"
        sup.start(ManagedProcess("envs", _py("services.envs", "--agent", f"{recipe.name}={ROOT / recipe.agent}",
                                             "--gateway.url", gateway_url, "--server.port", str(env_port),
                                             *recipe.envs, *extra.get("envs", [])),
                                 run_dir / "envs.log", f"{envs_url}/readyz", env), opts.ready_timeout_s)
        metrics_port = free_port()
        trainer_flags = ["--model.path", str(model), "--redis.url", redis_url, "--redis.stream", stream,
                         "--rollout.urls", ",".join(p[0] for p in pods), "--envs.urls", envs_url,
                         "--envs.agent", recipe.name, "--data.prompt_dataset", str(prompts),
                         "--train.num_steps", str(steps), "--metrics.port", str(metrics_port),
                         "--ckpt.path", str(run_dir / "ckpt"), "--logger.steps_jsonl", str(progress.path),
                         *recipe.trainer]
        if opts.async_queue_size is not None:
            trainer_flags += ["--train.async_queue_size", str(opts.async_queue_size)]
        if opts.force_sync:  # Molt: strictly on-policy is force_sync_mode with a queue of one batch
            trainer_flags += ["--train.async_queue_size", "1", "--train.force_sync_mode", "true"]
        trainer = sup.start(ManagedProcess("trainer", _py("services.trainer", *trainer_flags,
                                                          *extra.get("trainer", [])),
                                           run_dir / "trainer.log", None,
                                           {**env, "OMP_NUM_THREADS": str(recipe.trainer_threads)}))
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
        summary = finish_report(run_dir, progress, gateway_counts, time.monotonic() - started, recipe.name,
                                pod_versions)
        print(f"[molt up] done: {json.dumps(summary)}", flush=True)
        return summary
    except KeyboardInterrupt:
        print("\n[molt up] interrupted: stopping the stack", flush=True)
        return {"interrupted": True}
    finally:
        codes = sup.stop_all()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        print(f"[molt up] stopped {', '.join(f'{k}={v}' for k, v in codes.items())}; run folder {run_dir}",
              flush=True)


def _wait_tcp(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ServiceFailed(f"redis did not listen on {port}")


__all__ = ["UpOptions", "run_stack"]
