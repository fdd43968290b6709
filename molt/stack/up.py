"""`molt up`: the whole stack on one machine, as local processes, until the recipe's steps are done.

Start order: Redis (embedded unless --redis-url), then the rollout pods and the trainer together (their model
loads overlap; the trainer waits for its pods itself), the gateway, the env workers; each must answer /readyz
before the next starts, and the run begins once the trainer listens. Logs go to one run folder (printed at
start and end), with `steps.jsonl` (one line per trainer step), `reward.png` and `summary.json` at the end.
Ctrl-C or a failed service stops everything in reverse order (SIGTERM, then SIGKILL after a grace period). Ports are
picked free on loopback; a service that loses one to another process before it binds starts again on new ones.
On a GPU machine each pod and the trainer get their own GPUs (``molt.stack.gpus``).

Each run writes its plan (`plan.json`: model, agents, every service's flags) to the run folder; `molt up --resume
DIR` starts the same stack again in that folder, its trainer on the newest checkpoint (`--ckpt.load_enable`).
On Ctrl-C the trainer is stopped first, and given time to finish its step and save that checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO

from molt import strict_json
from molt.net import free_port
from molt.serve import CPU_ENV, redis_problem
from molt.stack.gpus import FLAGS, GpuPlacement, gpu_count, place_stack
from molt.stack.procs import Supervisor
from molt.stack.recipes import RECIPES, ROOT, Recipe, flag_value, gateway_context_args, write_prompts
from molt.stack.report import Progress, finish_report, scrape
from molt.stack.services import TRAINER_STOP_GRACE_S, Services, pod_urls, url
from molt.stack.watch import GatewayCount, launch, revive, settle, start_on_free_ports, stop_on_signals, wait_output


def model_dir(recipe: Recipe, cache: Path) -> Path:
    """Where ``build_model`` puts the recipe's model."""
    return cache / "-".join(a.lstrip("-") for a in recipe.model)


def build_model(recipe: Recipe, cache: Path) -> Path:
    out = model_dir(recipe, cache)
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
    resume: Path | None = None
    """A run folder to continue (`--resume`): its plan, its newest checkpoint."""


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
    trainer_gpus: int | None = None
    """GPUs of the trainer on a GPU machine, one rank each (Molt's --actor.num_gpus_per_node); None: all those the
    pods leave (``molt.stack.gpus``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of the env workers (e.g. MODEL_PATH, which Molt's example agents read)."""
    run_dir: Path | None = None
    redis_url: str | None = None
    progress: bool = True
    ready_timeout_s: float = 240.0
    cwd: str = field(default_factory=os.getcwd)
    """Where the run was started: relative paths in its flags (a Molt script's --ckpt.path) are read from here."""


PLAN_FILE = "plan.json"
# What --resume needs to start the same stack again; run_dir, progress and timeouts belong to each start.
_PLAN_KEYS = (
    *("name", "model", "agents", "agent", "trainer", "rollout", "gateway", "envs", "num_pods", "num_envs"),
    *("steps", "trainer_threads", "trainer_gpus", "env", "redis_url", "cwd"),
)


def save_plan(plan: StackPlan, run_dir: Path) -> None:
    data = {k: getattr(plan, k) for k in _PLAN_KEYS}
    (run_dir / PLAN_FILE).write_text(json.dumps(data, indent=2, default=str) + "\n")


LOCK_FILE = "molt-up.lock"


def lock_run_dir(run_dir: Path, flag: str) -> IO[str]:
    """Hold the run folder for this process (released when it exits): a second `molt up` in it, a resume typed
    in another terminal, would write the same checkpoints and logs. One line naming ``flag`` (status 2) if held."""
    lock = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        print(
            f"molt: error: {flag} {run_dir}: a molt up is running in it (pid {holder}); stop it first",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2) from None
    except OSError:  # a file system without locks (some network mounts): the run goes on unguarded
        return lock
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _resume_error(run_dir: Path, problem: str) -> SystemExit:
    print(f"molt: error: --resume {run_dir}: {problem}", file=sys.stderr, flush=True)
    return SystemExit(2)


