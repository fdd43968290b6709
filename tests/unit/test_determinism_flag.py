"""--train.full_determinism_enable (docs/trainer.md): every seed from --train.seed and deterministic torch kernels,
warn-only where none exists, set before any model is built; SFT's flag of the same name selects the same kernels
(its --help). Each case runs in its own process: the flag changes process-wide torch state. One subprocess
imports torch and the trainers once and forks a child per case, so every case starts from that untouched state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What the process looks like at the moment the model would be built: the learner (RL) or the tokenizer (SFT)
# is replaced by a probe that records it and stops the run there.
PROBE = r"""
import json, os, random, sys
import numpy as np
import torch

class Stop(Exception):
    pass

def snapshot(*args, **kwargs):
    print("STATE " + json.dumps({
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "torch_seed": torch.initial_seed(),
        "random": random.random(),
        "numpy": float(np.random.rand()),
    }), flush=True)
    raise Stop

from molt.config import parse_settings
from services.trainer import sft, trainer
from services.trainer.config import TrainerSettings
from services.trainer.model import DistInfo
from services.trainer.sft_config import SftSettings

trainer.Learner = snapshot
sft.load_tokenizer = snapshot
info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")


def case(mode, flags):
    if mode == "rl":
        settings = parse_settings(TrainerSettings, ["--actor.model_name_or_path", "m", *flags], environ={})
        run = lambda: trainer.Trainer(settings, info)
    else:
        settings = parse_settings(SftSettings, ["--model.model_name_or_path", "m", "--data.dataset", "d", *flags])
        run = lambda: sft.train(settings, info)
    try:
        run()
    except Stop:
        pass


for i, (mode, flags) in enumerate(json.loads(sys.argv[1])):
    print(f"CASE {i}", flush=True)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            case(mode, flags)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(f"EXIT {i} {os.waitstatus_to_exitcode(status)}", flush=True)
"""

CASES = {
    "rl_full": ("rl", ["--train.full_determinism_enable", "--train.seed", "1234"]),
    "rl_default": ("rl", ["--train.seed", "1234"]),
    "sft_full": ("sft", ["--train.full_determinism_enable"]),
}


@pytest.fixture(scope="module")
def states() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    names = list(CASES)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([CASES[n] for n in names])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # Each case: exactly one STATE line from its child, which then exited 0.
    blocks = out.stdout.split("CASE ")[1:]
    assert len(blocks) == len(names), out.stdout[-3000:] + out.stderr[-3000:]
    result = {}
    for name, block in zip(names, blocks):
        lines = [line for line in block.splitlines() if line.startswith("STATE ")]
        assert len(lines) == 1 and block.rstrip().endswith(" 0"), block + out.stderr[-3000:]
        result[name] = json.loads(lines[0][len("STATE ") :])
    return result


def _seeded(seed: int) -> dict:
    import random

    import numpy as np

    return {
        "torch_seed": seed,
        "random": random.Random(seed).random(),
        "numpy": float(np.random.RandomState(seed).rand()),
    }


def test_full_determinism_seeds_everything_from_train_seed_and_selects_deterministic_kernels_before_the_model(states):
    state = states["rl_full"]
    assert state["deterministic"] and state["warn_only"]  # warn-only: ops with no deterministic kernel still run
    assert state["cudnn_deterministic"] and not state["cudnn_benchmark"]
    assert state["cublas_workspace"] is not None  # deterministic cuBLAS needs a fixed workspace
    assert {k: state[k] for k in ("torch_seed", "random", "numpy")} == _seeded(1234)


def test_without_full_determinism_kernels_are_left_as_torch_defaults(states):
    state = states["rl_default"]
    assert not state["deterministic"] and state["cublas_workspace"] is None


def test_sft_full_determinism_selects_deterministic_kernels_warn_only(states):
    state = states["sft_full"]
    assert state["deterministic"] and state["warn_only"]
