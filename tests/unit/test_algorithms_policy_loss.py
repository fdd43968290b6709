"""Policy losses, the global token-mean, value loss and entropy."""

from __future__ import annotations

import math

import pytest
import torch

from molt.algorithms import (
    ActorLossConfig,
    AlgoConfig,
    PolicyLoss,
    entropy_from_logits,
    get_policy_loss,
    register_policy_loss,
    token_mean,
    validate_algo,
    value_loss,
)
from molt.algorithms import loss as loss_module


def _run(loss: PolicyLoss, log_ratio, advantages, mask=None, logp=None, **kw):
    """Per-token loss for given ratios: logp (default -1) with grad, old = logp - log_ratio."""
    log_ratio = torch.tensor([log_ratio], dtype=torch.float32)
    logp = torch.full_like(log_ratio, -1.0) if logp is None else torch.tensor([logp])
    logp.requires_grad_(True)
    mask = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else torch.tensor([mask], dtype=torch.bool)
    kw.setdefault("num_window_tokens", int(mask.sum()))
    out = loss(logp, logp.detach() - log_ratio, torch.tensor([advantages]), mask, **kw)
    return out, logp


def test_ppo_worked_example_with_dual_clip():
    """eps (0.2, 0.27), c = 10: ratio 1.5 / A +1 -> -1.27 (clipped); ratio 0.5 / A -1 -> 0.8 (clipped);
    ratio 20 / A -1 -> min(-20, -1.27) = -20, dual max(-20, -10) -> 10 (not counted as clipped)."""
    loss = PolicyLoss("ppo", eps_clip=(0.2, 0.27), dual_clip=10.0)
    out, _ = _run(loss, [math.log(1.5), math.log(0.5), math.log(20.0)], [1.0, -1.0, -1.0])
    torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[-1.27, 0.8, 10.0]]))
    assert out.metrics["policy_clip_ratio"].item() == pytest.approx(2 / 3)
    assert out.metrics["policy_loss"].item() == pytest.approx((-1.27 + 0.8 + 10.0) / 3)
    # without dual clip the third token costs the full 20
    out, _ = _run(PolicyLoss("ppo", eps_clip=(0.2, 0.27)), [math.log(20.0)], [-1.0])
    assert out.token_loss.item() == pytest.approx(20.0)


def test_ppo_gradient_is_zero_on_clipped_tokens():
    out, logp = _run(PolicyLoss("ppo"), [math.log(1.5), 0.0], [1.0, 1.0])
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5]]))  # d(-r*A)/dlogp = -r*A / N


def test_policy_kl_metric_and_reported_loss_ignore_the_window():
    loss = PolicyLoss("ppo")
    small, _ = _run(loss, [0.1, -0.3], [1.0, 1.0], num_window_tokens=2)
    large, _ = _run(loss, [0.1, -0.3], [1.0, 1.0], num_window_tokens=200)
    assert small.metrics["policy_kl"].item() == pytest.approx(0.1)  # mean(old - new) = mean(-0.1, 0.3)
    assert small.metrics["policy_loss"].item() == pytest.approx(large.metrics["policy_loss"].item())
    assert small.loss.item() == pytest.approx(100 * large.loss.item())


def test_global_token_mean_across_micro_batches():
    """Token losses [2, 2, 2] and [10] in one window: (6 + 10) / 4 = 4.0, not (2 + 10) / 2 = 6.0."""
    loss = PolicyLoss("ppo")
    first, _ = _run(loss, [0.0, 0.0, 0.0], [-2.0, -2.0, -2.0], num_window_tokens=4)  # ratio 1: loss = -A
    second, _ = _run(loss, [0.0], [-10.0], num_window_tokens=4)
    assert first.loss.item() + second.loss.item() == pytest.approx(4.0)
    assert (first.metrics["policy_loss"] + second.metrics["policy_loss"]).item() / 2 == pytest.approx(6.0)
    # two DP ranks holding one micro-batch each: contributions x dp_size, gradients averaged over ranks
    a, _ = _run(loss, [0.0, 0.0, 0.0], [-2.0, -2.0, -2.0], num_window_tokens=4, dp_size=2)
    b, _ = _run(loss, [0.0], [-10.0], num_window_tokens=4, dp_size=2)
    assert (a.loss.item() + b.loss.item()) / 2 == pytest.approx(4.0)