def resume_plan(opts: UpOptions) -> StackPlan:
    """The plan of the run in ``opts.resume``, to start again on its newest checkpoint. ``--steps``, ``--set`` and
    ``--redis-url`` apply on top of the saved flags (and are saved for the next resume). One line naming
    --resume (status 2) when the folder holds no plan, no checkpoint, or a run that already reached its steps."""
    from services.trainer.checkpoint import STEP_PREFIX, latest_dir

    assert opts.resume is not None
    run_dir = opts.resume.resolve()
    if not run_dir.is_dir():
        raise _resume_error(opts.resume, "no such folder (a run folder that molt up or molt train-rl printed)")
    try:
        data = json.loads((run_dir / PLAN_FILE).read_text())
    except FileNotFoundError:
        raise _resume_error(
            opts.resume, f"no {PLAN_FILE} there (not a run folder of molt up or molt train-rl)"
        ) from None
    except (OSError, ValueError) as exc:
        raise _resume_error(opts.resume, f"cannot read {PLAN_FILE} ({exc})") from None
    known = {f.name for f in fields(StackPlan)}
    plan = StackPlan(**{k: v for k, v in data.items() if k in known})
    plan.model = Path(plan.model)
    plan.agents = {name: Path(path) for name, path in plan.agents.items()}
    extra = opts.extra or {}
    for service in ("trainer", "rollout", "gateway", "envs"):
        setattr(plan, service, [*getattr(plan, service), *extra.get(service, [])])
    plan.steps = opts.steps or plan.steps
    plan.redis_url = opts.redis_url or plan.redis_url
    plan.run_dir, plan.progress, plan.ready_timeout_s = run_dir, opts.progress, opts.ready_timeout_s
    if not (plan.model / "config.json").is_file():
        raise _resume_error(opts.resume, f"the run's model {plan.model} is gone (no config.json there)")
    ckpt = _ckpt_root(plan)
    latest = latest_dir(str(ckpt)) if ckpt else None
    if latest is None:
        raise _resume_error(
            opts.resume,
            f"no checkpoint in {ckpt or 'a --ckpt.path'} to resume from (the trainer writes one every "
            "--ckpt.save_steps steps and when it stops; a run started with --set trainer ckpt.save_steps=-1 keeps "
            "none)",
        )
    done = int(latest.name.removeprefix(STEP_PREFIX))
    if plan.steps is not None and done >= plan.steps:
        raise _resume_error(
            opts.resume, f"its checkpoint is at step {done}, the run's {plan.steps} steps; pass --steps above {done}"
        )
    return plan


def memory_url_problem(url: str | None) -> str | None:
    """The stack's services are processes of their own: an in-memory stream would be one per process, and the
    trainer would wait forever for rollouts the gateway wrote into its own."""
    if url and url.startswith("memory://"):
        return (
            f"--redis-url {url}: each service runs as its own process and cannot share an in-memory stream; "
            "pass a redis:// URL, or leave --redis-url out for an embedded Redis"
        )
    return None


