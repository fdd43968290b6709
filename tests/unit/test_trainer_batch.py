"""Batch assembly from segments: step-axis alignment, masks, logprob shift, padding, partitions."""

from __future__ import annotations

import numpy as np
import torch

from molt.schema import Provenance, Segment, Trajectory
from services.trainer.batch import collate, micro_batches, partition, plan_windows, pod_of, samples_from_trajectory


def _traj(**kw) -> Trajectory:
    # tokens 10..17; actions at [2, 4) and [6, 8): 4 action tokens
    seg = Segment(np.arange(10, 18), [[2, 4], [6, 8]], [-0.1, -0.2, -0.3, -0.4], [3, 3, 4, 5])
    return Trajectory("t1", "g1", 0, [seg], reward=1.0, **kw)


def test_step_axis_alignment_and_logprob_shift():
    (s,) = samples_from_trajectory(_traj(), max_len=100)
    assert s.tokens.tolist() == list(range(10, 18))
    # step k predicts token k+1: tokens 2,3,6,7 are actions -> steps 1,2,5,6
    assert s.action_mask.tolist() == [False, True, True, False, False, True, True]
    assert torch.allclose(s.rollout_logp, torch.tensor([0, -0.1, -0.2, 0, 0, -0.3, -0.4]))
    assert s.versions.tolist() == [-1, 3, 3, -1, -1, 4, 5]
    assert s.num_actions == 4


def test_truncation_to_max_len_cuts_mask_and_logprobs():
    (s,) = samples_from_trajectory(_traj(), max_len=7)
    assert s.num_tokens == 7
    assert s.action_mask.tolist() == [False, True, True, False, False, True]
    assert s.rollout_logp.tolist()[-1] == np.float32(-0.3)


def test_action_at_position_zero_cannot_be_trained():
    seg = Segment([5, 6, 7], [[0, 2]], [-1.0, -2.0], [0, 0])
    (s,) = samples_from_trajectory(Trajectory("t", "g", 0, [seg], 0.0), 100)
    assert s.action_mask.tolist() == [True, False]  # only token 1 (predicted at step 0)
    assert s.rollout_logp.tolist() == [-2.0, 0.0]


def test_multi_segment_trajectory_gives_one_sample_per_segment():
    a = Segment([1, 2, 3], [[1, 3]], [-1.0, -1.0], [0, 0])
    b = Segment([1, 2, 3, 4, 5], [[3, 5]], [-1.0, -1.0], [1, 1], routed_experts=np.zeros((5, 2, 2)))
    samples = samples_from_trajectory(Trajectory("t", "g", 0, [a, b], 0.5), 100)
    assert [x.segment for x in samples] == [0, 1]
    assert all(x.trajectory_id == "t" and x.reward == 0.5 for x in samples)
    mb = collate(samples)
    assert mb.input_ids.shape == (2, 5) and mb.action_mask.shape == (2, 4)
    assert mb.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert mb.routed_experts.shape == (2, 5, 2, 2)
    assert (mb.routed_experts[0] == -1).all() and (mb.routed_experts[1] == 0).all()
    assert mb.action_mask[0].tolist() == [True, True, False, False]


def test_pod_comes_from_events_else_unknown():
    assert pod_of(_traj()) == "unknown"
    t = _traj(events=[{"kind": "pod_switch", "from": "http://a", "to": "http://b"}])
    assert pod_of(t) == "http://b"
    t = _traj(provenance=Provenance(sampling_params={"pod": "http://c"}))
    assert pod_of(t) == "http://c"


def test_partition_balances_counts_and_is_deterministic():
    lengths = [10, 50, 20, 40, 30]
    parts = partition(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(5))
    assert sorted(len(p) for p in parts) == [2, 3]
    assert parts == partition(lengths, 2)
    assert partition(lengths, 1) == [[1, 3, 4, 2, 0]]


def test_windows_and_micro_batches():
    w = plan_windows(10, 4, one_window=False, seed=0)
    assert [len(x) for x in w] == [4, 4, 2] and sorted(sum(w, [])) == list(range(10))
    assert plan_windows(10, 4, one_window=True, seed=0)[0] == sum(w, [])
    assert micro_batches([1, 2, 3], 2, 3) == [[1, 2], [3], []]
