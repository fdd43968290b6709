"""IS correction for the train/rollout mismatch: hand-worked examples, every level x mode.

Worked-example setup: one sequence of 3 action tokens, PPO ratio 1 and A = 1 (so the base per-token
loss is -1), band [0.8, 1.25], N_window = 3, dp = 1; delta = log pi_old - log pi_rollout.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from molt.algorithms import IS_LEVELS, IS_MODES, PolicyLoss, check_is_correction

DELTA = [0.02, -0.30, 0.30]  # w = [1.02020, 0.74082, 1.34986]
BAND = (0.8, 1.25)


def _run(level: str, mode: str, delta, band=BAND, mask=None, advantages=None):
    delta = torch.tensor([delta]) if not isinstance(delta[0], list) else torch.tensor(delta)
    old = torch.full_like(delta, -1.0)
    logp = old.clone().requires_grad_(True)  # ratio 1
    mask = torch.ones_like(delta) if mask is None else torch.tensor(mask)
    adv = torch.ones_like(delta) if advantages is None else torch.tensor(advantages)
    loss = PolicyLoss("ppo", is_level=level, is_mode=mode, is_threshold=band)
    out = loss(logp, old, adv, mask, num_window_tokens=int(mask.sum()), rollout_logp=old - delta)
    return out, logp


@pytest.mark.parametrize(
    ("level", "mode", "coef", "loss", "filter_ratio"),
    [
        ("token", "mask", [1.02020, 0.0, 0.0], -0.34007, 2 / 3),
        ("token", "clip", [1.02020, 0.8, 1.25], -1.02340, 2 / 3),
        ("token", "trunc", [1.02020, 0.74082, 1.25], -1.00367, 1 / 3),
        # sum delta = 0.02 -> u = 1.0202 kept; survivors keep their per-token w
        ("seq", "mask", [1.02020, 0.74082, 1.34986], -1.03696, 0.0),
        # mean delta = 0.00667 -> u = 1.0067 kept
        ("geo", "mask", [1.02020, 0.74082, 1.34986], -1.03696, 0.0),
    ],
)
def test_worked_example(level, mode, coef, loss, filter_ratio):
    out, logp = _run(level, mode, DELTA)
    torch.testing.assert_close(out.is_coef, torch.tensor([coef]), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.token_loss.detach(), -torch.tensor([coef]), atol=1e-5, rtol=0)
    assert out.loss.item() == pytest.approx(loss, abs=1e-5)
    assert out.metrics["is_filter_ratio"].item() == pytest.approx(filter_ratio)
    assert out.metrics["vllm_kl"].item() == pytest.approx(-sum(DELTA) / 3, abs=1e-6)  # -0.00667
    out.loss.backward()  # coefficient is detached: the gradient is coef * (-A) / N per token
    torch.testing.assert_close(logp.grad, -torch.tensor([coef]) / 3, atol=1e-5, rtol=0)


def test_seq_rejects_what_geo_keeps():
    """delta = [0.1] * 3: seq u = e^0.3 = 1.3499 > 1.25 -> the whole sequence is zeroed (filter 1);
    geo u = e^0.1 = 1.1052 -> kept, c = 1.10517 on each token."""
    out, _ = _run("seq", "mask", [0.1, 0.1, 0.1])
    assert out.loss.item() == 0.0 and out.metrics["is_filter_ratio"].item() == 1.0
    out, _ = _run("geo", "mask", [0.1, 0.1, 0.1])
    assert out.loss.item() == pytest.approx(-1.10517, abs=1e-5)
    assert out.metrics["is_filter_ratio"].item() == 0.0


def test_pinned_cases():
    ln3, ln10 = math.log(3), math.log(10)
    # geo/mask band [0.5, 2], delta [ln3, -ln3]: geo u = 1 kept with raw token weights [3, 1/3]
    out, _ = _run("geo", "mask", [ln3, -ln3], band=(0.5, 2.0))
    assert out.loss.item() == pytest.approx(-(3 + 1 / 3) / 2, abs=1e-5)
    # token/trunc band [0.5, 2], delta [-ln10, ln10]: c = [0.1, 2] (no lower cap)
    out, _ = _run("token", "trunc", [-ln10, ln10], band=(0.5, 2.0))
    torch.testing.assert_close(out.is_coef, torch.tensor([[0.1, 2.0]]))
    assert out.loss.item() == pytest.approx(-1.05, abs=1e-5)
    # token/clip band [0.5, 2], delta [ln3, -ln3]: c = [2, 0.5], both tokens filtered
    out, _ = _run("token", "clip", [ln3, -ln3], band=(0.5, 2.0))
    torch.testing.assert_close(out.is_coef, torch.tensor([[2.0, 0.5]]))
    assert out.metrics["is_filter_ratio"].item() == 1.0


def test_filtered_tokens_stay_in_the_denominator_and_seq_ratio_is_per_sequence():
    """Two sequences (second with a padded step); seq/mask rejects only the first; filter ratio counts
    sequences; N_window = 5 includes the rejected sequence's tokens."""
    delta = [[0.3, 0.3, 0.3], [0.05, -0.02, 9.0]]
    out, _ = _run("seq", "mask", delta, mask=[[1, 1, 1], [1, 1, 0]])
    w = [math.exp(0.05), math.exp(-0.02)]
    torch.testing.assert_close(out.is_coef, torch.tensor([[0.0, 0.0, 0.0], [w[0], w[1], 0.0]]))
    assert out.loss.item() == pytest.approx(-(w[0] + w[1]) / 5, abs=1e-6)
    assert out.metrics["is_filter_ratio"].item() == 0.5


