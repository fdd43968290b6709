"""Soak: the local stack (the `tiny` recipe) trained for a long run while faults hit it on a schedule.

    python -m bench.soak --steps 5000 --minutes 30 --fault-every-steps 25 --down-s 30   # 30 min
    python -m bench.soak --steps 6 --fault-every-steps 1 --down-s 2                     # ~3 min (the CI test)

Redis (append-only file, everysec), a vLLM rollout pod (``--weights.await_push``: a restarted pod serves
nothing before the trainer pushed its version), the gateway, an env worker and the trainer run as processes
on fixed ports. The schedule follows training, not the clock: fault ``k`` fires once the trainer's step log
(``--logger.steps_jsonl``) reaches step ``(k + 1) x --fault-every-steps``; it SIGKILLs the next service of
``--faults`` (its whole process group), leaves it down ``--down-s``, starts it again with the same command
(the trainer resumes from its checkpoint, saved every step) and waits for it to be ready, so one service is
down at a time. With ``--fault-jitter-s`` a kill waits a random time below it (``--seed``) once due, so it
lands anywhere in a step; each fault records the trainer's phase (``/v1/status``) at that moment. The run
ends when the trainer has trained ``--steps`` steps; every wait is bounded (``--ready-s`` for a restart,
``--stall-s`` without a new step, ``--minutes`` in all) and a run that hits a bound stops and says which
(``failure`` in the summary).

The dataset has ``steps x prompts per step`` prompts, which the trainer walks in its seeded order
(``PromptDataset.row``), so a run that keeps its promise trains the rows of positions ``0 .. 8n - 1`` once
each after ``n`` steps. An auditor reads every trajectory the gateway writes through a consumer group of its
own; with the trainer's step records (the last record of each step counts: a step trained again after a
restart replaces the one that was lost) it reports prompts trained once / twice / never, trajectories trained
twice, the largest staleness, 5xx answers by code (the gateway's requests and the env worker's episodes,
summed over restarts), and each service's RSS over time (``rss.jsonl`` in the run folder). ``soak.json``
holds the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import secrets
import signal
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

from molt.bus.embedded import EmbeddedRedis
from molt.net import free_port
from molt.serve import CPU_ENV
from molt.stack.procs import ManagedProcess, ServiceFailed
from molt.stack.recipes import RECIPES, ROOT, _prompts_digits
from molt.stack.services import python_m
from molt.stack.up import build_model

SERVICES = ("redis", "envs", "gateway", "trainer", "pod")
PROMPTS_PER_STEP = 8  # the tiny recipe's --rollout.batch_size


class Auditor:
    """Reads every trajectory on ``stream`` (a consumer group of its own) in a thread: id -> (group, prompt)."""

    def __init__(self, redis_url: str, stream: str) -> None:
        self.redis_url, self.stream = redis_url, stream
        self.seen: dict[str, tuple[str, bytes]] = {}
        self.errors = 0
        self.recovered = 0  # entries read back from its own pending list after a fault cut a read
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        from molt.bus.redis_stream import RedisTrajectoryQueue

        q = RedisTrajectoryQueue(self.redis_url, self.stream, group="soak-audit")
        # A read cut by a fault (Redis killed between XREADGROUP and its reply reaching us, or before the read's
        # second round trip) leaves entries delivered to this consumer that it never saw: after any error, read
        # its own pending entries first, as the trainer's controller does after such a read (its resync).
        recover = False
        while not self._stop.is_set():
            try:
                if recover:
                    batch = await q.read_pending("audit", 256)
                    recover = bool(batch)
                    self.recovered += len(batch)
                else:
                    batch = await q.read("audit", 256, block_s=0.5)
                for d in batch:
                    t = d.trajectory
                    seg = t.segments[0]
                    prompt = seg.token_ids[: int(seg.action_spans[0][0])].tobytes() if len(seg.action_spans) else b""
                    self.seen[t.trajectory_id] = (t.group_id, prompt)
                if batch:
                    await q.ack(batch)
                elif self._draining.is_set() and not recover:
                    break
            except Exception:  # noqa: BLE001 (Redis is down, a fault: counted, read again once it is back)
                self.errors += 1
                recover = True
                await asyncio.sleep(0.5)
        await q.close()

    def stop(self) -> None:
        """Read until the stream has nothing new (the services are stopped by then), then stop."""
        self._draining.set()
        self._thread.join(30)
        self._stop.set()
        self._thread.join(10)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scrape(url: str, metric: str, label: str) -> dict[str, float] | None:
    """``metric``'s samples summed by ``label``'s value, or None when the service does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            labels, _, value = line.rpartition(" ")
            key = labels.split(f'{label}="', 1)[1].split('"', 1)[0] if f'{label}="' in labels else ""
            out[key] += float(value)
    return out


