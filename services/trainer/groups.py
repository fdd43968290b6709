"""Prompt-group assembly from the stream, and the staleness bounds of dispatch.

Group baselines (grpo, rloo, ...) need every rollout of a prompt in the same batch, but the stream
delivers trajectories one by one, interleaved across prompts and possibly twice (a producer retry,
a reclaim after a crash). ``GroupAssembler`` holds deliveries per ``group_id``, de-duplicates by
trajectory id (a repeat is kept only so that it gets acked with its group) and releases a group once
it holds the expected number of distinct rollouts: ``--rollout.n_samples_per_prompt`` unless the
dispatcher reported that fewer were written (episodes that failed for good).

``DispatchGate`` bounds staleness at the source: prompt groups for batch k are dispatched only while
the trainer's policy version is at least k - ``max_ahead`` (``--train.async_queue_size``; 0 with
``--train.force_sync_mode``). Groups dropped by dynamic filtering are refilled without counting.
For that bound to hold at training time too, groups the controller dispatched are released in
dispatch order (``dispatched``): a straggler holds back younger groups instead of being overtaken and
trained versions later. Groups nobody registered (other producers) are released as they complete.

With ``by_sample`` (the trainer dispatches its own prompts) a group holds at most one rollout per
``sample_index``: after a restart the controller re-dispatches only the samples a group misses, and an
episode of the dead trainer that still finishes writes a second rollout of a sample that is kept as a
duplicate (acked, never trained). Such groups are released only once registered, so a group adopted
from the stream before its position is dispatched again waits for its turn.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from molt.bus import Delivery
from molt.schema import Trajectory


@dataclass
class Group:
    group_id: str
    deliveries: list[Delivery] = field(default_factory=list)
    """One per distinct trajectory id, in arrival order."""
    duplicates: list[Delivery] = field(default_factory=list)
    """Repeated trajectory ids: never trained, acked together with the group."""

    @property
    def trajectories(self) -> list[Trajectory]:
        return [d.trajectory for d in self.deliveries]

    @property
    def trajectory_ids(self) -> list[str]:
        return [d.trajectory.trajectory_id for d in self.deliveries]

    def all_deliveries(self) -> list[Delivery]:
        return self.deliveries + self.duplicates


class GroupAssembler:
    def __init__(self, n_samples_per_prompt: int, *, by_sample: bool = False) -> None:
        self.n = n_samples_per_prompt
        self.by_sample = by_sample
        self._groups: OrderedDict[str, Group] = OrderedDict()
        self._ids: set[str] = set()
        self._expected: dict[str, int] = {}
        self._complete: OrderedDict[str, Group] = OrderedDict()
        self._order: deque[str] = deque()  # groups this trainer dispatched, oldest first
        self._registered: set[str] = set()
        self._dropped: set[str] = set()

    def dispatched(self, group_id: str) -> None:
        """Register a group the controller just dispatched: it is released only after older ones."""
        self._order.append(group_id)
        self._registered.add(group_id)

    def add(self, delivery: Delivery) -> bool:
        """Hold a delivery; False if its trajectory id is already held (kept as a duplicate)."""
        traj = delivery.trajectory
        group = self._groups.get(traj.group_id) or self._complete.get(traj.group_id)
        if group is None:
            group = self._groups.setdefault(traj.group_id, Group(traj.group_id))
        if traj.trajectory_id in self._ids or (self.by_sample and traj.sample_index in self._samples(group)):
            group.duplicates.append(delivery)
            return False
        self._ids.add(traj.trajectory_id)
        group.deliveries.append(delivery)
        self._check(traj.group_id)
        return True

    @staticmethod
    def _samples(group: Group) -> set[int]:
        return {d.trajectory.sample_index for d in group.deliveries}

    def held_samples(self, group_id: str) -> set[int]:
        """Sample indices of ``group_id`` held so far (complete or not)."""
        group = self._groups.get(group_id) or self._complete.get(group_id)
        return self._samples(group) if group else set()

    def entry_ids(self) -> set[str]:
        """Stream entries held (duplicates included), to tell a re-delivery of one of them from a new entry."""
        groups = list(self._groups.values()) + list(self._complete.values())
        return {d.entry_id for g in groups for d in g.all_deliveries()}

    def waiting(self) -> set[str]:
        """Groups held but not complete (registered ones included even before their first rollout)."""
        return set(self._groups) | {g for g in self._registered if g not in self._complete and g not in self._dropped}

    def reopen(self, group_id: str) -> None:
        """Forget what the dispatcher said would arrive for ``group_id`` (its missing samples are re-run)."""
        self._expected.pop(group_id, None)

    def expect(self, group_id: str, count: int) -> None:
        """The dispatcher's word on how many rollouts of ``group_id`` were written (0: none will come)."""
        self._expected[group_id] = count
        if count == 0:
            self._groups.pop(group_id, None)
            self._expected.pop(group_id, None)
            self._dropped.add(group_id)
            return
        self._groups.setdefault(group_id, Group(group_id))
        self._check(group_id)

    def _check(self, group_id: str) -> None:
        group = self._groups.get(group_id)
        if group is not None and len(group.deliveries) >= self._expected.get(group_id, self.n):
            self._complete[group_id] = self._groups.pop(group_id)
            self._expected.pop(group_id, None)

    def pop_complete(self, max_groups: int) -> list[Group]:
        """Up to ``max_groups`` complete groups; their ids are released. Registered groups come out in
        dispatch order (an incomplete older one blocks them), unregistered ones in completion order."""
        out = (
            []
            if self.by_sample
            else [g for g in list(self._complete.values()) if g.group_id not in self._registered][:max_groups]
        )
        while self._order and len(out) < max_groups:
            head = self._order[0]
            if head in self._dropped:
                self._dropped.discard(head)
            elif head in self._complete:
                out.append(self._complete[head])
            else:
                break  # the oldest dispatched group is still running
            self._order.popleft()
            self._registered.discard(head)
        for group in out:
            del self._complete[group.group_id]
            self._ids.difference_update(group.trajectory_ids)
        return out

    @property
    def num_complete(self) -> int:
        return len(self._complete)

    @property
    def num_partial(self) -> int:
        return len(self._groups)

    def held_ids(self) -> set[str]:
        return set(self._ids)


class DispatchGate:
    """May the controller dispatch another prompt group? (see the module docstring)."""

    def __init__(self, groups_per_step: int, max_ahead: int, max_groups: int | None = None) -> None:
        self.groups_per_step = groups_per_step
        self.max_ahead = max_ahead
        # With --train.num_steps, never dispatch more groups than the run will train (plus refills for
        # failed or filtered groups), so every trajectory produced is trained.
        self.max_groups = max_groups
        self.dispatched = 0
        self.refills = 0

    def allowed(self, trainer_version: int) -> int:
        """Groups that may be dispatched in total by now (dispatched included)."""
        ahead = (trainer_version + 1 + self.max_ahead) * self.groups_per_step
        if self.max_groups is not None:
            ahead = min(ahead, self.max_groups)
        return ahead + self.refills

    def may_dispatch(self, trainer_version: int) -> bool:
        return self.dispatched < self.allowed(trainer_version)

    def batch_of(self, group_index: int) -> int:
        return group_index // self.groups_per_step


def staleness(trainer_version: int, token_versions) -> list[int]:
    """Trainer version minus each action token's policy version (tokens marked -1 are skipped)."""
    return [trainer_version - int(v) for v in token_versions if int(v) >= 0]