@pytest.mark.parametrize(("level", "mode"), list(itertools.product(IS_LEVELS, IS_MODES)))
def test_every_level_mode_combination(level, mode):
    if level in ("seq", "geo") and mode != "mask":
        with pytest.raises(ValueError, match="--algo.advantage.is_correction_level .* supports only"):
            PolicyLoss("ppo", is_level=level, is_mode=mode)
        with pytest.raises(ValueError, match="--algo.advantage.is_correction_mode mask"):
            check_is_correction(level, mode, (0.5, 5.0))
        return
    out, _ = _run(level, mode, DELTA)
    if level == "off":  # threshold ignored, no mismatch metrics, plain PPO loss
        assert out.is_coef is None and "vllm_kl" not in out.metrics and "is_filter_ratio" not in out.metrics
        assert out.loss.item() == pytest.approx(-1.0)
    else:
        assert out.is_coef.shape == (1, 3) and torch.isfinite(out.loss)


def test_off_ignores_rollout_logprobs_and_on_requires_them():
    logp = torch.zeros(1, 2, requires_grad=True)
    off = PolicyLoss("ppo")
    garbage = torch.full((1, 2), float("nan"))
    assert off(
        logp, logp.detach(), torch.ones(1, 2), torch.ones(1, 2), num_window_tokens=2, rollout_logp=garbage
    ).loss.item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="no rollout log-probs"):
        PolicyLoss("ppo", is_level="token")(
            logp, logp.detach(), torch.ones(1, 2), torch.ones(1, 2), num_window_tokens=2
        )


def test_unknown_level_mode_and_bad_threshold():
    with pytest.raises(ValueError, match="is_correction_level 'tok' is unknown"):
        PolicyLoss("ppo", is_level="tok")
    with pytest.raises(ValueError, match="is_correction_mode 'cap' is unknown"):
        PolicyLoss("ppo", is_level="token", is_mode="cap")
    with pytest.raises(ValueError, match="--algo.advantage.is_correction_threshold needs 0 <= LOW <= HIGH"):
        PolicyLoss("ppo", is_level="token", is_threshold=(2.0, 1.0))


def test_is_applies_under_force_on_policy_and_extremes_stay_finite():
    """old = current detached; rollout log-prob -inf on one token (delta -> +30) is masked out by
    token/mask, a NaN on another sanitises to delta 0 (w = 1)."""
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[float("-inf"), float("nan"), -1.2]])
    loss = PolicyLoss("ppo", is_level="token", is_mode="mask", is_threshold=(0.5, 2.0))
    out = loss(logp, None, torch.ones(1, 3), torch.ones(1, 3), num_window_tokens=3, rollout_logp=rollout)
    torch.testing.assert_close(out.is_coef, torch.tensor([[0.0, 1.0, math.exp(0.2)]]))
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert out.metrics["is_filter_ratio"].item() == pytest.approx(1 / 3)