def check_redis(url: str | None) -> None:
    """An explicit --redis-url must answer before anything is built or started (one line, status 2); without
    one, the redis-server to embed must be there."""
    problem = memory_url_problem(url) or redis_problem(url, "--redis-url")
    if not url:
        from molt.bus.embedded import find_redis_server

        try:
            find_redis_server()
        except FileNotFoundError as e:
            problem = str(e)
    if problem:
        print(f"molt: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)


RUN_FILES = (
    *("plan.json", "steps.jsonl", "eval.jsonl", "summary.json", "reward.png", "model", "ckpt"),
    *("appendonlydir", "appendonly.aof"),  # the embedded Redis's stream: Redis 7 writes a folder, 6.2 a file
)
"""What a run leaves in its run folder, besides one ``<service>.log`` per process."""


def check_run_dir(path: Path) -> None:
    """A run folder that holds an earlier run is a one-line error naming --run-dir (status 2). Two runs in one
    folder mix: progress and summary.json would count the earlier run's steps.jsonl rows as this run's, and its
    model/ and reward.png would be overwritten. A folder that is empty, or holds none of a run's files, is fine."""
    if not path.is_dir():
        return
    try:
        found = sorted(p.name for p in path.iterdir() if p.name in RUN_FILES or p.suffix == ".log")
    except OSError as exc:
        print(
            f"molt: error: --run-dir {path}: cannot read it ({exc.strerror}); pass a folder you can write",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    if found:
        print(
            f"molt: error: --run-dir {path}: already holds a run ({', '.join(found[:3])}); "
            "pick another folder, or delete this one",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)


def default_run_dir(name: str) -> Path:
    """runs/<name>-<time> under the working directory, where Molt's own outputs (``./ckpt``) land too, created
    here: mkdir is atomic, so two runs started in the same second get their own folders (-2, -3, ...) instead
    of one holding both."""
    base = Path.cwd() / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
        except OSError:
            break  # make_run_dir tries again and names the problem in one line
    return base


def make_run_dir(path: Path) -> Path:
    """The run folder, created; one that cannot be is a one-line error naming --run-dir (status 2), and so is
    one that holds an earlier run (``check_run_dir``)."""
    check_run_dir(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(
            f"molt: error: --run-dir {path}: cannot create it ({exc.strerror}); pass a folder you can write",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    return path


def check_trainer_flags(flags: list[str], model: Path | str, agent: str) -> None:
    """The trainer's own flag checks, before anything starts: a bad flag would otherwise surface only once Redis
    is up and the pods are loading their models. Exits 2 naming the flag. The
    wiring the stack adds (URLs, stream) is stood in for; the user's flags come after it and win. Its datasets
    are checked too, cheaply (``check_datasets``): a missing path or input key ends the same way."""
    from molt.config import parse_settings
    from services.trainer.checks import check_datasets, validate_settings
    from services.trainer.config import TrainerSettings
    from services.trainer.device import trainer_on_gpu

    on_gpu = trainer_on_gpu()  # the trainer runs here, on this machine's device
    local = "http://127.0.0.1:1"
    wiring = ["--model.path", str(model), "--rollout.urls", local, "--envs.urls", local, "--envs.agent", agent]

    def validate(s: TrainerSettings) -> None:
        validate_settings(s, on_gpu=on_gpu)
        check_datasets(s)

    parse_settings(TrainerSettings, [*wiring, *flags], prog="molt (the trainer's flags)", validate=validate)


def check_service_flags(
    model: Path | str, rollout: list[str], gateway: list[str], envs: list[str], agents: dict[str, Path]
) -> None:
    """The pods', gateway's and env workers' own flag checks (each service's parse and ``validate_settings``),
    before anything starts: a bad `--vllm.*` value or `molt up --set` flag would otherwise end a pod or the
    gateway only once Redis and the trainer are up. Exits 2 naming the flag. The wiring the stack adds (ports,
    URLs, the stream) is stood in for, as in ``check_trainer_flags``."""
    from molt.config import parse_settings
    from services.envs.config import EnvsSettings, normalize_argv
    from services.envs.config import validate_settings as envs_checks
    from services.gateway.config import GatewaySettings
    from services.gateway.config import validate_settings as gateway_checks
    from services.rollout.config import RolloutSettings
    from services.rollout.config import validate_settings as pod_checks

    def pod_as_started(s: RolloutSettings) -> None:
        # run_plan hands every pod a weights token, which this process lacks: weight changes stay guarded on
        # any --server.host, so that rule is met here as it will be there.
        pod_checks(s.model_copy(update={"weights": s.weights.model_copy(update={"allow_unauthenticated": True})}))

    local = "http://127.0.0.1:1"
    pod = ["--model.path", str(model), *rollout]
    parse_settings(RolloutSettings, pod, prog="molt (the pods' flags)", validate=pod_as_started)
    gw = ["--model.path", str(model), "--rollout.urls", local, *gateway_context_args(rollout, gateway), *gateway]
    parse_settings(GatewaySettings, gw, prog="molt (the gateway's flags)", validate=gateway_checks)
    named = [f"{name}={path}" for name, path in agents.items()]
    worker = normalize_argv(["--agent", *named, "--gateway.url", local, *envs])
    parse_settings(EnvsSettings, worker, prog="molt (the env workers' flags)", validate=envs_checks)


def gpu_placement(plan: StackPlan, count: int | None = None) -> GpuPlacement | None:
    """Each process's GPUs on this machine (None without GPUs); one line naming the flag (status 2) when the plan
    needs more than there are, before anything starts. ``count``: GPUs seen (default: torch's count)."""
    flags = FLAGS["train-rl" if plan.name == "train-rl" else "up"]
    try:
        n = gpu_count() if count is None else count
        return place_stack(n, plan.num_pods, plan.rollout, plan.trainer_gpus, flags)
    except ValueError as exc:
        print(f"molt: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def mode_args(opts: UpOptions) -> list[str]:
    """The trainer flags of `--async-queue-size Q` and `--sync`."""
    args = []
    if opts.async_queue_size is not None:
        args += ["--train.async_queue_size", str(opts.async_queue_size)]
    if opts.force_sync:  # Molt: strictly on-policy is force_sync_mode with a queue of one batch
        args += ["--train.async_queue_size", "1", "--train.force_sync_mode", "true"]
    return args


def run_stack(opts: UpOptions) -> dict:
    """`molt up --recipe NAME`: a recipe's plan; `molt up --resume DIR`: a run's own, on its newest checkpoint."""
    if opts.resume is not None:  # run_plan checks the plan's Redis, --redis-url or the saved one
        return run_plan(resume_plan(opts), resume=True)
    if opts.recipe not in RECIPES:
        raise SystemExit(f"unknown recipe {opts.recipe!r}: choose one of {', '.join(RECIPES)}")
    check_redis(opts.redis_url)
    recipe = RECIPES[opts.recipe]
    run_dir = make_run_dir(opts.run_dir or default_run_dir(recipe.name))
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
    trainer += mode_args(opts) + extra.get("trainer", [])
    steps = opts.steps or recipe.steps
    cache = ROOT / ".cache" / "models"
    # A bad trainer flag fails in one line before the model is built (smollm2's is converted from GGUF);
    # run_plan checks again, with the built model.
    check_trainer_flags([*trainer, "--train.num_steps", str(steps)], model_dir(recipe, cache), recipe.name)
    rollout, gateway = recipe.rollout + extra.get("rollout", []), recipe.gateway + extra.get("gateway", [])
    envs = recipe.envs + extra.get("envs", [])
    check_service_flags(model_dir(recipe, cache), rollout, gateway, envs, {recipe.name: ROOT / recipe.agent})
    plan = StackPlan(
        name=recipe.name,
        model=model_dir(recipe, cache),
        agents={recipe.name: ROOT / recipe.agent},
        agent=recipe.name,
        trainer=trainer,
        rollout=rollout,
        gateway=gateway,
        envs=envs,
        num_pods=opts.num_pods or recipe.num_pods,
        steps=steps,
        trainer_threads=recipe.trainer_threads,
        run_dir=run_dir,
        redis_url=opts.redis_url,
        progress=opts.progress,
        ready_timeout_s=opts.ready_timeout_s,
    )
    gpu_placement(plan)  # too few GPUs for the pods: refused before the model is built too
    plan.model = build_model(recipe, cache)
    return run_plan(plan)


def run_plan(plan: StackPlan, resume: bool = False) -> dict:
    """Start Redis, pods, gateway, env workers and the trainer for ``plan``; wait for the trainer; stop all.
    ``resume``: ``plan.run_dir`` holds this run already (``resume_plan``); its trainer loads the newest checkpoint."""
    check_redis(plan.redis_url)
    steps = ["--train.num_steps", str(plan.steps)] if plan.steps else []  # last: --steps wins
    steps += ["--ckpt.load_enable", "true"] if resume else []
    if resume and os.getcwd() != plan.cwd:
        os.chdir(plan.cwd)  # the run's relative paths (its flags, its agents' own) mean what they meant
    check_trainer_flags([*plan.trainer, *steps], plan.model, plan.agent)
    check_service_flags(plan.model, plan.rollout, plan.gateway, plan.envs, plan.agents)
    gpus = gpu_placement(plan)
    if resume:
        assert plan.run_dir is not None
        run_dir = plan.run_dir
    else:
        run_dir = make_run_dir(plan.run_dir or default_run_dir(plan.name))
    lock = lock_run_dir(run_dir, "--resume" if resume else "--run-dir")
    save_plan(plan, run_dir)
    what = "resuming from its newest checkpoint" if resume else "run folder"
    print(f"[molt up] {plan.name}, {plan.steps or 'all'} steps; {what} {run_dir}", flush=True)
    if gpus is not None:
        pinned = [f"rollout-{i} {g}" for i, g in enumerate(gpus.pods)] + [f"trainer {gpus.trainer}"]
        print(f"[molt up] GPUs (CUDA_VISIBLE_DEVICES): {', '.join(pinned)}", flush=True)
        for note in gpus.notes:
            print(f"[molt up] {note}", flush=True)
    env = {**CPU_ENV, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    # Pods and trainer (only they) share a fresh weight-sync token: other local users cannot swap weights.
    weights_env = {**env, "MOLT_WEIGHTS_TOKEN": secrets.token_urlsafe(32)}
    sup = Supervisor()

    old_handlers = stop_on_signals()
    started = time.monotonic()
    progress = Progress(run_dir / "steps.jsonl", plan.steps, enabled=plan.progress)
    if resume:
        progress.poll(quiet=True)  # the earlier starts' steps count in the summary, and are not printed again
    before = _earlier_starts(run_dir) if resume else (0, 0.0)
    svc = Services(plan, run_dir, gpus, env, weights_env, steps, progress.path)
    trainer = None
    restarts: dict[str, int] = {}
    try:
        if not plan.redis_url:
            _, (port,) = start_on_free_ports(sup, 1, svc.redis, wait_output("Ready to accept connections", 10.0))
            svc.redis_url = f"redis://127.0.0.1:{port}/0"
        # The pods and the trainer load their models at the same time (minutes each on GPUs): the trainer is
        # given the pods' and env workers' URLs up front and waits for them itself, as in Kubernetes.
        pod_ports = [[free_port(), free_port()] for _ in range(plan.num_pods)]
        env_ports = [[free_port()] for _ in range(plan.num_envs)]
        svc.pods, svc.envs_urls = [pod_urls(p) for p in pod_ports], [url(p) for (p,) in env_ports]
        planned = (list(svc.pods), list(svc.envs_urls))
        pod_procs = [launch(sup, svc.pod(i), ports) for i, ports in enumerate(pod_ports)]
        trainer_ports = [free_port()]
        trainer = launch(sup, svc.trainer, trainer_ports)
        svc.pods = [
            pod_urls(settle(sup, proc, pod_ports[i], svc.pod(i), plan.ready_timeout_s)[1])
            for i, proc in enumerate(pod_procs)
        ]
        _, (gw_port,) = start_on_free_ports(sup, 1, svc.gateway, plan.ready_timeout_s)
        svc.gateway_url = url(gw_port)
        env_procs = [launch(sup, svc.envs(i), ports) for i, ports in enumerate(env_ports)]
        svc.envs_urls = [
            url(settle(sup, proc, env_ports[i], svc.envs(i), plan.ready_timeout_s)[1][0])
            for i, proc in enumerate(env_procs)
        ]
        # The trainer listens once its models are loaded, which takes as long as they are large.
        listening = wait_output("molt-trainer listening on", None)
        if (svc.pods, svc.envs_urls) != planned:  # one lost a port race: the trainer must know the new ones
            print("[molt up] trainer: starting it again with the ports a pod or env worker moved to", flush=True)
            trainer.stop()
            sup.procs.remove(trainer)
            trainer, (metrics_port,) = start_on_free_ports(sup, 1, svc.trainer, listening)
        else:
            trainer, (metrics_port,) = settle(sup, trainer, trainer_ports, svc.trainer, listening)
        trainer_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        produced = GatewayCount(svc.gateway_url)
        while trainer.returncode != 0:  # None while it trains
            for p in sup.procs:
                if not p.alive() and not (p is trainer and p.returncode == 0):
                    if p.name == "gateway":
                        produced.lost()
                    revive(sup, p, trainer, restarts, lambda: _checkpointed(plan))
            progress.poll(trainer_metrics)
            produced.poll()
            time.sleep(1.0)
        progress.poll(trainer_metrics)
        before = (before[0] + produced.earlier, before[1])
        summary = _report(run_dir, progress, svc, started, before, restarts=restarts)
        print(f"[molt up] done: {strict_json.dumps(summary)}", flush=True)
        return summary
    except KeyboardInterrupt:
        print("\n[molt up] interrupted: stopping the stack", flush=True)
        summary = {"interrupted": True}
        if trainer is not None:
            # The trainer first, while the rest still serves its step: it finishes the step and saves a checkpoint.
            trainer.stop(TRAINER_STOP_GRACE_S)
            progress.poll()
            if progress.rows:
                summary = _report(run_dir, progress, svc, started, before, True, restarts=restarts)
        if _checkpointed(plan):
            # As this command was run: `molt` where the console script is on PATH, else this venv's python.
            molt = "molt" if Path(sys.argv[0]).name == "molt" else f"{sys.executable} -m molt.cli"
            print(f"[molt up] continue this run with: {molt} up --resume {run_dir}", flush=True)
        return summary
    finally:
        codes = sup.stop_all()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        print(f"[molt up] stopped {', '.join(f'{k}={v}' for k, v in codes.items())}; run folder {run_dir}", flush=True)
        lock.close()


def _report(
    run_dir: Path,
    progress: Progress,
    svc: Services,
    started: float,
    before: tuple[int, float],
    interrupted: bool = False,
    restarts: dict[str, int] | None = None,
) -> dict:
    """The run's summary. A resumed run counts its earlier starts' trajectories and seconds too (``before``)."""
    gateway_counts = scrape(f"{svc.gateway_url}/metrics")
    key = "molt_gateway_trajectories_written_total"
    gateway_counts[key] = gateway_counts.get(key, 0.0) + before[0]
    pod_versions = [scrape(f"{http}/metrics").get("molt_rollout_policy_version") for http, _ in svc.pods]
    wall_s = time.monotonic() - started + before[1]
    name = svc.plan.name
    return finish_report(run_dir, progress, gateway_counts, wall_s, name, pod_versions, interrupted, restarts)


def _earlier_starts(run_dir: Path) -> tuple[int, float]:
    """Trajectories produced and seconds taken by the earlier starts of a resumed run, from the summary the last
    one wrote (on Ctrl-C too)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        return int(summary.get("trajectories_produced", 0)), float(summary.get("wall_s", 0.0))
    except (OSError, ValueError):
        return 0, 0.0


def _ckpt_root(plan: StackPlan) -> Path | None:
    """The trainer's --ckpt.path, read from where the run was started (None: it has none)."""
    path = flag_value(plan.trainer, "--ckpt.path")
    return Path(plan.cwd, path) if path else None


def _checkpointed(plan: StackPlan) -> bool:
    from services.trainer.checkpoint import latest_dir

    ckpt = _ckpt_root(plan)
    return ckpt is not None and latest_dir(str(ckpt)) is not None


__all__ = ["StackPlan", "UpOptions", "run_plan", "run_stack"]
