"""Advantage estimators: hand-derived examples, dedupe, clipping, registry.

Unless stated otherwise: one group, every sample has the same number of action tokens, gamma = lambda
= 1, beta = 0, rewards already inside the clip range.
"""

from __future__ import annotations

import math

import pytest
import torch

from molt.algorithms import (
    PolicyLoss,
    approx_kl,
    compute_advantages,
    get_advantage_estimator,
    register_advantage_estimator,
)
from molt.algorithms import advantages as adv_module


def _one_group(estimator: str, rewards: list[float], num_tokens: int = 3, **kw):
    """Advantages and returns of the first action token of each sample (all tokens are equal)."""
    n = len(rewards)
    adv, ret = compute_advantages(
        estimator,
        torch.tensor(rewards),
        torch.ones(n, num_tokens, dtype=torch.bool),
        group_ids=["g"] * n,
        rollout_ids=[f"r{i}" for i in range(n)],
        **kw,
    )
    torch.testing.assert_close(adv, adv[:, :1].expand_as(adv))  # broadcast to every action token
    return adv[:, 0].tolist(), ret[:, 0].tolist()


GROUP_A = [1.0, 0.0, 0.0, 1.0]  # mean 0.5
GROUP_B = [1.0, 1.0, 1.0, 0.0]  # mean 0.75


@pytest.mark.parametrize(
    ("estimator", "rewards", "expected"),
    [
        ("dr_grpo", GROUP_A, [0.5, -0.5, -0.5, 0.5]),
        # sum (r - mu)^2 = 1, sample var = 1/3, std = 0.57735 -> 0.5 / 0.57735
        ("grpo", GROUP_A, [0.8660, -0.8660, -0.8660, 0.8660]),
        # leave-one-out baselines (2 - r)/3 = [1/3, 2/3, 2/3, 1/3]
        ("rloo", GROUP_A, [0.6667, -0.6667, -0.6667, 0.6667]),
        # returns [0.5, -0.5, -0.5, 0.5], mu = 0, population sigma = 0.5
        ("reinforce_baseline", GROUP_A, [1.0, -1.0, -1.0, 1.0]),
        ("dr_grpo", GROUP_B, [0.25, 0.25, 0.25, -0.75]),
        # sum (r - mu)^2 = 0.75, sample var = 0.25, std = 0.5
        ("grpo", GROUP_B, [0.5, 0.5, 0.5, -1.5]),
        # baselines (3 - r)/3 = [2/3, 2/3, 2/3, 1]
        ("rloo", GROUP_B, [0.3333, 0.3333, 0.3333, -1.0]),
        # population sigma = sqrt(0.1875) = 0.43301
        ("reinforce_baseline", GROUP_B, [0.5774, 0.5774, 0.5774, -1.7321]),
    ],
)
def test_group_estimators_worked_examples(estimator, rewards, expected):
    adv, _ = _one_group(estimator, rewards)
    assert adv == pytest.approx(expected, abs=1e-4)


def test_returns_are_advantages_before_whitening():
    adv, ret = _one_group("reinforce_baseline", GROUP_A)
    assert ret == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0])
    # --algo.advantage.no_whiten: the advantages are the returns
    adv, ret = _one_group("reinforce_baseline", GROUP_A, whiten=False)
    assert adv == pytest.approx(ret)


