"""`molt` command line: `molt up --recipe tiny` runs the whole stack locally; `molt train-rl <Molt's flags>`
runs Molt's train_rl_ray flag list on it (or writes it as Helm values); `molt train-sft` is SFT; `molt export
CKPT OUT` writes a checkpoint's policy as an HF model directory. Molt's own module names run the same:
``python -m molt.cli.train_rl_ray FLAGS`` is ``molt train-rl FLAGS`` and ``torchrun ... -m molt.cli.train_sft
FLAGS`` is ``molt train-sft FLAGS``, so a Molt launch script's command line needs no edit."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

# Surely a flag name: dotted (actor.adam.lr) or given its value with "=" (port=8100).
_SET_FLAG = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+|[A-Za-z_][\w.]*=.*", re.DOTALL)


def set_words(words: list[str]) -> list[str]:
    """``--set SERVICE`` words as the service's argv: flag names gain their dashes, values stay as given, so
    ``actor.adam.lr=1e-3`` and ``actor.adam.lr 1e-3`` both reach the service as one flag and its value. A word
    is a value when it follows a name without "=" and is not itself surely a name."""
    out: list[str] = []
    takes_value = False
    for w in words:
        if w.startswith("-") or (takes_value and not _SET_FLAG.fullmatch(w)):
            out.append(w)
            takes_value = False
        else:
            out.append("--" + w)
            takes_value = "=" not in w
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train-sft"]:  # Molt's train_sft flags, parsed by the SFT trainer itself
        from services.trainer.sft import main as train_sft

        train_sft(argv[1:], prog="molt train-sft")
        return 0
    if argv[:1] == ["train-rl"]:  # Molt's train_rl_ray flags, routed to the services (molt.stack.train_rl)
        return train_rl(argv[1:])
    parser = argparse.ArgumentParser(prog="molt", description="Molt Services command line.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "train-sft",
        add_help=False,
        help="supervised fine-tuning with Molt's train_sft flags "
        "(torchrun -m molt.cli train-sft ...; see docs/sft.md)",
    )
    up = sub.add_parser(
        "up",
        help="run the whole stack locally on a recipe",
        description="Start Redis (embedded unless --redis-url), rollout pods, the gateway, env "
        "workers and the trainer as local processes, train the recipe, stop.",
    )
    from molt.stack.recipes import RECIPES

    up.add_argument("--recipe", choices=sorted(RECIPES), help="default: tiny")
    up.add_argument(
        "--run-dir",
        type=Path,
        help="run folder, new or empty (default runs/<recipe>-<time>); one holding a run is refused",
    )
    up.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue a stopped run in its folder, as it was started, from its newest checkpoint; "
        "--steps, --set and --redis-url still apply",
    )
    up.add_argument("--steps", type=_positive, help="trainer steps (default: the recipe's)")
    up.add_argument("--redis-url", help="use this Redis instead of starting an embedded one")
    up.add_argument("--pods", type=_positive, help="number of rollout pods")
    up.add_argument("--async-queue-size", type=_positive, help="--train.async_queue_size for the trainer")
    up.add_argument("--sync", action="store_true", help="strictly on-policy (--train.force_sync_mode)")
    up.add_argument("--no-progress", action="store_true", help="no per-step progress lines")
    up.add_argument(
        "--set",
        nargs="+",
        action="append",
        default=[],
        metavar=("SERVICE", "FLAG"),
        help="extra flags for one service, written without their dashes (argparse takes no value starting with "
        "one), as name=value or name value, e.g. --set trainer actor.adam.lr=1e-3 train.num_steps 5",
    )
    sub.add_parser(
        "train-rl", add_help=False, help="Molt's train_rl_ray flags on the local stack (molt train-rl --help)"
    )
    exp = sub.add_parser(
        "export",
        help="write a checkpoint's policy as an HF model directory",
        description="CKPT: a checkpoint step folder (<ckpt.path>/global_step<N>) or a --ckpt.path "
        "root (its latest step). OUT: the HF model directory to write (config, "
        "safetensors, tokenizer, chat template), loadable by transformers and a pod.",
    )
    exp.add_argument("ckpt", type=Path)
    exp.add_argument("out", type=Path)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = " (--set takes flags without their dashes: --set trainer actor.adam.lr=1e-3)" if "--set" in argv else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if args.cmd == "export":
        from services.trainer.checkpoint import latest_dir
        from services.trainer.export import export_checkpoint

        if not args.ckpt.is_dir():
            parser.exit(2, f"molt export: error: {args.ckpt}: no such directory (a checkpoint step or --ckpt.path)\n")
        step_dir = args.ckpt if (args.ckpt / "extra_state.pt").exists() else latest_dir(str(args.ckpt))
        if step_dir is None:
            parser.exit(2, f"molt export: error: {args.ckpt}: not a checkpoint (no global_step<N>/extra_state.pt)\n")
        try:
            out = export_checkpoint(step_dir, args.out)
        except ValueError as exc:
            parser.exit(2, f"molt export: error: {exc}\n")
        print(f"[molt export] wrote {out}")
        return 0
    from molt.stack.up import UpOptions, run_stack

    if args.resume is not None:
        given = {"--recipe": args.recipe, "--run-dir": args.run_dir, "--pods": args.pods}
        given |= {"--async-queue-size": args.async_queue_size, "--sync": args.sync or None}
        clash = [flag for flag, value in given.items() if value is not None]
        if clash:
            up.error(
                f"argument --resume: the run continues as it was started, so {clash[0]} cannot change "
                "(--steps, --set and --redis-url can)"
            )
    extra: dict[str, list[str]] = {}
    for service, *flags in args.set:
        if service not in ("rollout", "gateway", "envs", "trainer"):
            parser.error(f"--set {service}: service must be rollout, gateway, envs or trainer")
        extra.setdefault(service, []).extend(set_words(flags))
    options = UpOptions(
        recipe=args.recipe or "tiny",
        resume=args.resume,
        run_dir=args.run_dir,
        steps=args.steps,
        redis_url=args.redis_url,
        num_pods=args.pods,
        async_queue_size=args.async_queue_size,
        force_sync=args.sync,
        extra=extra,
        progress=not args.no_progress,
    )
    return _run_stack(lambda: run_stack(options))


TRAIN_RL_HELP = """usage: molt train-rl [--emit helm-values FILE] [--run-dir DIR] [--redis-url URL] [--dry-run]
                     [--no-progress] <flags of Molt's python -m molt.cli.train_rl_ray>

