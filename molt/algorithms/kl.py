"""Per-token KL estimators and the KL coefficient controller.

``approx_kl(logp, logp_base, estimator)`` estimates KL(pi || pi_base) per token from log-probs of the
sampled tokens. With l = log pi - log pi_base (NaN -> 0, +-inf -> +-30):

- ``k1`` = l, signed and *not* clamped: the dense reward of on-policy distillation and the natural
  choice for KL-as-reward (``--algo.kl.use_loss`` off, fed to ``reinforce`` / ``gae``);
- ``k2`` = l^2 / 2 and ``k3`` = exp(-l) - 1 + l (Schulman's unbiased, non-negative estimator), both
  clamped to [-10, 10]: the recommended choices for KL in the loss (``--algo.kl.use_loss``).

``KLController`` holds beta. Fixed by default (and with ``--algo.kl.target 0``); adaptive when the target is
above 0, using the proportional rule of Ziegler et al.:
``beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)`` after every train step, with
n = rollouts in the step (``rollout.batch_size * n_samples_per_prompt``; a multi-segment rollout counts
once) and kl the step's ``kl`` metric. The beta used for a step is what the trainer logs as ``kl_coef``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from molt.algorithms.tensor_ops import at_least_fp32, sanitize_log_ratio

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
KL_CLAMP = 10.0
"""k2 / k3 are clamped to [-KL_CLAMP, KL_CLAMP]; k1 is not."""
ADAPTIVE_ERROR_CLIP = 0.2


def approx_kl(logp: Tensor, logp_base: Tensor, estimator: KLEstimator = "k1") -> Tensor:
    """Per-token KL estimate, same shape as the inputs. Differentiable through ``logp``."""
    log_ratio = sanitize_log_ratio(at_least_fp32(logp - logp_base))
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return (log_ratio.square() / 2).clamp(-KL_CLAMP, KL_CLAMP)
    if estimator == "k3":
        return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(
        f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)} (--algo.kl.estimator)"
    )


class KLController:
    """beta for the KL term. ``target=None``: fixed. Otherwise adaptive (see the module docstring)."""

    def __init__(self, init_coef: float, *, target: float | None = None, horizon: int = 10_000) -> None:
        if init_coef < 0:
            raise ValueError(f"--algo.kl.init_coef must be >= 0, got {init_coef}")
        if target is not None and target <= 0:
            raise ValueError(f"--algo.kl.target must be > 0 (or unset for a fixed coefficient), got {target}")
        if horizon <= 0:
            raise ValueError(f"--algo.kl.horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target = target
        self.horizon = horizon

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, kl: float, num_samples: int) -> float:
        """Apply one step's feedback (``kl``: the step's mean KL; ``num_samples``: samples in the step).

        Returns the new beta. A fixed controller ignores the feedback.
        """
        if self.target is not None:
            error = min(max(kl / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
            self.value *= 1.0 + error * num_samples / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """Checkpointable state: only beta changes over a run."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])

    def __repr__(self) -> str:
        mode = f"adaptive(target={self.target}, horizon={self.horizon})" if self.adaptive else "fixed"
        return f"KLController(value={self.value}, {mode})"


__all__ = ["KLController", "KLEstimator", "KL_ESTIMATORS", "approx_kl"]
