"""FlashREINFORCE as Molt composes it from flags, and its three parts on their own:
``--algo.advantage.estimator flash_reinforce`` (reward minus the batch mean), ``--algo.advantage.is_correction_gating
binary_kl|tv`` (a divergence gate instead of the ratio band) and ``--actor.loss_agg_mode`` (token, row or prompt
weighting). The reference below is the paper's loss written out directly: with one rollout per prompt and the
PPO ratio fixed at 1,

    L = -1/B sum_i 1/n_i sum_t [KL_i <= delta] * exp(log pi_old_it - log mu_it) * (r_i - mean r) * log pi_it

where KL_i is the mean over row i's tokens of the binary KL between mu (vLLM's probability of the sampled token)
and pi_old, and n_i counts row i's action tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from molt.algorithms import (
    PolicyLoss,
    check_is_correction,
    compute_advantages,
    is_correction,
    row_scales,
    scaled_sum,
)
from molt.algorithms.aggregation import LOSS_AGG_MODES
from molt.config import parse_settings
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings

# Three rows of 3, 2 and 3 action tokens; row 1 is far from vLLM's probabilities on its first token.
LOGP = [[-1.0, -2.0, -3.0], [-0.2, -1.0, -4.0], [-1.0, -1.0, -1.0]]
MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
REWARDS = [1.0, 0.0, 0.5]


def _rollout_logp(logp: torch.Tensor) -> torch.Tensor:
    mu = logp - 0.01
    mu[1, 0] = -3.0  # p = 0.05 against q = 0.82: binary KL ~ 1.8 on that token
    return mu


def _binary_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    p, q = p.clamp(1e-6, 1 - 1e-6), q.clamp(1e-6, 1 - 1e-6)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def _reference_loss(logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, delta: float):
    old = logp.detach()
    per_token_kl = _binary_kl(mu.exp(), old.exp()) * mask
    admitted = (per_token_kl.sum(-1) / mask.sum(-1)) <= delta
    weight = torch.exp(old - mu) * admitted[:, None] * mask
    adv = rewards - rewards.mean()
    return -((weight * adv[:, None] * logp * mask).sum(-1) / mask.sum(-1)).mean(), admitted


@pytest.mark.parametrize("delta", [5e-3, math.inf])
def test_flash_reinforce_flags_give_the_papers_gradient(delta):
    logp = torch.tensor(LOGP, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.bool)
    mu = _rollout_logp(logp.detach())
    rewards = torch.tensor(REWARDS)
    adv, _ = compute_advantages("flash_reinforce", rewards, mask.float(), rollout_ids=["a", "b", "c"])
    loss_fn = PolicyLoss("ppo", is_level="seq", is_mode="mask", is_threshold=(0.0, delta), is_gating="binary_kl")
    scale = torch.tensor(row_scales("seq-mean-token-mean", [3, 2, 3], ["a", "b", "c"]))
    out = loss_fn(logp, None, adv, mask, num_window_tokens=8, rollout_logp=mu, row_scale=scale)  # force on policy
    (grad,) = torch.autograd.grad(out.loss, logp)

    ref_logp = torch.tensor(LOGP, requires_grad=True)
    ref, admitted = _reference_loss(ref_logp, mu, mask.float(), rewards, delta)
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    assert admitted.tolist() == ([True, False, True] if delta < 1 else [True, True, True])
    assert out.metrics["is_filter_ratio"].item() == pytest.approx(1 - admitted.float().mean().item())


def test_flash_reinforce_advantage_is_reward_minus_the_batch_mean_per_rollout():
    # rollout r1 has two segments (rows 0 and 1): it counts once in the mean; no whitening, no groups
    mask = torch.ones(4, 2)
    adv, ret = compute_advantages(
        "flash_reinforce",
        torch.tensor([1.0, 1.0, 0.0, 0.5]),
        mask,
        group_ids=["g1", "g1", "g2", "g3"],
        rollout_ids=["r1", "r1", "r2", "r3"],
    )
    mean = (1.0 + 0.0 + 0.5) / 3
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0 - mean, 1.0 - mean, -mean, 0.5 - mean]))
    torch.testing.assert_close(adv, ret)


@pytest.mark.parametrize("gating", ["binary_kl", "tv"])
def test_divergence_gate_at_token_level_drops_far_tokens_and_keeps_the_ratio_weight(gating):
    old = torch.tensor([[-0.2, -1.0, -1.0]])
    mu = torch.tensor([[-3.0, -1.0, -1.01]])
    p, q = mu.exp(), old.exp()
    div = _binary_kl(p, q) if gating == "binary_kl" else (p - q).abs()
    out = is_correction(old, mu, torch.ones(1, 3), level="token", mode="mask", threshold=(0.0, 0.05), gating=gating)
    assert out is not None
    keep = div <= 0.05
    assert keep.tolist() == [[False, True, True]]
    torch.testing.assert_close(out.coef, torch.exp(old - mu) * keep)
    assert out.filter_ratio.item() == pytest.approx(1 / 3)


def test_identical_policies_pass_a_zero_width_trust_region():
    """Where pi_old == mu the binary KL is 0 up to rounding; a band [0, 1e-12] still keeps every sequence."""
    logp = torch.log(torch.tensor([[0.3, 0.999999, 1e-9], [0.7, 0.5, 0.2]]))
    mask = torch.ones(2, 3)
    out = is_correction(logp, logp.clone(), mask, level="seq", mode="mask", threshold=(0, 1e-12), gating="binary_kl")
    assert out is not None and out.filter_ratio.item() == 0.0


@pytest.mark.parametrize(
    ("level", "mode", "threshold", "gating", "needle"),
    [
        ("token", "clip", (0.0, 1e-3), "binary_kl", "supports only --algo.advantage.is_correction_mode mask"),
        ("seq", "mask", (0.5, 5.0), "binary_kl", "takes an upper bound only"),
        ("seq", "mask", (0.0, 1e-3), "kl", "is_correction_gating 'kl' is unknown"),
    ],
)
def test_gating_refusals_name_the_flag(level, mode, threshold, gating, needle):
    with pytest.raises(ValueError, match=needle):
        check_is_correction(level, mode, threshold, gating)


def _settings(*flags):
    return parse_settings(
        TrainerSettings, ["--actor.model_name_or_path", "m", "--train.dispatch", "false", *flags], environ={}
    )


def test_molts_flash_reinforce_flags_parse_and_validate():
    """The FlashREINFORCE row of Molt's README, with its quick-start's batch sizes."""
    s = _settings(
        "--train.force_on_policy",
        "--algo.advantage.estimator",
        "flash_reinforce",
        "--algo.advantage.is_correction_level",
        "seq",
        "--algo.advantage.is_correction_gating",
        "binary_kl",
        "--algo.advantage.is_correction_threshold",
        "5e-3",
        "--actor.loss_agg_mode",
        "seq-mean-token-mean",
        "--rollout.n_samples_per_prompt",
        "1",
        "--algo.kl.init_coef",
        "0",
    )
    validate_settings(s)
    adv = s.algo.advantage
    assert (adv.is_correction_threshold, adv.is_correction_gating, s.actor.loss_agg_mode) == (
        [0.0, 5e-3],
        "binary_kl",
        "seq-mean-token-mean",
    )
    assert _settings("--algo.advantage.is_correction_threshold", "inf").algo.advantage.is_correction_threshold == [
        0.0,
        math.inf,
    ]


def test_a_divergence_gate_without_its_delta_is_refused_at_start_up():
    s = _settings("--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_gating", "tv")
    with pytest.raises(ValueError, match="takes an upper bound only"):
        validate_settings(s)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_row_scales_weigh_tokens_rows_or_prompts(mode):
    n = [3, 1, 0, 4]
    groups = ["a", "a", "b", "c"]
    s = row_scales(mode, n, groups)
    assert sum(si * ni for si, ni in zip(s, n, strict=True)) == pytest.approx(1.0)
    assert s[2] == 0.0
    expected = {
        "token-mean": [1 / 8, 1 / 8, 0.0, 1 / 8],
        "seq-mean-token-mean": [1 / 9, 1 / 3, 0.0, 1 / 12],  # 3 rows with tokens
        "prompt-mean-token-mean": [1 / 8, 1 / 8, 0.0, 1 / 8],  # 2 groups with tokens: a (4 tokens), c (4)
    }[mode]
    assert s == pytest.approx(expected)
    with pytest.raises(ValueError, match="--actor.loss_agg_mode 'sum' is unknown"):
        row_scales("sum", n, groups)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "prompt-mean-token-mean"])
def test_a_window_cut_into_micro_batches_and_ranks_gives_the_whole_windows_loss(mode):
    """Summing each micro-batch's scaled_sum (dp=2 doubles each share, averaging halves it back) equals the
    mode's formula on the whole window, whatever the cut."""
    torch.manual_seed(0)
    loss = torch.randn(5, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    groups = ["a", "a", "b", "b", "c"]
    n = mask.sum(-1).tolist()
    s = torch.tensor(row_scales(mode, n, groups))
    if mode == "seq-mean-token-mean":
        rows = [i for i in range(5) if n[i]]
        want = sum(loss[i][mask[i]].mean() for i in rows) / len(rows)
    else:
        want = sum(torch.cat([loss[i][mask[i]] for i in range(5) if groups[i] == g]).mean() for g in "abc") / 3
    for cut in ([0, 1, 2, 3, 4], [0, 3], [2]):
        parts = [list(range(a, b)) for a, b in zip([0, *cut], [*cut, 5], strict=True) if a < b]
        got = sum(scaled_sum(loss[p], mask[p], s[p], dp_size=2) for p in parts) / 2
        torch.testing.assert_close(got, want)