Runs Molt's RL flag list on the local stack (embedded Redis, rollout pods, gateway, env workers, trainer as
processes; each flag goes to the service that owns it). The agent module is Molt's --train.agent_path
(on_policy_distill without one samples one completion per prompt, as Molt's built-in agent does).
  --no-progress             no per-step progress lines
  --emit helm-values FILE   write the run as values for deploy/k8s/molt instead of running it
  --run-dir DIR             run folder, new or empty (default runs/train-rl-<time>)
  --redis-url URL           use this Redis instead of an embedded one
  --dry-run                 print where each flag goes and exit
Flags that need hardware this machine lacks are refused with the reason; see docs/trainer.md."""


def train_rl(argv: list[str], prog: str = "molt train-rl") -> int:
    from molt.stack import train_rl as tr
    from molt.stack import train_rl_helm as trh
    from molt.stack.gpus import gpu_count
    from molt.stack.up import check_service_flags, check_trainer_flags

    own: dict[str, str | bool] = {}
    rest: list[str] = []
    it = iter(argv)
    for tok in it:
        if tok in ("-h", "--help"):
            print(TRAIN_RL_HELP.replace("molt train-rl", prog, 1))
            return 0
        if tok in ("--dry-run", "--no-progress"):
            own[tok] = True
        elif tok in ("--run-dir", "--redis-url"):
            own[tok] = next(it, "")
        elif tok == "--emit":
            kind, path = next(it, ""), next(it, "")
            if kind != "helm-values" or not path:
                print(f"{prog}: --emit takes 'helm-values FILE'", file=sys.stderr)
                return 2
            own["--emit"] = path
        else:
            rest.append(tok)
    from molt.serve import redis_url_problem
    from molt.stack.up import memory_url_problem

    url = str(own.get("--redis-url") or "") or None
    problem = memory_url_problem(url) or redis_url_problem(url, "--redis-url")
    if problem:  # the line a real run's Redis check would end with, and --dry-run's too
        print(f"molt: error: {problem}", file=sys.stderr)
        return 2
    if own.get("--run-dir") and "--emit" not in own:  # here, so that --dry-run refuses it as a real run does
        from molt.stack.up import check_run_dir

        check_run_dir(Path(str(own["--run-dir"])))
    target: Literal["local", "helm"] = "helm" if "--emit" in own else "local"
    gpus = gpu_count() if target == "local" else 0
    try:
        routed = tr.route(rest, target, gpus=gpus)
        if target == "local" and not gpus:
            tr.cpu_pod_defaults(routed)
        if target == "helm":
            for note in trh.write_helm_values(routed, Path(str(own["--emit"]))):
                print(f"[molt train-rl] {note}")
            print(f"[molt train-rl] wrote Helm values to {own['--emit']}")
            return 0
        placement = tr.place_gpus(routed, gpus)
        for note in routed.notes:
            print(f"[molt train-rl] {note}")
        run_dir = Path(str(own["--run-dir"])) if own.get("--run-dir") else None
        plan = tr.local_plan(routed, run_dir, str(own.get("--redis-url") or "") or None, not own.get("--no-progress"))
        if own.get("--dry-run"):  # a real run makes the same checks in run_plan, before anything starts
            check_trainer_flags(routed.trainer, plan.model, plan.agent)
            check_service_flags(plan.model, plan.rollout, plan.gateway, plan.envs, plan.agents)
            print(tr.describe(routed, placement))
            return 0
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    from molt.stack.up import run_plan

    return _run_stack(lambda: run_plan(plan))


# A service's own one-line error in its log ("python -m services.trainer: error: --data.prompt_dataset ...").
_SERVICE_ERROR = re.compile(r"^[\w .()-]+: error: (?P<msg>.+)$")


def _run_stack(run: Callable[[], dict]) -> int:
    """Run the stack; a service that fails is one line naming it and its log (status 1), not a traceback: the
    stack is stopped by then, and the log holds the service's own error in full."""
    from molt.stack.procs import ServiceFailed

    try:
        summary = run()
    except ServiceFailed as exc:
        first, *tail = str(exc).splitlines()
        # A problem found only mid-run (a bad line deep in a dataset) is named where the user looks first; a
        # traceback's last line is left to the log.
        own = next((m["msg"] for line in reversed(tail) if (m := _SERVICE_ERROR.match(line.strip()))), None)
        print(f"molt: error: {first.rstrip(':')}" + (f"; its error: {own}" if own else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C while the trainer saved: the stack is stopped at once
        return 130
    return 130 if summary.get("interrupted") else 0


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (0 would otherwise read as "the recipe's default")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
