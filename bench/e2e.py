"""End-to-end: our stack (`molt up`) vs TRL's GRPOTrainer (CPU, no vLLM), same run, same task.

    .venv/bin/python -m bench.e2e --recipe tiny --steps 20 [--skip-trl] [--skip-ours] [--sync-too] [--trl-threads 1,2]

Both sides train the recipe's model on the recipe's prompts and reward with the same batch shape
(prompts per step x samples per prompt x max new tokens, same learning rate). For each side it
reports samples/s, seconds per step, mean reward over the first and last 10% of steps, and the peak
memory of the whole process tree (all services together), sampled every 0.2 s with psutil. TRL runs once
per ``--trl-threads`` entry (torch intra-op threads; default: one run with torch's own default, i.e. every
core, as a TRL user would run it); the ratio column is against the fastest TRL run.
Prints a markdown table; `--json PATH` also writes the raw figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent

from molt.stack.recipes import RECIPES, write_prompts


def _flag(flags: list[str], name: str, default=None):
    return flags[flags.index(name) + 1] if name in flags else default


class PeakMemory:
    """Samples the summed RSS of a process and all its descendants."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s, self.peak_bytes = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak_bytes = max(self.peak_bytes, total)
            except psutil.Error:
                return
            self._stop.wait(self.every_s)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes / 2**30


def run_measured(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, float, float]:
    start = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        mem = PeakMemory(proc.pid)
        code = proc.wait()
    return code, time.monotonic() - start, mem.stop()


def _mean(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def ours(recipe: str, steps: int, work: Path, sync: bool) -> dict:
    run_dir = work / f"ours-{'sync' if sync else 'async'}"
    cmd = [
        sys.executable,
        "-m",
        "molt.cli",
        "up",
        "--recipe",
        recipe,
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ] + (["--sync"] if sync else [])
    code, wall_s, peak_gb = run_measured(cmd, work / f"ours-{'sync' if sync else 'async'}.log")
    if code != 0:
        raise SystemExit(f"molt up failed ({code}); see {work}")
    rows = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    samples = sum(r["samples"] for r in rows)
    # Training time = the trainer's step periods (from its start to the last step), like TRL's train():
    # service start-up and model builds are excluded on both sides.
    train_s = sum(r["seconds"] for r in rows)
    k = max(1, math.ceil(len(rows) * 0.1))
    return {
        "impl": "molt (sync)" if sync else "molt (async)",
        "steps": len(rows),
        "samples": samples,
        "samples_per_s": samples / train_s,
        "s_per_step": train_s / max(len(rows), 1),
        "reward_first": _mean([r["reward_mean"] for r in rows[:k]]),
        "reward_last": _mean([r["reward_mean"] for r in rows[-k:]]),
        "peak_gb": peak_gb,
        "wall_s": wall_s,
    }


def trl_worker(recipe_name: str, steps: int, prompts: Path, model: Path, out: Path, threads: int) -> None:
    """Runs inside its own process (so its memory is measured alone)."""
    import importlib.util

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    if threads:
        torch.set_num_threads(threads)
    recipe = RECIPES[recipe_name]
    n = int(_flag(recipe.trainer, "--rollout.n_samples_per_prompt"))
    prompts_per_step = int(_flag(recipe.trainer, "--rollout.batch_size"))
    spec = importlib.util.spec_from_file_location("agent", ROOT / recipe.agent)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    env_cls = agent.AgentRunner().env_cls
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["input"]}], "label": r["label"]} for r in rows]
    )

    def reward(prompts, completions, label, **_):
        import asyncio

        out = []
        for completion, lab in zip(completions, label):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            res = asyncio.run(
                env_cls().step({"action_text": text, "label": lab, "observation_text": "", "sampling_params": {}})
            )
            out.append(float(res.reward))
        return out

    log: list[dict] = []
    from transformers import TrainerCallback

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                log.append({"step": state.global_step, "reward": logs["reward"], "t": time.monotonic()})

    cfg = GRPOConfig(
        output_dir=str(out.parent / "trl-out"),
        use_vllm=False,
        use_cpu=True,
        per_device_train_batch_size=prompts_per_step * n,
        num_generations=n,
        steps_per_generation=1,
        max_completion_length=int(_flag(recipe.trainer, "--rollout.max_new_tokens")),
        temperature=1.0,
        beta=0.0,
        learning_rate=float(_flag(recipe.trainer, "--actor.adam.lr")),
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        bf16=False,
        seed=0,
    )
    start = time.monotonic()
    trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=cfg, train_dataset=data, callbacks=[Log()])
    t0 = time.monotonic()
    trainer.train()
    out.write_text(
        json.dumps(
            {
                "log": log,
                "train_s": time.monotonic() - t0,
                "setup_s": t0 - start,
                "samples": steps * prompts_per_step * n,
                "threads": torch.get_num_threads(),
            }
        )
    )