class Counts:
    """A counter family summed over a service's restarts (each incarnation starts again from zero)."""

    def __init__(self) -> None:
        self.done: Counter = Counter()
        self.current: dict[str, float] = {}

    def update(self, values: dict[str, float] | None) -> None:
        if values is not None:
            self.current = values

    def restarted(self) -> None:
        self.done.update(self.current)
        self.current = {}

    def total(self) -> dict[str, int]:
        return {k: int(v) for k, v in sorted((self.done + Counter(self.current)).items()) if v}


def fault_plan(steps: int, faults: list[str], every_steps: int, rounds: int = 0) -> list[tuple[int, str]]:
    """(step, service): fault ``k`` hits ``faults[k % len(faults)]`` once step ``(k + 1) x every_steps`` is
    logged; none at the last step or past it (it would hit a run that is over), and with ``rounds`` > 0 none
    after each service has been hit that many times."""
    plan = [(at, faults[k % len(faults)]) for k, at in enumerate(range(every_steps, steps, every_steps))]
    return plan[: rounds * len(faults)] if rounds > 0 else plan


class StepWatcher:
    """The last step in the trainer's ``--logger.steps_jsonl``, read incrementally (the file only grows)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step = path, 0, 0

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return self.step
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offset += len(complete)
        for line in complete.splitlines():
            if line.strip():
                self.step = max(self.step, json.loads(line)["step"])
        return self.step


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="trainer steps; the dataset holds steps x 8 prompts")
    p.add_argument("--fault-every-steps", type=int, default=20, help="trainer steps between two faults")
    p.add_argument("--down-s", type=float, default=30.0, help="how long a killed service stays down")
    p.add_argument("--faults", default=",".join(SERVICES), help=f"services to kill in turn, from {SERVICES}")
    p.add_argument("--fault-rounds", type=int, default=0, help="kill each service at most this often (0: no limit)")
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="stop after this long (and report on the steps done) even if --steps are not all done",
    )
    p.add_argument("--ready-s", type=float, default=600.0, help="longest wait for a (re)started service")
    p.add_argument("--stall-s", type=float, default=600.0, help="longest wait for the next step (the run fails)")
    p.add_argument(
        "--fault-jitter-s",
        type=float,
        default=0.0,
        help="wait a random time below this after a fault is due, so kills land anywhere in a step (collecting, "
        "training, saving, publishing weights)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the fault jitter")
    p.add_argument(
        "--redis-maxmemory",
        default=None,
        help="run Redis with this maxmemory (e.g. 4mb) and noeviction, as managed Redis services do: producers "
        "then wait on a full Redis for the trainer instead of on --redis.max_len",
    )
    p.add_argument("--run-dir", type=Path, default=None)
    p.add_argument(
        "--pod-arg",
        action="append",
        default=[],
        help="an extra rollout-pod flag, e.g. --pod-arg=--vllm.enforce_eager (restarts skip torch.compile)",
    )
    args = p.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if not faults or set(faults) - set(SERVICES):
        p.error(f"--faults: choose from {','.join(SERVICES)}, got {args.faults!r}")
    if args.fault_every_steps < 1:
        p.error("--fault-every-steps must be at least 1")
    return soak(
        args.steps,
        fault_plan(args.steps, faults, args.fault_every_steps, args.fault_rounds),
        args.down_s,
        args.minutes,
        args.run_dir or ROOT / "runs" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}",
        ready_s=args.ready_s,
        stall_s=args.stall_s,
        pod_args=args.pod_arg,
        jitter_s=args.fault_jitter_s,
        seed=args.seed,
        redis_maxmemory=args.redis_maxmemory,
    )


def soak(
    steps: int,
    plan: list[tuple[int, str]],
    down_s: float,
    minutes: float | None,
    run_dir: Path,
    *,
    ready_s: float = 600.0,
    stall_s: float = 600.0,
    pod_args: list[str] | None = None,
    jitter_s: float = 0.0,
    seed: int = 0,
    redis_maxmemory: str | None = None,
) -> dict:
    recipe = RECIPES["tiny"]
    run_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(recipe, ROOT / ".cache" / "models")
    num_prompts = steps * PROMPTS_PER_STEP
    prompts = run_dir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in _prompts_digits(num_prompts)))
    env = {**CPU_ENV, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    weights_env = {**env, "MOLT_WEIGHTS_TOKEN": secrets.token_urlsafe(32)}
    stream, steps_log = f"molt:soak:{run_dir.name}", run_dir / "steps.jsonl"
    memory = ["--maxmemory", redis_maxmemory, "--maxmemory-policy", "noeviction"] if redis_maxmemory else []
    redis = EmbeddedRedis(log_dir=run_dir, data_dir=run_dir / "redis", args=memory)
    pod_http, pod_grpc, gw_port, envs_port, metrics_port = (free_port() for _ in range(5))
    pod_url, gw_url, envs_url = (f"http://127.0.0.1:{port}" for port in (pod_http, gw_port, envs_port))
    procs = {
        "pod": ManagedProcess(
            "pod",
            python_m(
                "services.rollout",
                "--model.path",
                str(model),
                "--server.port",
                str(pod_http),
                "--grpc.port",
                str(pod_grpc),
                *recipe.rollout,
                "--weights.await_push",
                *(pod_args or []),
            ),
            run_dir / "pod.log",
            pod_url,
            weights_env,
        ),
        "gateway": ManagedProcess(
            "gateway",
            python_m(
                "services.gateway",
                "--model.path",
                str(model),
                "--rollout.urls",
                pod_url,
                "--redis.url",
                redis.url,
                "--redis.stream",
                stream,
                "--server.port",
                str(gw_port),
                *recipe.gateway,
            ),
            run_dir / "gateway.log",
            gw_url,
            env,
        ),
        "envs": ManagedProcess(
            "envs",
            python_m(
                "services.envs",
                "--agent",
                f"tiny={ROOT / recipe.agent}",
                "--gateway.url",
                gw_url,
                "--server.port",
                str(envs_port),
                *recipe.envs,
            ),
            run_dir / "envs.log",
            envs_url,
            env,
        ),
        "trainer": ManagedProcess(
            "trainer",
            python_m(
                "services.trainer",
                "--model.path",
                str(model),
                "--redis.url",
                redis.url,
                "--redis.stream",
                stream,
                "--rollout.urls",
                pod_url,
                "--envs.urls",
                envs_url,
                "--envs.agent",
                "tiny",
                "--data.prompt_dataset",
                str(prompts),
                "--train.num_steps",
                str(steps),
                "--metrics.port",
                str(metrics_port),
                "--ckpt.path",
                str(run_dir / "ckpt"),
                "--ckpt.save_steps",
                "1",
                "--ckpt.load_enable",
                "--logger.steps_jsonl",
                str(steps_log),
                *recipe.trainer,
            ),
            run_dir / "trainer.log",
            f"http://127.0.0.1:{metrics_port}",
            {**weights_env, "OMP_NUM_THREADS": str(recipe.trainer_threads)},
        ),
    }
    started = time.monotonic()
    events: list[dict] = []
    gateway_codes, episode_statuses = Counts(), Counts()
    rss_log = open(run_dir / "rss.jsonl", "w")
    print(
        f"[soak] {steps} steps, {num_prompts} prompts, faults at steps {plan}, down {down_s:g} s; run folder "
        f"{run_dir}",
        flush=True,
    )

    def now() -> float:
        return round(time.monotonic() - started, 1)

    rng = random.Random(seed)

    def trainer_phase() -> str | None:
        """What the trainer is doing (its /v1/status phase), recorded with each fault."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/v1/status", timeout=2) as r:
                return json.loads(r.read()).get("phase")
        except (OSError, ValueError):
            return None

    def pid_of(name: str) -> int | None:
        if name == "redis":
            return redis.proc.pid if redis.proc else None
        proc = procs[name].proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def sample() -> None:
        gateway_codes.update(scrape(f"{gw_url}/metrics", "molt_gateway_requests_total", "code"))
        episode_statuses.update(scrape(f"{envs_url}/metrics", "molt_envs_episodes_total", "status"))
        row = {"t": now(), **{n: rss_mib(pid) for n in SERVICES if (pid := pid_of(n))}}
        rss_log.write(json.dumps(row) + "\n")
        rss_log.flush()

    def wait_ready(name: str) -> None:
        """Until ``name`` is ready, at most ``ready_s`` (ServiceFailed then). A pod that awaits a push from a
        trainer that has finished stays unready: that is the run's end, not a failure."""
        proc, deadline = procs[name], time.monotonic() + ready_s
        while True:
            try:
                proc.wait_ready(5)
                return
            except ServiceFailed:
                if procs["trainer"].proc is not None and procs["trainer"].proc.poll() == 0:
                    return
                if not proc.alive() or time.monotonic() > deadline:
                    raise ServiceFailed(
                        f"{name} not ready after {ready_s:g} s (--ready-s); log {proc.log_path}:\n{proc.tail()}"
                    ) from None

    def start(name: str) -> None:
        """Start ``name`` and wait until it is ready."""
        if name == "redis":
            redis.start()
        else:
            procs[name].start()
            wait_ready(name)

    def kill(name: str) -> None:
        sample()  # the counters of the incarnation that is about to die
        if name == "redis":
            redis.kill()
        else:
            procs[name].signal_group(signal.SIGKILL)
            procs[name].proc.wait()
        if name == "gateway":
            gateway_codes.restarted()
        if name == "envs":
            episode_statuses.restarted()

    auditor, failure = None, None
    watcher = StepWatcher(steps_log)
    try:
        redis.start()
        # A pod awaiting its first push is not ready, nor is a gateway without a ready pod, nor an env worker
        # without a ready gateway: they are started, the trainer (which pushes first) is waited for, then them.
        for name in ("pod", "gateway", "envs"):
            procs[name].start()
        start("trainer")
        for name in ("pod", "gateway", "envs"):
            wait_ready(name)
        auditor = Auditor(redis.url, stream)
        trainer = procs["trainer"]
        last_sample, step, progress_at = 0.0, 0, time.monotonic()
        while True:
            t = time.monotonic()
            if t - last_sample >= 5:
                sample()
                last_sample = t
            if watcher.poll() > step:
                step, progress_at = watcher.step, t
            if trainer.proc.poll() == 0:
                break
            if minutes is not None and t - started > minutes * 60:
                failure = f"--minutes {minutes:g} ran out at step {step} of {steps}"
                break
            if t - progress_at > stall_s:
                failure = f"no step for {stall_s:g} s (--stall-s) after step {step}; trainer log:\n{trainer.tail(8)}"
                break
            if trainer.proc.poll() is not None:
                code = trainer.proc.returncode
                events.append({"t": now(), "exited": "trainer", "code": code, "log": trainer.tail(8)})
                print(f"[soak] {now():.0f} s: the trainer exited with {code}:\n{trainer.tail(8)}", flush=True)
                start("trainer")  # an exit we did not cause: reported, and the run goes on
            elif plan and step >= plan[0][0]:
                at, name = plan.pop(0)
                time.sleep(rng.uniform(0, jitter_s))
                if trainer.proc.poll() is not None:  # it finished (or died) meanwhile: the loop's top sees to it
                    plan.insert(0, (at, name))
                    continue
                phase = trainer_phase()
                kill(name)
                step = watcher.poll()
                events.append({"t": now(), "killed": name, "step": step, "trainer_phase": phase})
                print(f"[soak] {now():.0f} s: killed {name} at step {step} (due at {at}; trainer {phase})", flush=True)
                time.sleep(down_s)
                start(name)
                events.append({"t": now(), "up": name})
                progress_at = time.monotonic()  # the stall clock runs from the service's return
            time.sleep(0.5)
        sample()
    except ServiceFailed as exc:  # a (re)start that did not become ready within --ready-s
        failure = str(exc)
    finally:
        for proc in procs.values():
            proc.stop(10)
        # Only now: services still write and train while they stop (a trainer's last steps, the episodes the env
        # worker drains), and those trajectories must be audited too.
        if auditor is not None:
            auditor.stop()
        redis.stop()
        rss_log.close()
    if failure:
        print(f"[soak] failed: {failure}", flush=True)
    summary = report(steps_log, auditor.seen if auditor else {}, model, steps, prompts)
    summary.update(
        minutes=round((time.monotonic() - started) / 60, 1),
        failure=failure,
        faults=sum("killed" in e for e in events),
        faults_not_reached=[name for _, name in plan],
        audit_read_errors=auditor.errors if auditor else None,
        audit_recovered=auditor.recovered if auditor else None,
        events=events,
        gateway_requests_by_code=gateway_codes.total(),
        episodes_by_status=episode_statuses.total(),
        rss_mib=rss_summary(run_dir / "rss.jsonl"),
    )
    (run_dir / "soak.json").write_text(json.dumps(summary, indent=1))
    print(f"[soak] done: {json.dumps({k: v for k, v in summary.items() if k != 'events'})}", flush=True)
    return summary


