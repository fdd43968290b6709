"""KL estimators and the KL controller, with hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from molt.algorithms import KLController, approx_kl


def _kl(log_ratio: float, estimator: str) -> float:
    return approx_kl(torch.tensor([log_ratio]), torch.tensor([0.0]), estimator).item()


def test_estimators_at_log_ratio_half():
    assert _kl(0.5, "k1") == pytest.approx(0.5)
    assert _kl(0.5, "k2") == pytest.approx(0.125)
    assert _kl(0.5, "k3") == pytest.approx(math.exp(-0.5) - 1 + 0.5, abs=1e-6)  # 0.10653
    assert _kl(0.5, "k3") == pytest.approx(0.10653, abs=1e-5)


def test_k1_is_signed_and_unclamped_k2_k3_are_clamped():
    assert _kl(-0.5, "k1") == pytest.approx(-0.5)
    assert _kl(20.0, "k1") == pytest.approx(20.0)
    assert _kl(5.0, "k2") == 10.0  # 12.5 clamped
    assert _kl(-5.0, "k3") == 10.0  # e^5 - 6 = 142.4 clamped
    assert _kl(0.0, "k3") == 0.0


def test_sanitisation_of_nan_and_inf():
    logp = torch.tensor([float("-inf"), float("-inf"), 0.0, float("nan")])
    base = torch.tensor([float("-inf"), 0.0, float("-inf"), 0.0])
    # -inf - -inf = NaN -> 0; -inf -> -30; +inf -> +30; NaN -> 0
    torch.testing.assert_close(approx_kl(logp, base, "k1"), torch.tensor([0.0, -30.0, 30.0, 0.0]))
    torch.testing.assert_close(approx_kl(logp, base, "k2"), torch.tensor([0.0, 10.0, 10.0, 0.0]))
    torch.testing.assert_close(approx_kl(logp, base, "k3"), torch.tensor([0.0, 10.0, 10.0, 0.0]))


def test_k3_gradient_and_half_precision():
    logp = torch.tensor([0.5], requires_grad=True)
    approx_kl(logp, torch.tensor([0.0]), "k3").sum().backward()
    assert logp.grad.item() == pytest.approx(1 - math.exp(-0.5), abs=1e-6)  # d/dl (e^-l - 1 + l)
    out = approx_kl(torch.tensor([0.5], dtype=torch.bfloat16), torch.tensor([0.0], dtype=torch.bfloat16), "k2")
    assert out.dtype == torch.float32


def test_unknown_estimator():
    with pytest.raises(ValueError, match="choose one of k1, k2, k3"):
        _kl(0.1, "k4")


@pytest.mark.parametrize(
    ("kl", "num_samples", "expected"),
    [
        (0.011, 100, 0.11),  # error 0.1 * 100/100 -> x1.1
        (0.0, 100, 0.08),  # error -1 clipped to -0.2
        (1.0, 100, 0.12),  # error 99 clipped to +0.2
        (0.02, 10, 0.102),  # error 1 -> 0.2 * 10/100 -> x1.02
        (0.01, 100, 0.1),  # on target: unchanged
    ],
)
def test_adaptive_controller(kl, num_samples, expected):
    ctl = KLController(0.1, target=0.01, horizon=100)
    assert ctl.adaptive
    assert ctl.update(kl, num_samples) == pytest.approx(expected)
    assert ctl.value == pytest.approx(expected)


def test_fixed_controller_ignores_feedback_and_state_round_trips():
    ctl = KLController(0.01)
    assert not ctl.adaptive
    assert ctl.update(5.0, 1000) == 0.01
    adaptive = KLController(0.1, target=0.01, horizon=100)
    adaptive.update(1.0, 100)
    restored = KLController(0.1, target=0.01, horizon=100)
    restored.load_state_dict(adaptive.state_dict())
    assert restored.value == pytest.approx(0.12)


def test_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="--algo.kl.target must be > 0"):
        KLController(0.1, target=0.0)
    with pytest.raises(ValueError, match="--algo.kl.horizon"):
        KLController(0.1, target=0.1, horizon=0)
    with pytest.raises(ValueError, match="--algo.kl.init_coef"):
        KLController(-1.0)