def trl(recipe: str, steps: int, work: Path, threads: int) -> dict:
    prompts = write_prompts(RECIPES[recipe], work / "prompts.jsonl")
    from molt.stack.up import build_model

    model = build_model(RECIPES[recipe], ROOT / ".cache" / "models")
    out, log = work / f"trl-{threads}.json", work / f"trl-{threads}.log"
    # TRL's process gets the machine's threads unless told otherwise (molt up pins its services to one each).
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    code, wall_s, peak_gb = run_measured(
        [
            sys.executable,
            __file__,
            "--trl-worker",
            recipe,
            str(steps),
            str(prompts),
            str(model),
            str(out),
            str(threads),
        ],
        log,
        env,
    )
    if code != 0:
        raise SystemExit(f"TRL run failed ({code}); see {log}")
    res = json.loads(out.read_text())
    rewards = [r["reward"] for r in res["log"]]
    k = max(1, math.ceil(len(rewards) * 0.1))
    return {
        "impl": f"TRL GRPOTrainer ({res['threads']} thread{'s' if res['threads'] > 1 else ''})",
        "steps": steps,
        "samples": res["samples"],
        "samples_per_s": res["samples"] / res["train_s"],
        "s_per_step": res["train_s"] / steps,
        "reward_first": _mean(rewards[:k]),
        "reward_last": _mean(rewards[-k:]),
        "peak_gb": peak_gb,
        "wall_s": wall_s,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        recipe, steps, prompts, model, out, threads = sys.argv[2:8]
        trl_worker(recipe, int(steps), Path(prompts), Path(model), Path(out), int(threads))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="tiny", choices=sorted(RECIPES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--sync-too", action="store_true", help="also run our stack strictly on-policy")
    ap.add_argument(
        "--trl-threads",
        default="0",
        help="comma list of torch thread counts, one TRL run each (0: torch's default, every core)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix=f"molt-bench-e2e-{args.recipe}-"))
    results = []
    if not args.skip_ours:
        results.append(ours(args.recipe, args.steps, work, sync=False))
        if args.sync_too:
            results.append(ours(args.recipe, args.steps, work, sync=True))
    if not args.skip_trl:
        for threads in args.trl_threads.split(","):
            results.append(trl(args.recipe, args.steps, work, int(threads)))
    trl_runs = [r for r in results if r["impl"].startswith("TRL")]
    base = max(trl_runs, key=lambda r: r["samples_per_s"]) if trl_runs else None
    print(f"recipe {args.recipe}, {args.steps} steps; logs in {work}")
    print("| impl | samples/s | s/step | reward first 10% | reward last 10% | peak memory GB | vs TRL samples/s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        print(
            f"| {r['impl']} | {r['samples_per_s']:.1f} | {r['s_per_step']:.2f} | {r['reward_first']:.3f} | "
            f"{r['reward_last']:.3f} | {r['peak_gb']:.2f} | {ratio} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
