"""``--actor.score_centering`` in the trainer: the sampler's top-k rows land on the steps that predict their tokens,
a real learner step on the tiny Qwen3 reads them (pi_old's head from the experience pass under IS correction), a
sampler that matches the policy on its head trains exactly as plain REINFORCE, and a trajectory without top-k is
logged, counted ``invalid`` and acked untrained (as images for a text-only policy are)."""

from __future__ import annotations

import logging
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from molt.bus.memory import MemoryTrajectoryQueue
from molt.config import parse_settings
from molt.schema import Segment, Trajectory, decode
from services.trainer.batch import collate, padding_sample, samples_from_trajectory
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.learner import Learner
from services.trainer.model import DistInfo, full_state_dict
from services.trainer.packing import logprobs_entropy_and_head
from tests.unit.test_trainer_images_to_text_policy import _count, _trainer

CENTRED = ("--actor.loss_mode", "reinforce", "--actor.score_centering")


def _segment(tokens, spans, k: int | None, seed: int = 0) -> Segment:
    rng = np.random.default_rng(seed)
    a = sum(e - s for s, e in spans)
    seg = Segment(tokens, spans, -rng.uniform(0.5, 3, a), np.zeros(a, int))
    if k is not None:
        seg.top_ids = np.stack([rng.choice(np.arange(3, 1000), k, replace=False) for _ in range(a)])
        top = np.sort(-rng.uniform(0.05, 4, (a, k)), axis=1)[:, ::-1]
        top[:, -1] = -np.inf if k > 2 else top[:, -1]  # a token the sampling settings rule out
        seg.top_logprobs = top.copy()
        seg.__post_init__()
    return seg


# ---- batch assembly


def test_top_k_rows_go_to_the_step_that_predicts_their_token_and_a_cut_drops_the_rest():
    seg = _segment(np.arange(10, 20), [[3, 5], [7, 9]], 3)
    seg.top_ids = np.arange(12, dtype=np.int32).reshape(4, 3)  # row j = [3j, 3j+1, 3j+2]
    traj = Trajectory("t", "g", 0, [seg], 1.0)
    (x,) = samples_from_trajectory(traj, 100)
    assert x.top_ids is not None and x.top_logprobs is not None
    assert x.top_ids.shape == (9, 3) and x.top_ids.dtype == torch.long
    # action tokens 3, 4, 7, 8 are predicted at steps 2, 3, 6, 7, like their rollout logprobs
    steps = [2, 3, 6, 7]
    assert x.action_mask.nonzero().flatten().tolist() == steps
    for j, step in enumerate(steps):
        assert x.top_ids[step].tolist() == [3 * j, 3 * j + 1, 3 * j + 2]
        np.testing.assert_array_equal(x.top_logprobs[step].numpy(), seg.top_logprobs[j])
        assert x.rollout_logp[step] == pytest.approx(float(seg.logprobs[j]))
    off = [s for s in range(9) if s not in steps]
    assert (x.top_ids[off] == -1).all() and torch.isneginf(x.top_logprobs[off]).all()
    # --data.max_len 8: token 7 (row 2) is the last one predicted, at step 6; row 3 goes with token 8
    (cut,) = samples_from_trajectory(traj, 8)
    assert cut.top_ids is not None and cut.top_ids.shape == (7, 3)
    assert cut.top_ids[6].tolist() == [6, 7, 8] and sorted(cut.top_ids[cut.top_ids >= 0].tolist()) == list(range(9))


def test_collate_pads_k_to_the_batch_max_with_entries_the_head_leaves_out():
    k2 = samples_from_trajectory(Trajectory("a", "g", 0, [_segment(np.arange(3, 9), [[2, 6]], 2)], 0.0), 100)[0]
    k4 = samples_from_trajectory(Trajectory("b", "g", 1, [_segment(np.arange(3, 12), [[4, 9]], 4)], 0.0), 100)[0]
    bare = samples_from_trajectory(Trajectory("c", "g", 2, [_segment(np.arange(3, 7), [[1, 4]], None)], 0.0), 100)[0]
    assert bare.top_ids is None and not bare.has_top_k
    mb = collate([k2, k4, bare])
    assert mb.top_ids is not None and mb.top_logprobs is not None
    assert mb.top_ids.shape == (3, 8, 4) and mb.top_logprobs.shape == (3, 8, 4)
    assert torch.equal(mb.top_ids[0, :5, :2], k2.top_ids) and (mb.top_ids[0, :, 2:] == -1).all()
    assert torch.equal(mb.top_ids[1], k4.top_ids)
    assert (mb.top_ids[2] == -1).all() and torch.isneginf(mb.top_logprobs[2]).all()
    assert torch.isneginf(mb.top_logprobs[mb.top_ids < 0]).all()
    assert mb.old_head_logp is None  # no experience pass yet
    assert collate([padding_sample()]).top_ids is None


# ---- the learner


@pytest.fixture(scope="module")
def world():
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    finally:
        if owned:
            dist.destroy_process_group()


def _settings(model, *flags) -> TrainerSettings:
    s = parse_settings(
        TrainerSettings,
        [
            *("--actor.model_name_or_path", str(model), "--train.dispatch", "false", "--fsdp.strategy", "torch"),
            *("--train.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--actor.gradient_checkpoint", "off"),
            *("--algo.advantage.estimator", "grpo", "--algo.kl.init_coef", "0", "--actor.adam.lr", "1e-3"),
            *flags,
        ],
        environ={},
    )
    validate_settings(s)
    return s


