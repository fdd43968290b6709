"""Trainer hot paths against their limits, measured in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.trainer [--model DIR] [--trajectories 64] [--tokens 256]

1. Batch assembly (decode from the stream's bytes -> step-axis samples -> padded micro-batches), vs
   the limit: the schema's decode alone (msgpack + validation), which any consumer pays.
2. One train step (``Learner.train_step``: old-logprob pass + advantages + fwd/bwd/AdamW through
   FSDP2 in a world of one), vs the limit: a bare transformers loop doing one fwd/bwd/AdamW over the
   same padded tokens with the same micro-batch size. Reported with and without
   ``--train.force_on_policy`` (which skips the old-logprob forward, as in Molt), and with shared-prefix
   packing off (``--train.pack_shared_prefix false``). The trajectories are GRPO-shaped: groups of 4
   samples share their prompt (the first quarter of the tokens), so packing computes it once per group;
   tokens/s counts the plain layout's tokens on every row, so the ratios compare wall time.
   With ``--optim muon`` the learner runs ``--actor.optim muon`` and the bare loop steps the same groups
   (services/trainer/muon.py) with ``torch.optim.Muon`` and fused AdamW.
Prints a markdown table (tokens/s, ratio to the limit).
"""

from __future__ import annotations

from molt.serve import apply_cpu_env

apply_cpu_env()

import argparse
import time

import numpy as np
import torch

from molt.schema import Segment, Trajectory, decode, encode


def make(n: int, tokens: int, vocab: int) -> list[Trajectory]:
    rng = np.random.default_rng(0)
    out = []
    prompt = tokens // 4
    for i in range(n):
        if i % 4 == 0:
            shared = rng.integers(3, vocab, prompt)
        t = tokens - (i % 7) * 8
        ids = np.concatenate([shared, rng.integers(3, vocab, t - prompt)])
        seg = Segment(ids, [[prompt, t]], -rng.uniform(0.1, 3, t - prompt), np.zeros(t - prompt, dtype=int))
        out.append(Trajectory(f"t{i}", f"g{i // 4}", i % 4, [seg], float(i % 2)))
    return out


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_assembly(trajs, repeat: int) -> tuple[float, float]:
    from services.trainer.batch import collate, samples_from_trajectory

    blobs = [encode(t) for t in trajs]

    def ours():
        samples = [x for b in blobs for x in samples_from_trajectory(decode(b), 1 << 20)]
        for i in range(0, len(samples), 8):
            collate(samples[i : i + 8])

    return best(lambda: [decode(b) for b in blobs], repeat), best(ours, repeat)


def bare_optimizer(raw, optim: str, model_dir: str):
    """The bare loop's optimizer: the learner's AdamW, or torch's Muon + AdamW over the learner's Muon groups."""
    if optim == "adam":
        return [torch.optim.AdamW(raw.parameters(), lr=1e-6, fused=True)]  # as the learner's
    from molt.config import parse_settings
    from services.trainer.config import TrainerSettings
    from services.trainer.muon import param_groups

    argv = ["--actor.model_name_or_path", model_dir, "--train.dispatch", "false", "--actor.optim", "muon"]
    muon, adamw = param_groups(raw, parse_settings(TrainerSettings, argv, environ={}).actor)
    return [torch.optim.Muon(muon), torch.optim.AdamW(adamw, fused=True)]


def bench_step(model_dir: str, trajs, micro: int, repeat: int, optim: str = "adam") -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from molt.config import parse_settings
    from services.trainer.batch import collate, samples_from_trajectory
    from services.trainer.checks import validate_settings
    from services.trainer.config import TrainerSettings
    from services.trainer.learner import Learner
    from services.trainer.model import init_distributed

    samples = [x for t in trajs for x in samples_from_trajectory(t, 1 << 20)]
    tokens = sum(x.num_tokens for x in samples)
    raw = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    opts = bare_optimizer(raw, optim, model_dir)

    def bare():
        for i in range(0, len(samples), micro):
            mb = collate(samples[i : i + micro])
            out = raw(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
            logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
            (-(logp * mb.action_mask).sum() / mb.action_mask.sum()).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()

    result = {"bare": tokens / best(bare, repeat)}
    info = init_distributed()
    for name, extra in (
        ("learner", []),
        ("learner_force_on_policy", ["--train.force_on_policy"]),
        ("learner_force_on_policy_plain_layout", ["--train.force_on_policy", "--train.pack_shared_prefix", "false"]),
    ):
        s = parse_settings(
            TrainerSettings,
            [
                "--actor.model_name_or_path",
                model_dir,
                "--train.dispatch",
                "false",
                "--algo.kl.init_coef",
                "0",
                "--train.batch_size",
                str(len(samples)),
                "--train.micro_batch_size",
                str(micro),
                "--actor.gradient_checkpoint",
                "off",
                "--fsdp.strategy",
                "torch",
                "--actor.optim",
                optim,
                *extra,
            ],
            environ={},
        )
        validate_settings(s)
        learner = Learner(s, info)
        result[name] = tokens / best(lambda learner=learner: learner.train_step(samples), repeat)
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=".cache/models/tiny-qwen3")
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--optim", choices=["adam", "muon"], default="adam")
    a = p.parse_args()
    from transformers import AutoConfig

    trajs = make(a.trajectories, a.tokens, AutoConfig.from_pretrained(a.model).vocab_size)
    dec_s, ours_s = bench_assembly(trajs, a.repeat)
    steps = bench_step(a.model, trajs, a.micro, a.repeat, a.optim)
    print(
        f"\n{a.trajectories} trajectories x ~{a.tokens} tokens, model {a.model}, micro-batch {a.micro}, "
        f"optimizer {a.optim}\n"
    )
    print("| hot path | ours | limit | ratio |\n|---|---|---|---|")
    n = len(trajs)
    print(
        f"| batch assembly (traj/s) | {n / ours_s:,.0f} | {n / dec_s:,.0f} (schema decode only) | "
        f"{dec_s / ours_s:.2f} |"
    )
    for name in ("learner", "learner_force_on_policy", "learner_force_on_policy_plain_layout"):
        print(
            f"| train step, {name} (tokens/s) | {steps[name]:,.0f} | {steps['bare']:,.0f} (bare fwd/bwd/{a.optim}) | "
            f"{steps[name] / steps['bare']:.2f} |"
        )


if __name__ == "__main__":
    main()