def test_accumulated_gradient_equals_gradient_of_global_token_mean():
    torch.manual_seed(0)
    mbs = []  # two micro-batches of 2 rows each, ragged masks (7 and 3 action tokens)
    for _ in range(2):
        logp = (torch.randn(2, 5) * 0.1 - 1.0).requires_grad_(True)
        mbs.append((logp, logp.detach() + torch.randn(2, 5) * 0.3, torch.randn(2, 5)))
    masks = [torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])]
    n_window = int(sum(m.sum() for m in masks))
    loss = PolicyLoss("ppo", eps_clip=(0.2, 0.28))
    assert any(
        loss(lp, old, adv, m, num_window_tokens=n_window).metrics["policy_clip_ratio"] > 0
        for (lp, old, adv), m in zip(mbs, masks)
    )  # the clipped branch is exercised
    for (logp, old, adv), mask in zip(mbs, masks):
        loss(logp, old, adv, mask, num_window_tokens=n_window).loss.backward()
    accumulated = [logp.grad.clone() for logp, _, _ in mbs]
    # reference: one explicit PPO objective over every action token of the window, divided once
    leaves = [logp.detach().clone().requires_grad_(True) for logp, _, _ in mbs]
    total = 0.0
    for leaf, (_, old, adv), mask in zip(leaves, mbs, masks):
        ratio = torch.exp(leaf - old)
        token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        total = total + (token * mask).sum()
    (total / n_window).backward()
    for got, leaf in zip(accumulated, leaves):
        torch.testing.assert_close(got, leaf.grad)


def test_empty_window_and_non_finite_inputs():
    out, logp = _run(PolicyLoss("ppo"), [0.0, 0.0], [1.0, 1.0], mask=[0, 0], num_window_tokens=0)
    out.loss.backward()
    assert out.loss.item() == 0.0 and not logp.grad.any()
    # masked-out -inf log-prob and NaN advantage; on-mask +inf log-ratio (-> 30) with A > 0 is clipped
    logp = torch.tensor([[-1.0, float("-inf"), -1.0]], requires_grad=True)
    old = torch.tensor([[float("-inf"), 0.0, -1.0]])
    adv = torch.tensor([[1.0, float("nan"), float("inf")]])
    out = PolicyLoss("ppo")(logp, old, adv, torch.tensor([[1, 0, 1]]), num_window_tokens=2)
    out.loss.backward()
    torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[-1.2, 0.0, 0.0]]))
    assert torch.isfinite(logp.grad).all()


def test_half_precision_log_probs_are_upcast():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    out = PolicyLoss("ppo")(logp, logp.detach(), torch.ones(1, 2), torch.ones(1, 2), num_window_tokens=2)
    assert out.token_loss.dtype == torch.float32
    out.loss.backward()
    assert logp.grad.dtype == torch.bfloat16 and logp.grad.tolist() == [[-0.5, -0.5]]


def test_force_on_policy_is_reinforce():
    logp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    out = PolicyLoss("ppo")(logp, None, torch.tensor([[1.0, -3.0]]), torch.ones(1, 2), num_window_tokens=2)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 1.5]]))  # -A / N
    assert out.metrics["policy_clip_ratio"].item() == 0.0


def test_gspo_uses_the_sequence_ratio():
    """Token log-ratios [-0.3, 0.3] (+ a padded 5.0 that must not count): S = 0, ratio 1 on both tokens,
    nothing clipped, although per-token PPO would clip both (e^0.3 = 1.35, e^-0.3 = 0.74)."""
    out, logp = _run(PolicyLoss("gspo"), [-0.3, 0.3, 5.0], [-1.0, 1.0, 1.0], mask=[1, 1, 0])
    torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[1.0, -1.0, 0.0]]))
    assert out.metrics["policy_clip_ratio"].item() == 0.0
    ppo, _ = _run(PolicyLoss("ppo"), [-0.3, 0.3], [-1.0, 1.0])
    assert ppo.metrics["policy_clip_ratio"].item() == 1.0
    # per-token gradient: d s_t / d logp_t = s_t = e^S
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, -0.5, 0.0]]))


def test_gspo_clips_on_the_sequence_ratio():
    """Log-ratios [0.1, 0.3]: S = 0.2, e^S = 1.2214 on both tokens; eps 0.2 clamps to 1.2 for A > 0."""
    out, _ = _run(PolicyLoss("gspo"), [0.1, 0.3], [1.0, 1.0])
    torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[-1.2, -1.2]]))
    assert out.metrics["policy_clip_ratio"].item() == 1.0
    out, logp = _run(PolicyLoss("gspo", eps_clip=(0.5, 0.5)), [0.1, 0.3], [1.0, -1.0])
    e_s = math.exp(0.2)
    torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[-e_s, e_s]]))
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-e_s / 2, e_s / 2]]))


def test_cispo_caps_the_detached_weight():
    """Ceiling 2: ratios [1.5, 3.0] -> w = [1.5, 2.0]; logp = [-0.5, -1.0], A = 1 ->
    loss -w*A*logp = [0.75, 2.0]; gradient -w*A/N = [-0.75, -1.0]; clip metric 1/2."""
    loss = PolicyLoss("cispo", eps_clip=(0.2, 2.0))
    out, logp = _run(loss, [math.log(1.5), math.log(3.0)], [1.0, 1.0], logp=[-0.5, -1.0])
    torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[0.75, 2.0]]))
    assert out.metrics["policy_clip_ratio"].item() == 0.5
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.75, -1.0]]))


