"""Group assembly from the stream (dedupe by trajectory id), dispatch gating, staleness."""

from __future__ import annotations

import numpy as np

from molt.bus import Delivery
from molt.schema import Segment, Trajectory
from services.trainer.config import TrainConfig, max_versions_ahead
from services.trainer.groups import DispatchGate, GroupAssembler, staleness


def _d(tid: str, group: str, entry: str | None = None) -> Delivery:
    seg = Segment([1, 2, 3], [[1, 3]], [-1.0, -1.0], [0, 0])
    return Delivery(entry or f"{tid}-e", Trajectory(tid, group, 0, [seg], 1.0))


def test_groups_complete_at_n_in_completion_order():
    a = GroupAssembler(2)
    a.add(_d("a1", "A"))
    a.add(_d("b1", "B"))
    assert a.num_complete == 0 and a.num_partial == 2
    a.add(_d("b2", "B"))
    a.add(_d("a2", "A"))
    groups = a.pop_complete(5)
    assert [g.group_id for g in groups] == ["B", "A"]
    assert groups[0].trajectory_ids == ["b1", "b2"]
    assert a.held_ids() == set()


def test_duplicate_trajectory_ids_are_kept_for_ack_but_not_trained():
    a = GroupAssembler(2)
    assert a.add(_d("a1", "A", "1-0"))
    assert not a.add(_d("a1", "A", "2-0"))  # producer retry: same id, new entry
    assert a.num_complete == 0
    a.add(_d("a2", "A", "3-0"))
    (g,) = a.pop_complete(1)
    assert g.trajectory_ids == ["a1", "a2"]
    assert [d.entry_id for d in g.all_deliveries()] == ["1-0", "3-0", "2-0"]


def test_expect_completes_groups_with_failed_episodes():
    a = GroupAssembler(4)
    a.add(_d("a1", "A"))
    a.expect("A", 1)
    assert [g.group_id for g in a.pop_complete(1)] == ["A"]
    a.expect("B", 2)  # the count may arrive before the trajectories
    a.add(_d("b1", "B"))
    assert a.num_complete == 0
    a.add(_d("b2", "B"))
    assert a.num_complete == 1
    a.expect("C", 0)
    assert a.num_partial == 0


def test_pop_respects_max_groups():
    a = GroupAssembler(1)
    for i in range(3):
        a.add(_d(f"t{i}", f"G{i}"))
    assert len(a.pop_complete(2)) == 2 and a.num_complete == 1


def test_dispatch_gate_async_queue_size():
    # --train.async_queue_size 1 (Molt's default): batch k+1 may be generated while step k trains
    gate = DispatchGate(groups_per_step=2, max_ahead=max_versions_ahead(TrainConfig()))
    gate.dispatched = 4
    assert not gate.may_dispatch(trainer_version=0)  # batches 0 and 1 out, trainer at 0
    assert gate.may_dispatch(trainer_version=1)
    gate.refills = 1  # a filtered group is refilled without counting
    assert gate.may_dispatch(trainer_version=0)


def test_dispatch_gate_force_sync_is_strictly_on_policy():
    gate = DispatchGate(groups_per_step=2, max_ahead=max_versions_ahead(TrainConfig(force_sync_mode=True)))
    gate.dispatched = 2
    assert not gate.may_dispatch(0)
    assert gate.may_dispatch(1)
    gate2 = DispatchGate(2, max_versions_ahead(TrainConfig(async_queue_size=3)))
    gate2.dispatched = 7
    assert gate2.may_dispatch(0) and gate2.allowed(0) == 8


def test_staleness_skips_non_action_tokens():
    assert staleness(5, np.array([-1, 5, 4, 2, -1])) == [0, 1, 3]


def test_staleness_histogram_bulk_observe_equals_observe():
    from prometheus_client import CollectorRegistry, Histogram

    from services.trainer.metrics import observe_many

    a = Histogram("a", "a", registry=CollectorRegistry(), buckets=(0, 1, 2, 4))
    b = Histogram("b", "b", registry=CollectorRegistry(), buckets=(0, 1, 2, 4))
    for value, count in ((0, 5), (1, 3), (3, 2), (9, 1), (-1, 2)):
        observe_many(a, value, count)
        for _ in range(count):
            b.observe(value)

    def samples(h):
        return [(s.name[1:], s.labels, s.value) for s in h.collect()[0].samples if "created" not in s.name]

    assert samples(a) == samples(b)


def test_dispatched_groups_release_in_dispatch_order():
    """A straggler holds back younger groups, so no group is trained versions after it was dispatched."""
    import numpy as np

    from molt.bus import Delivery
    from molt.schema import Segment, Trajectory
    from services.trainer.groups import GroupAssembler

    def deliver(group: str, i: int) -> Delivery:
        seg = Segment(
            token_ids=np.arange(4), action_spans=np.array([[2, 4]]), logprobs=np.full(2, -1.0), versions=np.zeros(2)
        )
        return Delivery(f"{group}-{i}", Trajectory(f"{group}-t{i}", group, i, [seg], 1.0))

    asm = GroupAssembler(n_samples_per_prompt=2)
    for g in ("g0", "g1", "g2"):
        asm.dispatched(g)
    for d in (
        deliver("g1", 0),
        deliver("g1", 1),
        deliver("g2", 0),
        deliver("g2", 1),
        deliver("x", 0),
        deliver("x", 1),
    ):
        asm.add(d)
    # g1 and g2 are complete but g0 (older) is not: only the unregistered group "x" may go.
    assert [g.group_id for g in asm.pop_complete(8)] == ["x"]
    asm.add(deliver("g0", 0))
    asm.add(deliver("g0", 1))
    assert [g.group_id for g in asm.pop_complete(2)] == ["g0", "g1"]
    asm.dispatched("g3")
    asm.expect("g3", 0)  # every episode of g3 failed: it must not block what follows
    asm.dispatched("g4")
    asm.add(deliver("g4", 0))
    asm.add(deliver("g4", 1))
    assert [g.group_id for g in asm.pop_complete(8)] == ["g2", "g4"]
    assert asm.num_complete == 0 and asm.held_ids() == set()