def report(steps_log: Path, seen: dict[str, tuple[str, bytes]], model: Path, steps: int, prompts: Path) -> dict:
    """Prompt accounting over the steps done. One group per prompt, trained in dispatch order, so ``n`` steps
    should have trained the rows at dataset positions ``0 .. 8n - 1`` (the trainer's seeded order, which
    ``PromptDataset.row`` replays) once each. A prompt's row is read back from its tokens (the digits prompts
    end in ``" {row}:"``)."""
    from transformers import AutoTokenizer

    from services.trainer.config import TrainerSettings
    from services.trainer.dispatch import PromptDataset

    tokenizer = AutoTokenizer.from_pretrained(model)
    records = (
        [json.loads(line) for line in steps_log.read_text().splitlines() if line.strip()] if steps_log.exists() else []
    )
    effective = {r["step"]: r for r in records}  # a step trained again after a restart replaces the lost one
    trained = Counter(t for r in effective.values() for t in r["trajectory_ids"])
    groups: dict[int, set[str]] = defaultdict(set)
    unaudited = 0
    for tid in trained:
        if tid not in seen:
            unaudited += 1
            continue
        group, prompt = seen[tid]
        text = tokenizer.decode(list(memoryview(prompt).cast("i")))
        groups[int(re.findall(r"(\d+):", text)[-1])].add(group)
    dataset = PromptDataset(
        str(prompts), "input", None, chat=False, max_samples=10**9, seed=TrainerSettings().train.seed
    )
    expected = {dataset.row(p) for p in range(len(effective) * PROMPTS_PER_STEP)}
    return {
        "steps_done": len(effective),
        "steps_requested": steps,
        "trainer_incarnations": len({r["pid"] for r in records}),
        "prompts_expected": len(expected),
        "prompts_trained_once": sum(len(groups.get(i, ())) == 1 for i in expected),
        "prompts_trained_twice_or_more": sum(len(g) > 1 for g in groups.values()),
        "prompts_never_trained": sum(i not in groups for i in expected),
        "prompts_trained_out_of_order": sum(i not in expected for i in groups),
        "trajectories_trained": len(trained),
        "trajectories_trained_twice": sum(v > 1 for v in trained.values()),
        "trajectories_not_audited": unaudited,
        "steps_with_unaudited": sorted(
            k for k, r in effective.items() if any(t not in seen for t in r["trajectory_ids"])
        ),
        "staleness_max": max((r["staleness_max"] for r in effective.values()), default=None),
    }


def rss_summary(path: Path) -> dict[str, dict[str, float]]:
    series: dict[str, list[float]] = defaultdict(list)
    for line in path.read_text().splitlines():
        for name, v in json.loads(line).items():
            if name != "t" and v is not None:
                series[name].append(v)
    return {n: {"first": round(v[0]), "max": round(max(v)), "last": round(v[-1])} for n, v in series.items()}


if __name__ == "__main__":
    main()