def test_reinforce_is_minus_advantage_times_log_prob_whatever_the_old_policy():
    """Molt's --actor.loss_mode reinforce: logp = [-0.5, -1.0], A = [2, -1] -> loss -A*logp = [1.0, -1.0],
    gradient -A/N = [-1.0, 0.5], the same for any pi_old (ratios 1.35 and 1/3 here); nothing is clipped."""
    for ratios in ([0.0, 0.0], [0.3, -math.log(3.0)]):
        out, logp = _run(PolicyLoss("reinforce"), ratios, [2.0, -1.0], logp=[-0.5, -1.0])
        torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[1.0, -1.0]]))
        assert out.metrics["policy_clip_ratio"].item() == 0.0
        out.loss.backward()
        torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.5]]))
    with pytest.raises(ValueError, match="--actor.dual_clip works only with --actor.loss_mode ppo"):
        PolicyLoss("reinforce", dual_clip=3.0)
    hints = validate_algo(AlgoConfig(), ActorLossConfig(loss_mode="reinforce", eps_clip_low_high=[0.2, 0.3]), 1)
    assert any("--actor.eps_clip_low_high has no effect" in h for h in hints)


def test_loss_construction_rejects_bad_settings():
    with pytest.raises(ValueError, match="--actor.dual_clip must be > 1"):
        PolicyLoss("ppo", dual_clip=1.0)
    for mode in ("gspo", "cispo"):
        with pytest.raises(ValueError, match="--actor.dual_clip works only with --actor.loss_mode ppo"):
            PolicyLoss(mode, eps_clip=(0.2, 5.0), dual_clip=10.0)
    with pytest.raises(ValueError, match="absolute ratio ceiling, which must be >= 1"):
        PolicyLoss("cispo", eps_clip=(0.2, 0.2))
    with pytest.raises(ValueError, match="LOW must be < 1"):
        PolicyLoss("ppo", eps_clip=(1.0, 0.2))


def test_policy_loss_registry():
    @register_policy_loss("test_plain_pg")
    def plain_pg(inp):
        return -inp.advantages * inp.logp, torch.zeros_like(inp.action_mask)

    try:
        out, logp = _run(PolicyLoss("test_plain_pg"), [0.0, 0.0], [2.0, -1.0], logp=[-0.5, -1.0])
        torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[1.0, -1.0]]))
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_plain_pg")(plain_pg)
        with pytest.raises(ValueError, match="--actor.dual_clip works only"):
            PolicyLoss("test_plain_pg", dual_clip=3.0)
    finally:
        del loss_module._LOSSES["test_plain_pg"]
    with pytest.raises(ValueError, match="unknown policy loss 'nope'; known: cispo, gspo, ppo"):
        get_policy_loss("nope")


def test_entropy_helper_and_metric():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    torch.testing.assert_close(entropy.detach(), torch.tensor([[math.log(4), math.log(2)]]))
    token_mean(entropy, torch.ones(1, 2), num_window_tokens=2).backward()
    assert torch.isfinite(logits.grad).all()
    out, _ = _run(PolicyLoss("ppo"), [0.0, 0.0], [1.0, 1.0], entropy=entropy)
    assert out.metrics["entropy_loss"].item() == pytest.approx((math.log(4) + math.log(2)) / 2)


def test_value_loss_clip():
    """Token 1: V 1.0, V_old 0.5, R 1.2 -> V_clip 0.7; 1/2 max(0.04, 0.25) = 0.125 (clipped branch, no grad).
    Token 2: V 0.6, V_old 0.5, R 0.0 -> inside the clip; 1/2 * 0.36 = 0.18, grad (V - R)/N = 0.3."""
    values = torch.tensor([[1.0, 0.6, 7.0]], requires_grad=True)
    old, returns, mask = torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[1.2, 0.0, 0.0]]), torch.tensor([[1, 1, 0]])
    out = value_loss(values, old, returns, mask, value_clip=0.2, num_window_tokens=2)
    torch.testing.assert_close(out.token_loss.detach(), torch.tensor([[0.125, 0.18, 0.0]]))
    assert out.loss.item() == pytest.approx(0.1525)
    assert out.metrics["value_clip_frac"].item() == 0.5
    out.loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.3, 0.0]]))
    unclipped = value_loss(values, old, returns, mask, value_clip=None, num_window_tokens=2)
    torch.testing.assert_close(unclipped.token_loss.detach(), torch.tensor([[0.02, 0.18, 0.0]]))
    with pytest.raises(ValueError, match="--critic.value_clip"):
        value_loss(values, old, returns, mask, value_clip=0.0, num_window_tokens=2)
