"""``--actor.score_centering`` (molt/algorithms/score_centering.py): the sampler-head correction against its closed
forms, differentiated with respect to the LOGITS of one step, and through ``PolicyLoss`` (refusals, aggregation).

Closed forms (y sampled, q the sampler, p = softmax(z), A the advantage): with the whole vocabulary as head the
gradient is -A (onehot(y) - q); with a top-k head H it is -A (onehot(y) - q_hat), q_hat = q on H and rho p off H,
rho = (1 - q(H)) / (1 - p(H)); with q == p on H it is plain REINFORCE; with the full head E_{y~q}[grad] = 0 for
every IS weight f."""

from __future__ import annotations

import math

import pytest
import torch

from molt.algorithms import ActorLossConfig, AlgoConfig, PolicyLoss, SamplerHead, validate_algo
from molt.algorithms.is_correction import is_correction
from molt.algorithms.score_centering import head_correction, ratio_weight

V = 8
THRESHOLD = (0.8, 1.25)  # narrow, so that some head ratios fall outside it under random p and q
MODES = (None, "mask", "clip", "trunc")


def _dist(seed: int, neg_inf: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    logits[list(neg_inf)] = -math.inf
    return torch.log_softmax(logits, -1)


def _step_grad(
    z: torch.Tensor,
    y: int,
    adv: float,
    head_ids: list[int],
    log_q: torch.Tensor,
    *,
    mode: str | None = None,
    threshold=THRESHOLD,
    log_p_old: torch.Tensor | None = None,
    pad: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss_t / d logits of one step (and the correction's value), with loss_t = -A f(p_y/q_y) log p_y + A corr.
    ``log_p_old``: the policy the IS weights compare with the sampler (None: the current one, detached)."""
    z = z.detach().clone().requires_grad_(True)
    logp_all = torch.log_softmax(z, -1)
    weights_from = logp_all.detach() if log_p_old is None else log_p_old
    f_y = ratio_weight((weights_from[y] - log_q[y]).exp(), mode, threshold)
    ids = torch.tensor(head_ids + [0] * pad)
    mask = torch.tensor([True] * len(head_ids) + [False] * pad)
    sampler = torch.where(mask, log_q[ids], torch.full((len(ids),), -math.inf, dtype=log_q.dtype))
    head = SamplerHead(
        logp_all[ids].view(1, 1, -1),
        sampler.view(1, 1, -1),
        mask.view(1, 1, -1),
        None if log_p_old is None else log_p_old[ids].view(1, 1, -1),
    )
    out = head_correction(head, torch.ones(1, 1, dtype=torch.bool), is_mode=mode, threshold=threshold)
    loss = -adv * f_y * logp_all[y] + adv * out.correction.sum()
    loss.backward()
    assert z.grad is not None
    return z.grad, out.correction.detach().sum()


def _onehot(y: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(y), V).double()


@pytest.mark.parametrize("ruled_out", [(), (5,)])
@pytest.mark.parametrize("y", [0, 3, 7])
def test_full_head_gradient_is_the_sampler_centred_score(y, ruled_out):
    # A token the sampler rules out (logprob -inf) stays in the head with q = 0.
    z, log_q = _dist(1), _dist(2, ruled_out)
    grad, _ = _step_grad(z, y, 0.7, list(range(V)), log_q)
    torch.testing.assert_close(grad, -0.7 * (_onehot(y) - log_q.exp()))


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("y", [1, 6])  # inside the head, outside it
def test_top_k_head_gradient_centres_on_q_on_the_head_and_rho_p_off_it(y, pad):
    z, log_q = _dist(3), _dist(4)
    head = [1, 4, 2]
    p, q = torch.softmax(z, -1), log_q.exp()
    in_head = torch.zeros(V, dtype=torch.bool)
    in_head[head] = True
    rho = (1 - q[in_head].sum()) / (1 - p[in_head].sum())
    q_hat = torch.where(in_head, q, rho * p)
    torch.testing.assert_close(q_hat.sum(), torch.tensor(1.0, dtype=torch.float64))
    # padded head entries (id 0, masked) change nothing
    grad, _ = _step_grad(z, y, -1.3, head, log_q, pad=pad)
    torch.testing.assert_close(grad, 1.3 * (_onehot(y) - q_hat))


@pytest.mark.parametrize("mode", MODES)
def test_a_sampler_matching_the_policy_on_the_head_gives_plain_reinforce(mode):
    z = _dist(5)
    p = torch.softmax(z, -1)
    head = [0, 2, 5]
    # q equals p on the head and puts its other mass elsewhere than p does
    q = p.clone()
    rest = torch.tensor([i not in head for i in range(V)])
    q[rest] = torch.linspace(1.0, 3.0, int(rest.sum()), dtype=torch.float64)
    q[rest] *= (1 - p[head].sum()) / q[rest].sum()
    for y in (2, 4):
        grad, corr = _step_grad(z, y, 0.9, head, q.log(), mode=mode)
        f_y = ratio_weight(p[y] / q[y], mode, THRESHOLD)
        assert abs(float(corr)) < 1e-12
        torch.testing.assert_close(grad, -0.9 * f_y * (_onehot(y) - p))


@pytest.mark.parametrize("old_policy", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_the_full_head_gradient_has_zero_mean_under_the_sampler_for_every_is_weight(mode, old_policy):
    # The IS weights of the sampled token and of the head compare the same policy with the sampler: the current
    # one, or pi_old when the trainer has one (the experience pass records its head log-probs).
    z, log_q = _dist(6), _dist(7)
    log_p_old = _dist(8) if old_policy else None
    mean = sum(
        log_q[y].exp() * _step_grad(z, y, 1.0, list(range(V)), log_q, mode=mode, log_p_old=log_p_old)[0]
        for y in range(V)
    )
    torch.testing.assert_close(mean, torch.zeros(V, dtype=torch.float64), atol=1e-12, rtol=0)
    # ... and without the correction it does not (the check has teeth)
    if mode is None and not old_policy:
        p = torch.softmax(z, -1)
        plain = sum(log_q[y].exp() * -(_onehot(y) - p) for y in range(V))
        assert float(plain.abs().max()) > 1e-2


def test_under_trunc_is_the_head_takes_the_sampled_tokens_cap():
    z, log_q = _dist(9), _dist(10)
    high = 1.1
    head = list(range(5))
    log_p = torch.log_softmax(z, -1)
    ratios = (log_p - log_q).exp()
    assert (ratios[head] > high).any() and (ratios[head] < high).any()
    # the same f as IS correction's token-level trunc coefficient
    coef = is_correction(
        log_p.view(1, -1),
        log_q.view(1, -1),
        torch.ones(1, V, dtype=torch.bool),
        level="token",
        mode="trunc",
        threshold=(0.0, high),
    ).coef
    torch.testing.assert_close(ratio_weight(ratios, "trunc", (0.0, high)).view(1, -1), coef)
    _, corr = _step_grad(z, 0, 1.0, head, log_q, mode="trunc", threshold=(0.0, high))
    p, q = log_p.exp(), log_q.exp()
    rho = (1 - q[head].sum()) / (1 - p[head].sum())
    alpha = rho * min(1 / rho, high)
    want = sum((min(p[v] / q[v], high) * q[v] - alpha * p[v]) * log_p[v] for v in head)
    torch.testing.assert_close(corr, want)


# ---- through PolicyLoss


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_mode": "ppo"}, "--actor.score_centering .*--actor.loss_mode reinforce"),
        ({"loss_mode": "cispo", "eps_clip": (0.2, 5.0)}, "--actor.loss_mode reinforce"),
        ({"is_level": "seq"}, "--algo.advantage.is_correction_level off or token"),
        ({"is_level": "geo"}, "--algo.advantage.is_correction_level off or token"),
        (
            {"is_level": "token", "is_gating": "binary_kl", "is_threshold": (0.0, 5e-3)},
            "--algo.advantage.is_correction_gating ratio",
        ),
    ],
)
def test_policy_loss_refuses_what_score_centering_cannot_combine_with(kwargs, match):
    kwargs = {"loss_mode": "reinforce", **kwargs}
    with pytest.raises(ValueError, match=match):
        PolicyLoss(score_centering=True, **kwargs)
    PolicyLoss(**kwargs)  # fine without it


def test_validate_algo_refuses_the_same_at_start_up():
    algo = AlgoConfig()
    algo.advantage.is_correction_level = "seq"
    with pytest.raises(ValueError, match="--actor.score_centering"):
        validate_algo(algo, ActorLossConfig(loss_mode="reinforce", score_centering=True), 1)
    with pytest.raises(ValueError, match="--actor.loss_mode reinforce"):
        validate_algo(AlgoConfig(), ActorLossConfig(score_centering=True), 1)
    for mode in ("mask", "clip", "trunc"):
        algo = AlgoConfig()
        algo.advantage.is_correction_level, algo.advantage.is_correction_mode = "token", mode
        validate_algo(algo, ActorLossConfig(loss_mode="reinforce", score_centering=True), 1)


B, T, K = 2, 4, 3


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    head_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * T)]).view(B, T, K)
    head_mask = torch.ones(B, T, K, dtype=torch.bool)
    head_mask[1, :, 2] = False  # the second row's K is 2: padding
    head_ids[1, :, 2] = 0
    sampler_all = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    old_all = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64) * 0.3, -1)
    mask = torch.tensor([[False, True, True, True], [True, True, False, False]])
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    return logits, tokens, head_ids, head_mask, sampler_all, old_all, mask, adv


def _reference_token_loss(logits, tokens, head_ids, head_mask, sampler_all, old_all, mask, adv, high):
    """The per-token loss written out token by token (trunc IS against pi_old, as the trainer weighs it)."""
    rows = []
    for b in range(B):
        row = []
        for t in range(T):
            if not mask[b, t]:
                row.append(torch.zeros((), dtype=torch.float64))
                continue
            lp = torch.log_softmax(logits[b, t], -1)
            p, q, p_old = lp.detach().exp(), sampler_all[b, t].exp(), old_all[b, t].exp()
            y = int(tokens[b, t])
            term = -adv[b, t] * min(float(p_old[y] / q[y]), high) * lp[y]
            head = [int(v) for v, m in zip(head_ids[b, t], head_mask[b, t], strict=True) if m]
            rho = (1 - sum(q[v] for v in head)) / (1 - sum(p[v] for v in head))
            alpha = rho * min(float(1 / rho), high)
            corr = sum((q[v] * min(float(p_old[v] / q[v]), high) - alpha * p[v]) * lp[v] for v in head)
            row.append(term + adv[b, t] * corr)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def _policy_loss_out(loss: PolicyLoss, batch, **kw):
    logits, tokens, head_ids, head_mask, sampler_all, old_all, mask, adv = batch
    logp_all = torch.log_softmax(logits, -1)
    pick = lambda x: x.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # noqa: E731
    head = SamplerHead(
        logp_all.gather(-1, head_ids),
        torch.where(head_mask, sampler_all.gather(-1, head_ids), -math.inf),
        head_mask,
        old_all.gather(-1, head_ids),
    )
    return loss(pick(logp_all), pick(old_all), adv, mask, rollout_logp=pick(sampler_all), head=head, **kw)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_is_the_aggregated_per_token_surrogate_with_the_correction(agg):
    high = 1.3
    batch = _batch()
    logits, mask = batch[0], batch[6]
    loss = PolicyLoss("reinforce", is_level="token", is_mode="trunc", is_threshold=(0.0, high), score_centering=True)
    want_tok = _reference_token_loss(*batch, high)
    n = int(mask.sum())
    if agg == "token-mean":
        out = _policy_loss_out(loss, batch, num_window_tokens=n)
        want = want_tok.sum() / n
    else:
        scale = 1.0 / (mask.sum(1).double() * B)
        out = _policy_loss_out(loss, batch, num_window_tokens=n, row_scale=scale)
        want = (want_tok.sum(1) * scale).sum()
    torch.testing.assert_close(out.token_loss.detach(), want_tok.detach())
    torch.testing.assert_close(out.loss.detach(), want.detach())
    (got_grad,) = torch.autograd.grad(out.loss, logits)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got_grad, want_grad)
    assert set(out.metrics) >= {"score_centering_sampler_head_mass", "score_centering_policy_head_mass"}
    sampler_mass = torch.where(batch[3], batch[4].gather(-1, batch[2]).exp(), 0.0).sum(-1)
    torch.testing.assert_close(out.metrics["score_centering_sampler_head_mass"], sampler_mass[mask].mean())


def test_policy_loss_needs_the_head_and_pi_olds_head_under_is_correction():
    batch = _batch()
    logits, tokens, _, _, sampler_all, old_all, mask, adv = batch
    logp = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    loss = PolicyLoss("reinforce", score_centering=True)
    with pytest.raises(ValueError, match="--rollout.top_logprobs"):
        loss(logp, None, adv, mask, num_window_tokens=5)
    on = PolicyLoss("reinforce", is_level="token", is_mode="trunc", score_centering=True)
    no_old = _policy_loss_out(on, batch, num_window_tokens=5).token_loss  # builds a head with old_logp set
    assert no_old.shape == (B, T)
    head_ids, head_mask = batch[2], batch[3]
    head = SamplerHead(torch.log_softmax(logits, -1).gather(-1, head_ids), sampler_all.gather(-1, head_ids), head_mask)
    with pytest.raises(ValueError, match="old_logp"):
        on(logp, logp.detach() + 0.1, adv, mask, num_window_tokens=5, rollout_logp=logp.detach(), head=head)
    # force-on-policy (old_logp None): the head's weights come from this forward too, no pi_old head needed
    on(logp, None, adv, mask, num_window_tokens=5, rollout_logp=logp.detach(), head=head)
