"""The collective data path: the trainer (rank 0) broadcasts buckets to every pod's staging buffer.

The group is standalone and never touches torch.distributed's default group (vLLM may own it):
- gloo (CPU): a ``ProcessGroupGloo`` over a ``TCPStore`` that the trainer hosts (port 0 = kernel
  picks), each group under its own store prefix;
- nccl (GPU): vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``, as Molt's refit does.

Control stays on gRPC (Begin/Commit/Abort). Every collective sync starts with a small control
broadcast ``[go, num_buckets, total_bytes]`` that every pod posts from Begin, whether its manifest
check passed or not: if any pod refused the sync the trainer sends ``go = 0`` and everybody walks
away, so a refusal never leaves a rank blocked in a broadcast. A pod that is down still stalls the
group until ``timeout_s`` (then the group is dead and must be set up again).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("gloo", "nccl")


@dataclass
class Collective:
    backend: str
    rank: int
    world_size: int
    group: Any  # ProcessGroupGloo | PyNcclCommunicator: two unrelated APIs, each called on its backend only
    device: torch.device
    store: object = None  # keeps the TCPStore (the trainer hosts it) alive

    def describe(self) -> str:
        return f"{self.backend} rank {self.rank}/{self.world_size}"

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Blocking broadcast of a contiguous tensor from ``src`` (every rank calls it)."""
        if self.backend == "gloo":
            from torch.distributed import BroadcastOptions

            opts = BroadcastOptions()
            opts.rootRank = src
            self.group.broadcast([tensor], opts).wait()
        else:
            self.group.broadcast(tensor, src=src)
            torch.cuda.current_stream(self.device).synchronize()

    def control(self, go: bool = False, num_buckets: int = 0, total_bytes: int = 0) -> tuple[bool, int, int]:
        """The per-sync control broadcast; on pods the arguments are ignored and the trainer's returned."""
        t = torch.tensor([int(go), num_buckets, total_bytes], dtype=torch.int64, device=self.device)
        self.broadcast(t)
        started, n, total = (int(x) for x in t.cpu())
        return bool(started), n, total

    def close(self) -> None:
        self.group = None
        self.store = None


def _gloo(store, rank: int, world_size: int, group_name: str, timeout_s: float):
    """torch's public gloo constructor, as ``init_process_group`` builds one: its network device is the address
    this host's name resolves to, or the interface named by ``GLOO_SOCKET_IFNAME`` (set it on multi-NIC hosts)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    prefixed = PrefixStore(f"molt-weightsync/{group_name}", store)
    return ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout_s))


def host_store(host: str, world_size: int, timeout_s: float, port: int = 0):
    """The trainer's TCPStore (gloo); returns (store, bound port)."""
    from torch.distributed import TCPStore

    store = TCPStore(
        host, port, world_size, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return store, store.port


def join(
    backend: str,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 120.0,
    store=None,
) -> Collective:
    """Join (blocking until every rank has joined) a standalone group. Rank 0 passes its own store."""
    if backend not in BACKENDS:
        raise ValueError(f"collective backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "gloo":
        if store is None:
            from torch.distributed import TCPStore

            store = TCPStore(
                master_addr, master_port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
            )
        group = _gloo(store, rank, world_size, group_name, timeout_s)
        return Collective("gloo", rank, world_size, group, torch.device("cpu"), store)
    # nccl: one GPU per process (the pod's engine GPU / the trainer's rank-0 GPU).
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(
        host=master_addr, port=master_port, rank=rank, world_size=world_size, store_timeout=int(timeout_s)
    )
    device = torch.device("cuda", torch.cuda.current_device())
    comm = PyNcclCommunicator(pg, device=device)
    return Collective("nccl", rank, world_size, comm, device, pg)