def _trajs(ks=(3, 3, 4, 4)):
    """Four one-segment trajectories in groups (t0, t1), (t2, t3), rewards 0, 1, 0, 1; top-k of K = ks[i]."""
    rng = np.random.default_rng(1)
    return [
        Trajectory(f"t{i}", f"g{i // 2}", i % 2, [_segment(rng.integers(3, 1000, 9 + i), [[4, 9 + i]], k, i)], i % 2)
        for i, k in enumerate(ks)
    ]


def _samples(trajs):
    return [x for t in trajs for x in samples_from_trajectory(t, 100)]


def test_a_centred_step_with_token_trunc_is_trains_and_reports_the_head_masses(world, tiny_qwen3):
    learner = Learner(
        _settings(
            tiny_qwen3,
            *CENTRED,
            "--algo.advantage.is_correction_level",
            "token",
            "--algo.advantage.is_correction_mode",
            "trunc",
        ),
        world,
    )
    assert not learner.packing and learner.policy_loss.score_centering
    samples = _samples(_trajs())
    before = {k: v.clone() for k, v in full_state_dict(learner.actor).items()}
    stats = learner.train_step(samples)
    # pi_old's head log-probs came from the experience pass, one column per recorded id of each sample
    for x in samples:
        assert x.old_head_logp is not None and x.top_ids is not None
        assert x.old_head_logp.shape == x.top_ids.shape
        assert (x.old_head_logp[x.action_mask] < 0).all()
    for key in ("score_centering_sampler_head_mass", "score_centering_policy_head_mass", "policy_loss"):
        assert math.isfinite(stats[key]), (key, stats)
    steps = [torch.where(x.top_ids >= 0, x.top_logprobs.exp(), 0.0).sum(-1)[x.action_mask] for x in samples]
    assert stats["score_centering_sampler_head_mass"] == pytest.approx(float(torch.cat(steps).mean()), rel=1e-5)
    assert 0 < stats["score_centering_policy_head_mass"] < 1
    after = full_state_dict(learner.actor)
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-5
    # a rank's padding micro-batch (no action, an empty head) runs the same path: pi_old given, no error
    pad = padding_sample()
    learner._actor_micro(collate([pad]), [pad], (1, None), True, defaultdict(float), None, [], [])
    learner.optim.zero_grad(set_to_none=True)
    # a sample without top-k that got past the trainer's check is refused, not trained uncorrected
    bare = _samples([Trajectory("u", "g9", 0, [_segment(np.arange(3, 12), [[4, 9]], None)], 1.0)])
    with pytest.raises(ValueError, match="--rollout.top_logprobs"):
        learner.train_step(samples + bare)


def _as_own_sampler(learner: Learner, trajs: list[Trajectory], k: int) -> list[Trajectory]:
    """The trajectories re-recorded as if the policy itself had sampled them: its log-probs of the action tokens
    and its own top-k, so q == p on every head."""
    out = []
    for t in trajs:
        (seg,) = t.segments
        ids = torch.from_numpy(seg.token_ids.astype("int64")).unsqueeze(0)
        with torch.no_grad():
            logits = learner.actor(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            top = torch.log_softmax(logits[:, :-1].float(), -1).topk(k, dim=-1).indices
            logp, _, head = logprobs_entropy_and_head(logits[:, :-1], ids[:, 1:], top, 1.0)
        steps = torch.from_numpy(seg.action_mask()[1:])
        own = Segment(seg.token_ids, seg.action_spans, logp[0, steps].numpy(), seg.versions)
        own.top_ids, own.top_logprobs = top[0, steps].numpy(), head[0, steps].numpy()
        own.__post_init__()
        out.append(Trajectory(t.trajectory_id, t.group_id, t.sample_index, [own], t.reward))
    return out


def test_a_sampler_matching_the_policy_on_its_head_trains_as_plain_reinforce(world, tiny_qwen3):
    plain = Learner(_settings(tiny_qwen3, "--actor.loss_mode", "reinforce"), world)
    centred = Learner(_settings(tiny_qwen3, *CENTRED), world)
    trajs = _as_own_sampler(plain, _trajs(), k=5)
    a, b = plain.train_step(_samples(trajs)), centred.train_step(_samples(trajs))
    assert b["score_centering_sampler_head_mass"] == pytest.approx(b["score_centering_policy_head_mass"], rel=1e-4)
    assert b["policy_loss"] == pytest.approx(a["policy_loss"], rel=1e-4, abs=1e-6)
    assert b["actor_grad_norm"] == pytest.approx(a["actor_grad_norm"], rel=1e-4)


# ---- the trainer's batch planning (no model)


def test_without_top_k_a_trajectory_is_logged_counted_invalid_and_acked_untrained(caplog):
    def traj(tid, group, i, k):
        return Trajectory(tid, group, i, [_segment(np.arange(3, 9), [[2, 6]], k)], float(i))

    q = MemoryTrajectoryQueue()
    t = _trainer(q, *CENTRED, vocab_size=1024)
    try:
        t._io.run(q.put_many([traj("a0", "A", 0, None), traj("a1", "A", 1, None)]))
        t._io.run(q.put_many([traj("b0", "B", 0, 3), traj("b1", "B", 1, 3)]))
        t._io.run(t.controller.resume(None))
        with caplog.at_level(logging.ERROR, logger="molt.trainer"):
            plan = t._plan()
        assert sorted(decode(b).trajectory_id for b in plan["trajs"]) == ["b0", "b1"]
        assert _count(t, "invalid") == 2
        logged = [r.getMessage() for r in caplog.records if "score_centering" in r.getMessage()]
        assert len(logged) == 2 and all("--rollout.top_logprobs K" in m for m in logged)
        assert t._io.run(q.consumed(["a0", "a1"])) == [False, False]  # acked with the step's commit
        t._io.run(t.controller.commit())
        assert t._io.run(q.consumed(["a0", "a1", "b0", "b1"])) == [True, True, True, True]
    finally:
        t._io.stop()
