"""`molt` command line: `molt up --recipe tiny` runs the whole stack locally."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="molt", description="Molt Services command line.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="run the whole stack locally on a recipe",
                        description="Start Redis (embedded unless --redis-url), rollout pods, the gateway, env "
                                    "workers and the trainer as local processes, train the recipe, stop.")
    from molt.stack.recipes import RECIPES

    up.add_argument("--recipe", default="tiny", choices=sorted(RECIPES))
    up.add_argument("--run-dir", type=Path, help="run folder (default runs/<recipe>-<time>)")
    up.add_argument("--steps", type=int, help="trainer steps (default: the recipe's)")
    up.add_argument("--redis-url", help="use this Redis instead of starting an embedded one")
    up.add_argument("--pods", type=int, help="number of rollout pods")
    up.add_argument("--async-queue-size", type=int, help="--train.async_queue_size for the trainer")
    up.add_argument("--sync", action="store_true", help="strictly on-policy (--train.force_sync_mode)")
    up.add_argument("--no-progress", action="store_true", help="no per-step progress lines")
    up.add_argument("--set", nargs="+", action="append", default=[], metavar=("SERVICE", "FLAG"),
                    help="extra flags for one service, e.g. --set trainer --actor.adam.lr 1e-3")
    args = parser.parse_args(argv)
    from molt.stack.up import UpOptions, run_stack

    extra: dict[str, list[str]] = {}
    for service, *flags in args.set:
        if service not in ("rollout", "gateway", "envs", "trainer"):
            parser.error(f"--set {service}: service must be rollout, gateway, envs or trainer")
        extra.setdefault(service, []).extend(flags)
    summary = run_stack(UpOptions(recipe=args.recipe, run_dir=args.run_dir, steps=args.steps,
                                  redis_url=args.redis_url, num_pods=args.pods,
                                  async_queue_size=args.async_queue_size, force_sync=args.sync, extra=extra,
                                  progress=not args.no_progress))
    return 130 if summary.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
