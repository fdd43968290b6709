"""Cost of the RL algorithm code per train step, against the bare math measured in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.algorithms [--batch 256] [--steps 1024] [--repeat 5]

Rows (median of ``--repeat`` runs, CPU, fp32, B x T step-axis tensors, 20% padding per row):

- ``grpo`` advantages through ``compute_advantages`` (string ids -> rollout/group index, dedupe, clip,
  broadcast) vs the textbook fast path that assumes fixed-size, contiguous, segment-free groups
  (``rewards.view(-1, n)``);
- ``gae`` advantages (transparent-gap reverse recursion) vs a bare reverse loop without gap handling;
- ``PolicyLoss`` ppo + token/mask IS correction, forward + backward with metrics, vs a bare PPO
  surrogate forward + backward (no sanitising, no IS, no metrics).

The ratio column is ours / bare: the overhead of correctness (ids, segments, gaps, NaN guards, IS,
metrics) over the minimum computation. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from molt.algorithms import PolicyLoss, compute_advantages


def _median_s(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bare_grpo(rewards: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    grouped = rewards.view(-1, n)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-9)
    return adv.view(-1, 1) * mask


def _bare_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 0.95) -> torch.Tensor:
    adv = torch.zeros_like(values)
    next_v = next_a = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        next_a = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * next_a
        adv[:, t], next_v = next_a, values[:, t]
    return adv


def _bare_ppo(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> None:
    ratio = torch.exp(logp - old)
    loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    ((loss * mask).sum() / mask.sum()).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="samples per step (B)")
    parser.add_argument("--steps", type=int, default=1024, help="step-axis length (T)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt group")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    B, T, n = args.batch, args.steps, args.group
    lengths = torch.randint(int(0.6 * T), int(0.8 * T), (B,))
    mask = (torch.arange(T) < lengths.unsqueeze(1)).float()
    rewards = torch.randint(0, 2, (B,)).float()
    group_ids = [f"g{i // n}" for i in range(B)]
    rollout_ids = [f"r{i}" for i in range(B)]
    values = torch.randn(B, T) * mask
    token_rewards = torch.zeros(B, T).scatter_(1, (lengths - 1).unsqueeze(1), rewards.unsqueeze(1))

    rows = []
    ours = _median_s(
        lambda: compute_advantages("grpo", rewards, mask, group_ids=group_ids, rollout_ids=rollout_ids), args.repeat
    )
    rows.append(("grpo advantages", ours, _median_s(lambda: _bare_grpo(rewards, mask, n), args.repeat)))
    ours = _median_s(lambda: compute_advantages("gae", rewards, mask, values=values, lam=0.95), args.repeat)
    rows.append(("gae advantages", ours, _median_s(lambda: _bare_gae(token_rewards, values), args.repeat)))

    adv = torch.randn(B, T) * mask
    old = torch.randn(B, T) * 0.1 - 1.0
    rollout = old + torch.randn(B, T) * 0.05
    loss = PolicyLoss("ppo", is_level="token", is_mode="mask")

    def ours_loss() -> None:
        logp = (old + torch.randn(B, T) * 0.1).requires_grad_(True)
        out = loss(logp, old, adv, mask, num_window_tokens=int(mask.sum()), rollout_logp=rollout)
        out.loss.backward()
        {k: v.item() for k, v in out.metrics.items()}

    def bare_loss() -> None:
        _bare_ppo((old + torch.randn(B, T) * 0.1).requires_grad_(True), old, adv, mask)

    rows.append(("ppo + IS loss fwd+bwd", _median_s(ours_loss, args.repeat), _median_s(bare_loss, args.repeat)))

    print(f"B={B} T={T} group={n} threads={torch.get_num_threads()} torch={torch.__version__}\n")
    print("| path | ours (ms) | bare math (ms) | ours / bare |")
    print("|---|---|---|---|")
    for name, ours_s, bare_s in rows:
        print(f"| {name} | {ours_s * 1e3:.1f} | {bare_s * 1e3:.1f} | {ours_s / bare_s:.2f} |")


if __name__ == "__main__":
    main()
