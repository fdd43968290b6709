"""Parity with Molt's own rules for the trainer side: advantages, losses, IS correction, the data-parallel split,
checkpoint retention and resume, and the Muon parameter split.

Each test computes, on our API, a case whose expected value follows from the rule as Molt states it (the
formula is written next to the numbers). Where we deliberately differ (masked positions are zero here, Molt
leaves whitened or discounted values there), only the positions the loss reads are compared.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from molt.algorithms import KLController, PolicyLoss, compute_advantages, row_scales, token_mean, value_loss


def _group(estimator: str, rewards: list[float], groups: list[list[int]], **kw):
    """(advantages, returns) of single-token rollouts, one value per rollout."""
    group_ids = [""] * len(rewards)
    for g, members in enumerate(groups):
        for i in members:
            group_ids[i] = f"g{g}"
    adv, ret = compute_advantages(
        estimator,
        torch.tensor(rewards),
        torch.ones(len(rewards), 1),
        group_ids=group_ids,
        rollout_ids=[f"r{i}" for i in range(len(rewards))],
        **kw,
    )
    return adv[:, 0], ret[:, 0]


# ---------------------------------------------------------------- group advantages

ONE_SUCCESS = [1.0, 0.0, 0.0, 0.0]  # mean 0.25, sample std 0.5


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("reinforce_baseline", [0.75, -0.25, -0.25, -0.25]),  # r - mean
        ("dr_grpo", [0.75, -0.25, -0.25, -0.25]),  # r - mean, no std
        ("grpo", [1.5, -0.5, -0.5, -0.5]),  # (r - mean) / (sample std + 1e-9)
        ("rloo", [1.0, -1 / 3, -1 / 3, -1 / 3]),  # r - (sum - r) / (n - 1): the lone success keeps 1.0
    ],
)
def test_one_success_in_a_group_of_four(estimator, expected):
    _, ret = _group(estimator, ONE_SUCCESS, [[0, 1, 2, 3]])
    torch.testing.assert_close(ret, torch.tensor(expected), atol=1e-5, rtol=0)


def test_each_group_is_centred_on_its_own_mean():
    """Groups [1, 0] and [5, 3]: a single batch-wide baseline (2.25) would give other numbers."""
    _, ret = _group("dr_grpo", [1.0, 0.0, 5.0, 3.0], [[0, 1], [2, 3]])
    torch.testing.assert_close(ret, torch.tensor([0.5, -0.5, 1.0, -1.0]))
    _, ret = _group("rloo", [1.0, 0.0, 5.0, 3.0], [[0, 1], [2, 3]])
    torch.testing.assert_close(ret, torch.tensor([1.0, -1.0, 2.0, -2.0]))


def test_of_the_group_estimators_only_reinforce_baseline_is_whitened():
    adv, ret = _group("reinforce_baseline", ONE_SUCCESS, [[0, 1, 2, 3]])
    assert not torch.allclose(adv, ret)
    assert abs(adv.mean().item()) < 1e-5 and abs(adv.std(unbiased=False).item() - 1.0) < 1e-5
    for estimator in ("grpo", "dr_grpo", "rloo"):
        adv, ret = _group(estimator, ONE_SUCCESS, [[0, 1, 2, 3]])
        torch.testing.assert_close(adv, ret)


def test_advantages_do_not_depend_on_the_padding_width():
    """Molt computes a sample's advantages the same whether it sits alone or in a padded batch; here the whole
    batch is one call, so the same property is: extra right padding changes nothing on the original columns."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.9, 0.1, 0.4, 0.6])
    ids = dict(group_ids=["g0"] * 4 + ["g1"] * 4, rollout_ids=[f"r{i}" for i in range(8)])
    mask = torch.ones(8, 6)
    mask[::2, 4:] = 0
    tight = compute_advantages("grpo", rewards, mask, **ids)
    padded = compute_advantages("grpo", rewards, torch.cat([mask, torch.zeros(8, 5)], 1), **ids)
    for a, b in zip(tight, padded):
        torch.testing.assert_close(b[:, :6], a)
        assert not b[:, 6:].any()


# ---------------------------------------------------------------- gae / reinforce


