"""Which GPUs each process of the local stack may use. Without this every process would open GPU 0: a second
pod's vLLM finds the first holding its memory and fails, and the trainer's model lands beside the pods' caches.

As Molt places its work: the rollout pods first, each on as many GPUs as its tensor-parallel width, then the
trainer on the next ones, one rank per GPU under torchrun (all that are left, unless a count is asked for).
Where no GPU is left for the trainer it shares the last pod's first GPU, with a note naming the memory flag.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from molt.stack.recipes import flag_value

# The flags behind what placement counts, as each command names them (for its one-line errors): the pod count,
# the pods' tensor-parallel width, the trainer's GPUs and the pods' share of a GPU's memory.
FLAGS = {
    "up": {
        "pods": "--pods",
        "width": "--set rollout vllm.tensor_parallel_size",
        "trainer": "trainer_gpus (plan.json)",
        "memory": "--set rollout vllm.gpu_memory_utilization",
    },
    "train-rl": {
        "pods": "--vllm.num_engines",
        "width": "--vllm.tensor_parallel_size",
        "trainer": "--actor.num_gpus_per_node",
        "memory": "--vllm.gpu_memory_utilization",
    },
}


@dataclass(frozen=True)
class GpuPlacement:
    pods: list[str]
    """CUDA_VISIBLE_DEVICES of each pod, in pod order."""
    trainer: str
    """CUDA_VISIBLE_DEVICES of the trainer."""
    notes: list[str] = field(default_factory=list)

    @property
    def trainer_ranks(self) -> int:
        return len(self.trainer.split(","))

    def describe(self) -> dict:
        return {"rollout pods": self.pods, "trainer": self.trainer}


def visible_gpus(count: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """The names of the ``count`` GPUs this process sees, as its children's CUDA_VISIBLE_DEVICES must give them:
    the entries of this process's own CUDA_VISIBLE_DEVICES where set (indices or UUIDs of the machine), since a
    child's list replaces the parent's rather than indexing into it; else 0..count-1."""
    env = os.environ if environ is None else environ
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in given.split(",") if name.strip()][:count]


def place(
    gpus: list[str], num_pods: int, pod_width: int, trainer_gpus: int | None, flags: Mapping[str, str]
) -> GpuPlacement | None:
    """Pods then trainer on ``gpus``; None where there are none (nothing is pinned). ``flags``: one of ``FLAGS``,
    for the messages. ValueError when the pods alone need more GPUs than there are, or an asked-for trainer count
    does not fit beside them (Molt's start-up refuses the same)."""
    if not gpus:
        return None
    need = num_pods * pod_width
    if need > len(gpus):
        raise ValueError(
            f"{flags['pods']} {num_pods} x {flags['width']} {pod_width}: the rollout pods need {need} GPUs and "
            f"this machine has {len(gpus)}; lower {flags['pods']}"
        )
    pods = [",".join(gpus[i * pod_width : (i + 1) * pod_width]) for i in range(num_pods)]
    left = gpus[need:]
    if trainer_gpus is not None:
        if trainer_gpus > len(left):
            raise ValueError(
                f"{flags['trainer']} {trainer_gpus}: the trainer needs {trainer_gpus} GPUs beside the rollout pods' "
                f"{need} and this machine has {len(gpus)}; lower {flags['trainer']} or {flags['pods']}"
            )
        return GpuPlacement(pods, ",".join(left[:trainer_gpus]))
    if left:
        return GpuPlacement(pods, ",".join(left))
    shared = pods[-1].split(",")[0]
    note = (
        f"no GPU left for the trainer beside {num_pods} rollout pod(s): it shares GPU {shared} with the last pod, "
        f"whose vLLM holds {flags['memory']} of its memory (0.9 unless set): lower it so the trainer's model fits"
    )
    return GpuPlacement(pods, shared, [note])


def place_stack(
    count: int, num_pods: int, rollout: list[str], trainer_gpus: int | None, flags: Mapping[str, str]
) -> GpuPlacement | None:
    """``place`` on the ``count`` GPUs this process sees, each pod as wide as its flags (``rollout``) say; a width
    that is not a number counts as 1 here, and the pod refuses it with the flag's own message."""
    width = flag_value(rollout, "--vllm.tensor_parallel_size") or "1"
    return place(visible_gpus(count), num_pods, int(width) if width.isdigit() else 1, trainer_gpus, flags)


def trainer_command(module_args: list[str], ranks: int, stop_grace_s: float) -> list[str]:
    """The trainer's command line: ``python -m services.trainer ...`` for one rank, else under torchrun on this
    machine, which passes SIGTERM on to its ranks and waits for them up to its shutdown timeout (30 s unless
    raised), short of the stack's own grace so a step and its checkpoint can finish first."""
    if ranks <= 1:
        return [sys.executable, "-m", "services.trainer", *module_args]
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"),
        f"--shutdown-timeout={max(int(stop_grace_s) - 15, 30)}",
        *("-m", "services.trainer", *module_args),
    ]


def gpu_count() -> int:
    """CUDA devices this process sees (0 without torch's CUDA build)."""
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


__all__ = ["FLAGS", "GpuPlacement", "gpu_count", "place", "place_stack", "trainer_command", "visible_gpus"]
