"""--train.full_determinism_enable (docs/trainer.md): every seed from --train.seed and deterministic torch kernels,
warn-only where none exists, set before any model is built; SFT's flag of the same name selects the same kernels
(its --help). Each case runs in a subprocess: the flag changes process-wide torch state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
from services.trainer.model import DistInfo

info = DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
mode, flags = sys.argv[1], sys.argv[2:]
if mode == "rl":
    from services.trainer import trainer
    from services.trainer.config import TrainerSettings

    trainer.Learner = snapshot
    settings = parse_settings(TrainerSettings, ["--actor.model_name_or_path", "m", *flags], environ={})
    run = lambda: trainer.Trainer(settings, info)
else:
    from services.trainer import sft
    from services.trainer.sft_config import SftSettings

    sft.load_tokenizer = snapshot
    settings = parse_settings(SftSettings, ["--model.model_name_or_path", "m", "--data.dataset", "d", *flags])
    run = lambda: sft.train(settings, info)
try:
    run()
except Stop:
    pass
"""


def _state(mode: str, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("STATE ")]
    assert out.returncode == 0 and len(lines) == 1, out.stderr[-3000:]
    return json.loads(lines[0][len("STATE ") :])


def _seeded(seed: int) -> dict:
    import random

    import numpy as np

    return {
        "torch_seed": seed,
        "random": random.Random(seed).random(),
        "numpy": float(np.random.RandomState(seed).rand()),
    }


def test_full_determinism_seeds_everything_from_train_seed_and_selects_deterministic_kernels_before_the_model():
    state = _state("rl", "--train.full_determinism_enable", "--train.seed", "1234")
    assert state["deterministic"] and state["warn_only"]  # warn-only: ops with no deterministic kernel still run
    assert state["cudnn_deterministic"] and not state["cudnn_benchmark"]
    assert state["cublas_workspace"] is not None  # deterministic cuBLAS needs a fixed workspace
    assert {k: state[k] for k in ("torch_seed", "random", "numpy")} == _seeded(1234)


def test_without_full_determinism_kernels_are_left_as_torch_defaults():
    state = _state("rl", "--train.seed", "1234")
    assert not state["deterministic"] and state["cublas_workspace"] is None


def test_sft_full_determinism_selects_deterministic_kernels_warn_only():
    state = _state("sft", "--train.full_determinism_enable")
    assert state["deterministic"] and state["warn_only"]