def _token_rewards(rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """-beta * kl on every action step, plus the outcome reward on the last action step."""
    rho = -beta * kl * mask
    for i in range(mask.shape[0]):
        last = int(mask[i].nonzero().max())
        rho[i, last] += rewards[i]
    return rho


def _gae_reference(rho: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Textbook GAE on a fully active row: V after the last step is 0."""
    adv = torch.zeros_like(rho)
    running = torch.zeros(rho.shape[0])
    for t in reversed(range(rho.shape[1])):
        next_v = values[:, t + 1] if t + 1 < rho.shape[1] else torch.zeros(rho.shape[0])
        running = rho[:, t] + gamma * next_v - values[:, t] + gamma * lam * running
        adv[:, t] = running
    return adv


@pytest.mark.parametrize("lam", [0.95, 1.0])
def test_gae_returns_follow_the_standard_recursion(lam):
    g = torch.Generator().manual_seed(0)
    kl, values, rewards = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g), torch.randn(4, generator=g)
    mask = torch.ones(4, 7)
    _, ret = compute_advantages(
        "gae", rewards, mask, kl=kl, values=values, kl_coef=0.1, gamma=0.97, lam=lam, reward_clip=None
    )
    rho = _token_rewards(rewards, kl, mask, 0.1)
    torch.testing.assert_close(ret, _gae_reference(rho, values, 0.97, lam) + values, atol=1e-5, rtol=0)


def test_gae_at_gamma_and_lambda_one_returns_the_monte_carlo_return():
    g = torch.Generator().manual_seed(1)
    kl, values, rewards = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g), torch.randn(3, generator=g)
    mask = torch.ones(3, 6)
    _, ret = compute_advantages("gae", rewards, mask, kl=kl, values=values, kl_coef=0.05, reward_clip=None)
    rho = _token_rewards(rewards, kl, mask, 0.05)
    torch.testing.assert_close(ret, rho.flip(1).cumsum(1).flip(1), atol=1e-5, rtol=0)


def test_gae_last_action_before_right_padding_is_terminal():
    """Three action steps then two pad steps holding garbage values: the last action step bootstraps from 0, so
    its return is the reward (1.0) and its raw advantage r - V = 1.0 - 0.9 = 0.1."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, -0.3, 0.9, 4.0, -7.0]])
    adv, ret = compute_advantages("gae", torch.tensor([1.0]), mask, values=values, lam=0.95, whiten=False)
    assert ret[0, 2].item() == pytest.approx(1.0)
    assert adv[0, 2].item() == pytest.approx(0.1, abs=1e-6)
    # lam = 0.95, gamma = 1: A_1 = (0.9 + 0.3) + 0.95 * 0.1, A_0 = (-0.3 - 0.5) + 0.95 * A_1
    a1 = 1.2 + 0.95 * 0.1
    torch.testing.assert_close(adv, torch.tensor([[-0.8 + 0.95 * a1, a1, 0.1, 0.0, 0.0]]))


def test_gae_whitening_is_over_action_steps_only_and_returns_stay_raw():
    g = torch.Generator().manual_seed(3)
    kl, values, rewards = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g), torch.randn(4, generator=g)
    mask = torch.ones(4, 7)
    mask[:, -2:] = 0
    adv, ret = compute_advantages("gae", rewards, mask, kl=kl, values=values, kl_coef=0.1, gamma=0.97, lam=0.95)
    on = mask.bool()
    assert abs(adv[on].mean().item()) < 1e-5 and abs(adv[on].std(unbiased=False).item() - 1.0) < 1e-4
    assert not adv[~on].any() and not ret[~on].any()
    assert ret[on].std().item() > 1e-3


@pytest.mark.parametrize("gamma", [1.0, 0.75])
def test_reinforce_discounts_across_masked_observation_steps(gamma):
    """Masked steps carry no reward of their own but still count as steps of the discount (G_t = rho_t +
    gamma * G_{t+1} over the whole row). Off the mask we return 0 where Molt keeps G_t; the loss reads neither."""
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.float32)
    kl = torch.tensor([[0.5, 9.0, -0.25, 0.75, -4.0], [3.0, -0.5, 0.25, 8.0, -2.0]])
    rewards = torch.tensor([2.0, -1.0])
    rho = _token_rewards(rewards, kl, mask, 0.2)
    expected = torch.zeros_like(rho)
    running = torch.zeros(2)
    for t in reversed(range(5)):
        running = rho[:, t] + gamma * running
        expected[:, t] = running
    adv, ret = compute_advantages("reinforce", rewards, mask, kl=kl, kl_coef=0.2, gamma=gamma, whiten=False)
    torch.testing.assert_close(ret, expected * mask)
    torch.testing.assert_close(adv, expected * mask)


# ---------------------------------------------------------------- value loss and aggregation