def test_no_std_norm_subtracts_the_token_weighted_mean_only():
    """--algo.advantage.no_std_norm: Rewards [1, 0] in one group, 3 and 1 action tokens: returns [0.5, -0.5]
    broadcast, mu = 0.25 over the 4 action tokens -> [0.25, -0.75], no division; zero off the mask."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = compute_advantages(
        "reinforce_baseline", torch.tensor([1.0, 0.0]), mask, group_ids=["g", "g"], std_norm=False
    )
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.25, 0.25], [-0.75, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.5, 0.5], [-0.5, 0.0, 0.0]]))
    # no_whiten wins over it where both reach compute_advantages (validate_algo refuses the pair)
    adv, ret = compute_advantages("reinforce", torch.tensor([1.0, 0.0]), mask, whiten=False, std_norm=False)
    torch.testing.assert_close(adv, ret)


def test_two_groups_in_one_batch_have_independent_baselines_and_shared_whitening():
    rewards = torch.tensor(GROUP_A + GROUP_B)
    mask = torch.ones(8, 2)
    ids = dict(group_ids=["A"] * 4 + ["B"] * 4, rollout_ids=[f"r{i}" for i in range(8)])
    adv, ret = compute_advantages("reinforce_baseline", rewards, mask, **ids)
    assert ret[:, 0].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    # mu = 0, sigma^2 = (4*0.25 + 3*0.0625 + 0.5625)/8 = 0.21875, sigma = 0.46771
    expected = [1.0690, -1.0690, -1.0690, 1.0690, 0.5345, 0.5345, 0.5345, -1.6036]
    assert adv[:, 0].tolist() == pytest.approx(expected, abs=1e-4)
    # reinforce on the same batch: return = r_i on every token; mu = 5/8, sigma^2 = 0.234375
    adv, _ = compute_advantages("reinforce", rewards, mask, **ids)
    expected = [0.7746 if r == 1 else -1.2910 for r in GROUP_A + GROUP_B]
    assert adv[:, 0].tolist() == pytest.approx(expected, abs=1e-4)
    assert adv[:, 1].tolist() == pytest.approx(expected, abs=1e-4)


def test_whitening_is_token_weighted():
    """Rewards [1, 0] in one group, 3 and 1 action tokens: A = [0.5, -0.5] broadcast.

    mu = (3*0.5 - 0.5)/4 = 0.25, sigma^2 = (3*0.0625 + 0.5625)/4 = 0.1875 -> [0.57735, -1.73205].
    """
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = compute_advantages("reinforce_baseline", torch.tensor([1.0, 0.0]), mask, group_ids=["g", "g"])
    torch.testing.assert_close(adv, torch.tensor([[0.57735, 0.57735, 0.57735], [-1.73205, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.5, 0.5], [-0.5, 0.0, 0.0]]))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_unwhitened_group_estimators_ignore_whiten_flag(estimator):
    assert _one_group(estimator, GROUP_B, whiten=True) == _one_group(estimator, GROUP_B, whiten=False)


def test_singleton_and_constant_groups():
    assert _one_group("grpo", [2.0])[0] == [0.0]
    assert _one_group("rloo", [2.0])[0] == [2.0]
    assert _one_group("grpo", [0.5] * 4)[0] == [0.0] * 4


def test_multi_segment_rollout_counts_once_in_group_baseline():
    """Rollout r0 was compacted into two segments. Deduped group = [1, 0, 0, 1] (mean 0.5, as group A);
    counting segments would give mean 0.6. Both segments of r0 get r0's advantage."""
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    ids = dict(group_ids=["g"] * 5, rollout_ids=["r0", "r0", "r1", "r2", "r3"])
    adv, _ = compute_advantages("dr_grpo", rewards, mask, **ids)
    torch.testing.assert_close(adv, torch.tensor([0.5, 0.5, -0.5, -0.5, 0.5]).unsqueeze(1) * mask)
    adv, _ = compute_advantages("grpo", rewards, mask, **ids)
    assert adv[:, 0].tolist() == pytest.approx([0.8660, 0.8660, -0.8660, -0.8660, 0.8660], abs=1e-4)
    adv, _ = compute_advantages("rloo", rewards, mask, **ids)
    assert adv[:, 0].tolist() == pytest.approx([2 / 3, 2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-4)


def test_non_group_estimators_do_not_merge_segments():
    rewards, mask = torch.tensor([1.0, 1.0, 0.0]), torch.ones(3, 2)
    with_ids = compute_advantages("reinforce", rewards, mask, group_ids=["g"] * 3, rollout_ids=["r0", "r0", "r1"])
    without = compute_advantages("reinforce", rewards, mask)
    torch.testing.assert_close(with_ids, without)


def test_rollout_in_two_groups_is_rejected():
    with pytest.raises(ValueError, match="rollout_id 'r0' appears in groups"):
        compute_advantages("grpo", torch.ones(2), torch.ones(2, 1), group_ids=["a", "b"], rollout_ids=["r0", "r0"])
    with pytest.raises(ValueError, match="group_ids has 1 entries"):
        compute_advantages("grpo", torch.ones(2), torch.ones(2, 1), group_ids=["a"])


def test_nan_reward_is_rejected_and_inf_is_clipped():
    with pytest.raises(ValueError, match=r"rewards of samples \[1\] are NaN"):
        _one_group("grpo", [1.0, float("nan")])
    assert _one_group("dr_grpo", [float("inf"), 0.0])[0] == [5.0, -5.0]


def test_rewards_are_clipped_before_the_estimator():
    # clipped [10, 0] -> mean 5 -> [5, -5]; unclipped would be [10, -10]
    assert _one_group("dr_grpo", [20.0, 0.0])[0] == [5.0, -5.0]
    assert _one_group("dr_grpo", [20.0, 0.0], reward_clip=(-1.0, 1.0))[0] == [0.5, -0.5]
    assert _one_group("dr_grpo", [20.0, 0.0], reward_clip=None)[0] == [10.0, -10.0]


def test_reinforce_discount_kl_reward_and_last_token():
    mask = torch.tensor([[1, 1, 1]])
    # gamma = 0.5: r on the last action token -> G = [0.25, 0.5, 1]
    adv, ret = compute_advantages("reinforce", torch.tensor([1.0]), mask, gamma=0.5, whiten=False)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0]]))
    # beta = 0.1, k = 1 per token: rho = [-0.1, -0.1, 0.9] -> G = [0.7, 0.8, 0.9]
    adv, _ = compute_advantages("reinforce", torch.tensor([1.0]), mask, kl=torch.ones(1, 3), kl_coef=0.1, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.7, 0.8, 0.9]]))
    # reward lands on the last *action* token; trailing padding stays 0
    mask = torch.tensor([[0, 1, 1, 0]])
    adv, _ = compute_advantages("reinforce", torch.tensor([2.0]), mask, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 2.0, 2.0, 0.0]]))