def test_value_loss_is_half_the_worse_squared_error_as_a_token_mean():
    g = torch.Generator().manual_seed(2)
    mask = (torch.rand(5, 9, generator=g) > 0.3).float()
    values = torch.randn(5, 9, generator=g)
    old = values + 0.5 * torch.randn(5, 9, generator=g)
    returns = torch.randn(5, 9, generator=g)
    out = value_loss(values, old, returns, mask, value_clip=0.2, num_window_tokens=int(mask.sum()))
    clipped = old + (values - old).clamp(-0.2, 0.2)
    ref = 0.5 * torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    ref_loss = (ref * mask).sum() / mask.sum()
    torch.testing.assert_close(out.loss, ref_loss)
    torch.testing.assert_close(out.metrics["value_loss"], ref_loss)
    frac = (((values - old).abs() > 0.2).float() * mask).sum() / mask.sum()
    torch.testing.assert_close(out.metrics["value_clip_frac"], frac)


def test_value_loss_is_computed_in_fp32_for_half_precision_values():
    """Molt upcasts values, old values and returns to fp32 before squaring: in bf16 the squared errors of a
    critic's outputs round visibly (8 mantissa bits)."""
    values = torch.tensor([[1.001, 0.5]], dtype=torch.bfloat16, requires_grad=True)
    old = torch.tensor([[1.0, 0.5]], dtype=torch.bfloat16)
    returns = torch.tensor([[0.3, 0.1]])
    out = value_loss(values, old, returns, torch.ones(1, 2), num_window_tokens=2)
    assert out.token_loss.dtype == torch.float32 and out.loss.dtype == torch.float32
    out.loss.backward()
    assert values.grad is not None and values.grad.dtype == torch.bfloat16


def test_token_mean_of_equal_micro_batches_is_the_mean_of_their_means():
    """With the same token count in every micro-batch the window token-mean equals the old per-micro-batch mean:
    [1, 3] and [5, 7] -> 16 / 4 = 4 = (2 + 6) / 2."""
    parts = [
        token_mean(torch.tensor([[a, b]]), torch.ones(1, 2), num_window_tokens=4) for a, b in ((1.0, 3.0), (5.0, 7.0))
    ]
    assert sum(parts).item() == pytest.approx(4.0)


def test_seq_mean_token_mean_weighs_every_row_alike():
    """mean over rows with action tokens of (row sum / row tokens): rows [2, 2, 2], [10], [] -> (2 + 10) / 2."""
    losses = torch.tensor([[2.0, 2.0, 2.0], [10.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    scales = row_scales("seq-mean-token-mean", mask.sum(1).tolist(), ["a", "b", "c"])
    total = ((losses * mask).sum(1) * torch.tensor(scales)).sum()
    assert total.item() == pytest.approx(6.0)


# ---------------------------------------------------------------- policy loss and IS correction

ONE = torch.ones(1, 1)


def _loss(loss: PolicyLoss, logp, old, adv, mask=None, rollout=None):
    mask = torch.ones_like(logp) if mask is None else mask
    return loss(logp, old, adv, mask, num_window_tokens=int(mask.sum()), rollout_logp=rollout)


def test_cispo_caps_ratios_above_the_ceiling_only():
    """Ratios e^0.5 = 1.65 and e^-0.5 = 0.61 under a ceiling of 1.2: the first weight is 1.2, the second stays
    0.61 (no floor); loss = -mean(w * A * logp)."""
    logp = torch.tensor([[0.5, -0.5]])
    out = _loss(PolicyLoss("cispo", eps_clip=(0.2, 1.2)), logp, torch.zeros(1, 2), torch.ones(1, 2))
    expected = -(1.2 * 0.5 + math.exp(-0.5) * -0.5) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.metrics["policy_clip_ratio"].item() == pytest.approx(0.5)


def test_gspo_ignores_per_token_spread_that_ppo_clips():
    """Token log-ratios +1 and -1: PPO clips the first (1.2) and keeps e^-1 on the second, clip ratio 1/2;
    GSPO's sequence ratio is e^0 = 1, nothing clipped, loss -1."""
    args = (torch.tensor([[1.0, -1.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    gspo, ppo = _loss(PolicyLoss("gspo"), *args), _loss(PolicyLoss("ppo"), *args)
    assert gspo.loss.item() == pytest.approx(-1.0) and gspo.metrics["policy_clip_ratio"].item() == 0.0
    assert ppo.loss.item() == pytest.approx(-(1.2 + math.exp(-1.0)) / 2)
    assert ppo.metrics["policy_clip_ratio"].item() == 0.5


def test_zero_advantage_with_extreme_or_undefined_ratios_costs_nothing():
    out = _loss(PolicyLoss("ppo"), torch.full((1, 1), 1000.0), torch.zeros(1, 1), torch.zeros(1, 1))
    assert out.loss.item() == 0.0
    inf = torch.full((1, 1), -math.inf)
    out = _loss(PolicyLoss("ppo"), inf, inf, torch.zeros(1, 1))
    assert out.loss.item() == 0.0
    assert all(math.isfinite(v.item()) for v in out.metrics.values())


def test_empty_action_mask_gives_zero_loss_and_metrics_even_with_nan_inputs():
    nan = torch.full((1, 2), math.nan)
    out = _loss(PolicyLoss("ppo"), nan, nan, torch.ones(1, 2), mask=torch.zeros(1, 2))
    assert out.loss.item() == 0.0
    assert out.metrics["policy_clip_ratio"].item() == 0.0 and out.metrics["policy_kl"].item() == 0.0


@pytest.mark.parametrize(
    ("level", "mode", "logp", "old", "rollout", "adv", "loss", "filter_ratio"),
    [
        # token/mask: delta = old - rollout = 1000 -> clamped to 30, e^30 outside [0.5, 2] -> dropped, finite
        ("token", "mask", 0.0, 1000.0, 0.0, 1.0, 0.0, 1.0),
        # token/trunc: delta 1000 -> 30 -> weight capped at 2, loss -2
        ("token", "trunc", 0.0, 0.0, -1000.0, 1.0, -2.0, 1.0),
        # geo/mask: the sequence's mean delta overflows -> the sequence is rejected, no NaN
        ("geo", "mask", 1000.0, 0.0, -1000.0, 0.0, 0.0, 1.0),
        # -inf - -inf is undefined -> delta 0, weight 1, nothing filtered
        ("token", "trunc", 0.0, -math.inf, -math.inf, 0.0, 0.0, 0.0),
    ],
)
def test_is_correction_stays_finite_on_overflow(level, mode, logp, old, rollout, adv, loss, filter_ratio):
    pl = PolicyLoss("ppo", is_level=level, is_mode=mode, is_threshold=(0.5, 2.0))
    t = lambda x: torch.full((1, 1), x)  # noqa: E731
    out = _loss(pl, t(logp), t(old), t(adv), rollout=t(rollout))
    assert out.loss.item() == pytest.approx(loss)
    assert out.metrics["is_filter_ratio"].item() == pytest.approx(filter_ratio)
    assert math.isfinite(out.metrics["vllm_kl"].item())


def test_force_on_policy_still_applies_is_correction_and_reports_vllm_kl():
    """old = the detached current forward (0); rollout -0.1 -> vllm_kl = mean(rollout - old) = -0.1, and the
    token/trunc weight e^0.1 scales the REINFORCE loss."""
    pl = PolicyLoss("ppo", is_level="token", is_mode="trunc", is_threshold=(0.0, 100.0))
    logp = torch.zeros(1, 2, requires_grad=True)
    out = pl(
        logp, None, torch.ones(1, 2), torch.ones(1, 2), num_window_tokens=2, rollout_logp=torch.full((1, 2), -0.1)
    )
    assert out.metrics["vllm_kl"].item() == pytest.approx(-0.1)
    assert out.loss.item() == pytest.approx(-math.exp(0.1), abs=1e-6)


# ---------------------------------------------------------------- data-parallel split


def test_every_rank_gets_its_samples_longest_first_and_counts_differ_by_at_most_one():
    """Molt sorts each rank's block by length (descending) so the k-th micro-batches of all ranks are of similar
    size; it drops the remainder to equalise counts, where we pad short ranks with an empty micro-batch."""
    from services.trainer.batch import partition

    lengths = [10 - i for i in range(10)]
    ranks = partition(lengths, 4)
    assert sorted(i for r in ranks for i in r) == list(range(10))
    assert max(map(len, ranks)) - min(map(len, ranks)) <= 1
    for r in ranks:
        assert [lengths[i] for i in r] == sorted((lengths[i] for i in r), reverse=True)


# ---------------------------------------------------------------- checkpoints


def _step_dirs(root, *names):
    for name in names:
        (root / name).mkdir()
        (root / name / "extra_state.pt").write_bytes(b"x")


def test_retention_keeps_the_newest_steps_and_never_touches_best(tmp_path):
    """Oldest regular checkpoints go first (by step, so 10 is newer than 9); best_* and the one just written
    survive; max_num <= 0 keeps everything."""
    from services.trainer.checkpoint import prune

    _step_dirs(tmp_path, "global_step9", "global_step10", "global_step2", "best_global_step2", "global_step11")
    prune(tmp_path, 0, keep="global_step11")
    assert len(list(tmp_path.iterdir())) == 5
    prune(tmp_path, 2, keep="global_step11")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best_global_step2", "global_step10", "global_step11"]


def test_resume_picks_latest_else_the_newest_complete_step_never_best(tmp_path):
    from services.trainer.checkpoint import latest_dir

    assert latest_dir(str(tmp_path / "none")) is None
    _step_dirs(tmp_path, "global_step3", "global_step20", "best_global_step30")
    (tmp_path / "global_step40").mkdir()  # no extra_state.pt: not finished
    (tmp_path / "latest").write_text("global_step3")
    assert latest_dir(str(tmp_path)).name == "global_step3"
    (tmp_path / "latest").write_text("global_step40")  # points at an unfinished one
    assert latest_dir(str(tmp_path)).name == "global_step20"


class _Learner:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.actor = nn.Linear(3, 2)
        self.optim = torch.optim.AdamW(self.actor.parameters(), lr=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda step: 1.0 / (1 + step))
        self.kl_ctl = KLController(0.1, target=0.01, horizon=100)
        self.global_step = 0


def test_resume_restores_weights_optimizer_schedule_kl_and_client_state(tmp_path, one_process_group):
    """Everything a resumed run continues from, including a client state with tensors, tuples and int keys."""
    from services.trainer import checkpoint

    src = _Learner(0)
    src.actor(torch.ones(1, 3)).sum().backward()
    src.optim.step()
    src.sched.step()
    src.kl_ctl.update(1.0, 100)
    src.global_step = 7
    client = {
        "position": 42,
        "rng": torch.arange(5, dtype=torch.int64),
        "pairs": [(0, 1234), (1, 5678)],
        "by_int": {0: "a", 1: "b"},
        "best": {"key": "eval/accuracy", "value": 0.788},
    }
    checkpoint.save(str(tmp_path), src, client, max_num=3)
    dst = _Learner(1)
    got = checkpoint.load(str(tmp_path), dst)
    assert got is not None
    assert got["position"] == 42 and got["pairs"] == [(0, 1234), (1, 5678)] and got["by_int"] == {0: "a", 1: "b"}
    assert torch.equal(got["rng"], client["rng"]) and got["best"] == client["best"]
    assert dst.global_step == 7 and dst.kl_ctl.value == pytest.approx(0.12)
    assert dst.sched.state_dict()["last_epoch"] == 1
    for a, b in zip(src.actor.parameters(), dst.actor.parameters()):
        torch.testing.assert_close(a, b)
    exp_avg = [s["exp_avg"] for s in dst.optim.state.values()]
    assert len(exp_avg) == 2 and all(t.abs().sum() > 0 for t in exp_avg)


# ---------------------------------------------------------------- Muon parameter split


class _GroupedExperts(nn.Module):
    """An MoE layer's experts as one [experts, out, in] tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 8, 8))


def _muon_cfg():
    from molt.config import parse_settings
    from services.trainer.config import TrainerSettings

    argv = ["--actor.model_name_or_path", "m", "--train.dispatch", "false", "--actor.optim", "muon"]
    return parse_settings(TrainerSettings, argv, environ={}).actor


def _split(experts: nn.Module):
    from services.trainer.muon import param_groups

    model = nn.Module()
    model.experts = experts
    muon, adamw = param_groups(model, _muon_cfg())
    return [p for g in muon for p in g["params"]], [p for g in adamw for p in g["params"]]


def test_grouped_experts_go_to_muon_also_under_an_fsdp_renamed_class():
    for cls in (_GroupedExperts, type("FSDP_GroupedExperts", (_GroupedExperts,), {})):
        muon, adamw = _split(cls())
        assert [p.ndim for p in muon] == [3] and adamw == []


@pytest.mark.parametrize("value", ["1", "true", "True"])
def test_muon_experts_adamw_sends_grouped_experts_back_to_adamw(monkeypatch, value):
    """Molt's MUON_EXPERTS_ADAMW escape hatch: the expert tensors are optimised by AdamW instead."""
    monkeypatch.setenv("MUON_EXPERTS_ADAMW", value)
    muon, adamw = _split(_GroupedExperts())
    assert muon == [] and [p.ndim for p in adamw] == [3]