def test_gae_worked_examples():
    """Two action tokens, r = 1 on the last, V = [0.5, 0.8]."""
    one, values = torch.tensor([1.0]), torch.tensor([[0.5, 0.8]])
    adv, ret = compute_advantages("gae", one, torch.ones(1, 2), values=values, lam=1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0]]))
    adv, ret = compute_advantages("gae", one, torch.ones(1, 2), values=values, lam=0.9, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.48, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.98, 1.0]]))
    # interior observation token is transparent: A = [0.3 + 0.5*0.2, 0, 0.2]; its value is ignored
    mask, values = torch.tensor([[1, 0, 1]]), torch.tensor([[0.5, float("nan"), 0.8]])
    adv, ret = compute_advantages("gae", one, mask, values=values, lam=0.5, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.4, 0.0, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.9, 0.0, 1.0]]))


def test_gae_whitens_advantages_but_not_returns():
    rewards, values = torch.tensor([1.0, 0.0]), torch.tensor([[0.5, 0.8], [0.2, 0.1]])
    raw, ret_raw = compute_advantages("gae", rewards, torch.ones(2, 2), values=values, whiten=False)
    adv, ret = compute_advantages("gae", rewards, torch.ones(2, 2), values=values)
    torch.testing.assert_close(ret, ret_raw)
    torch.testing.assert_close(adv, (raw - raw.mean()) / raw.var(unbiased=False).sqrt())
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages("gae", rewards, torch.ones(2, 2))


def test_on_policy_distill_is_minus_beta_k1():
    student, teacher = torch.tensor([[-1.2, 0.0]]), torch.tensor([[-0.7, -5.0]])
    kl = approx_kl(student, teacher, "k1")
    mask = torch.tensor([[1, 0]])
    adv, ret = compute_advantages("on_policy_distill", torch.zeros(1), mask, kl=kl, kl_coef=1.0, whiten=True)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0]]))  # not whitened, masked
    torch.testing.assert_close(ret, adv)


def test_empty_mask_gives_zeros():
    adv, ret = compute_advantages("reinforce", torch.tensor([1.0, 0.0]), torch.zeros(2, 3))
    assert not adv.any() and not ret.any()


@pytest.mark.parametrize(
    ("estimator", "a"),
    [("dr_grpo", 0.5), ("grpo", 0.5 / math.sqrt(1 / 3)), ("rloo", 2 / 3), ("reinforce_baseline", 1.0)],
)
def test_group_a_advantages_to_per_token_loss_and_gradient(estimator, a):
    """Group A, two action tokens each, ratio 1 (first PPO epoch): per-token loss = -A, loss = mean(-A) = 0,
    and the gradient on each token's log-prob is -A / N_window with N_window = 8."""
    mask = torch.ones(4, 2)
    adv, _ = compute_advantages(estimator, torch.tensor(GROUP_A), mask, group_ids=["g"] * 4)
    logp = torch.full((4, 2), -0.7, requires_grad=True)
    out = PolicyLoss("ppo")(logp, logp.detach(), adv, mask, num_window_tokens=8)
    expected = torch.tensor([[-a], [a], [a], [-a]]).expand(4, 2)
    torch.testing.assert_close(out.token_loss.detach(), expected)
    assert out.loss.item() == pytest.approx(0.0, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, expected / 8)


def test_registry_add_and_unknown():
    @register_advantage_estimator("test_median_baseline", grouped=True)
    def median_baseline(batch):
        adv = batch.broadcast(batch.rollout_rewards - batch.rollout_rewards.median())
        return adv, adv

    try:
        assert get_advantage_estimator("test_median_baseline").grouped
        assert _one_group("test_median_baseline", [3.0, 1.0, 0.0])[0] == [2.0, 0.0, -1.0]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_median_baseline")(median_baseline)
    finally:
        del adv_module._ESTIMATORS["test_median_baseline"]
    with pytest.raises(
        ValueError, match="unknown advantage estimator 'nope'; known: dr_grpo, flash_reinforce, gae, grpo"
    ):
        get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="--algo.advantage.estimator"):
        compute_advantages("nope", torch.ones(1), torch.ones(1, 1))
