"""A 2-process gloo FSDP2 step equals a 1-process step on the same batch (loss and weights within 1e-5), with
AdamW and with Muon.

The two-process runs are the CLI's ``main`` under torchrun, every case in one launch; the one-process
reference is the CLI's parse / validate / ``Trainer`` run in this process. Each run reads the same synthetic
batch from its own Redis stream; the updated weights are read back from each run's checkpoint.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from molt.config import parse_settings
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.device import trainer_on_gpu
from services.trainer.model import init_distributed
from services.trainer.trainer import Trainer
from tests.integration.trainer_testlib import (
    audit,
    delete_stream,
    put,
    run_trainer_cli_in_sequence,
    synthetic_groups,
)

# The per-token global mean with token-level IS clipping, and the row-weighted loss (each prompt group weighs the
# same, its tokens spread over micro-batches and ranks) under FlashREINFORCE's estimator and trust region.
ALGOS = {
    "token_mean": [],
    "flash_reinforce_prompt_mean": [
        "--algo.advantage.estimator",
        "flash_reinforce",
        "--train.force_on_policy",
        "--algo.advantage.is_correction_level",
        "seq",
        "--algo.advantage.is_correction_mode",
        "mask",
        "--algo.advantage.is_correction_gating",
        "binary_kl",
        "--algo.advantage.is_correction_threshold",
        "inf",
        "--actor.loss_agg_mode",
        "prompt-mean-token-mean",
    ],
    # Muon's Newton-Schulz iterations on FSDP2's sharded matrices (DTensor) equal those on whole ones
    "muon": ["--actor.optim", "muon", "--actor.muon.lr", "0.02"],
}


def _flags(model, redis_url, stream, tmp, tag, algo=()):
    return [
        "--actor.model_name_or_path",
        str(model),
        "--train.dispatch",
        "false",
        "--redis.url",
        redis_url,
        "--redis.stream",
        stream,
        "--algo.advantage.estimator",
        "grpo",
        "--algo.kl.init_coef",
        "0",
        "--rollout.n_samples_per_prompt",
        "2",
        "--rollout.batch_size",
        "4",
        "--train.batch_size",
        "4",
        "--train.micro_batch_size",
        "1",
        "--train.num_steps",
        "1",
        "--actor.adam.lr",
        "1e-3",
        "--actor.max_norm",
        "100",
        "--algo.advantage.is_correction_level",
        "token",
        "--algo.advantage.is_correction_mode",
        "clip",
        "--ckpt.path",
        str(tmp / tag / "ckpt"),
        "--ckpt.save_steps",
        "1",
        "--logger.steps_jsonl",
        str(tmp / f"{tag}.jsonl"),
        *algo,
    ]


def _run_in_process(flags):
    """What ``python -m services.trainer`` runs, in this process: the same Trainer code, without a fresh
    interpreter's imports and model-library start-up (only the /healthz server is left out)."""
    s = parse_settings(TrainerSettings, flags, prog="python -m services.trainer")
    validate_settings(s, on_gpu=trainer_on_gpu())
    trainer = Trainer(s, init_distributed())
    try:
        trainer.run()
    finally:
        trainer.close()
        dist.destroy_process_group()


def _weights(ckpt_dir, out):
    dcp_to_torch_save(str(ckpt_dir / "global_step1" / "model_optim"), str(out))
    return torch.load(out, weights_only=False)["actor"]


@pytest.fixture(scope="module")
def two_process(tiny_qwen3, redis_url, tmp_path_factory):
    """Every case's 2-process run, one after another in one torchrun launch of the CLI's main (start-up paid
    once); each case reads its own stream and writes its own checkpoint and audit under ``tmp``/``algo``."""
    tmp = tmp_path_factory.mktemp("fsdp_two")
    batch = synthetic_groups(4, 2, seed=3)
    streams = {algo: f"molt:test:fsdp:{uuid.uuid4().hex[:8]}:{algo}" for algo in ALGOS}
    try:
        for s in streams.values():
            put(redis_url, s, batch)
        argvs = [_flags(tiny_qwen3, redis_url, streams[a], tmp / a, "two", ALGOS[a]) for a in sorted(ALGOS)]
        proc = run_trainer_cli_in_sequence(argvs, nproc=2)
        yield tmp, streams, proc.stderr
    finally:
        for s in streams.values():
            delete_stream(redis_url, s)


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_two_process_fsdp2_step_equals_one_process(
    algo, two_process, tiny_qwen3, redis_url, stream_name, tmp_path, caplog
):
    two_tmp, two_streams, two_stderr = two_process
    two_tmp = two_tmp / algo
    batch = synthetic_groups(4, 2, seed=3)  # 8 samples, 2 windows of 4 -> 2 optimizer steps
    assert two_stderr.count("rank 1 of 2 ready (gloo") == len(ALGOS)
    flags = ALGOS[algo]
    try:
        put(redis_url, stream_name, batch)
        _run_in_process(_flags(tiny_qwen3, redis_url, stream_name, tmp_path, "one", flags))
        if algo == "token_mean":  # resuming is the same for every loss; checked once
            # DCP reshards: the 2-rank checkpoint resumes in a world of one
            with caplog.at_level(logging.INFO):
                resume = _flags(tiny_qwen3, redis_url, two_streams[algo], two_tmp, "two") + ["--ckpt.load_enable"]
                _run_in_process(resume)
            assert "two/ckpt/global_step1 (step 1)" in caplog.text and "resume: version 1" in caplog.text
    finally:
        delete_stream(redis_url, stream_name)
    one, two = audit(tmp_path / "one.jsonl"), audit(two_tmp / "two.jsonl")
    produced = sorted(t.trajectory_id for t in batch)
    assert sorted(one[0]["trajectory_ids"]) == sorted(two[0]["trajectory_ids"]) == produced
    assert one[0]["policy_loss"] == pytest.approx(two[0]["policy_loss"], abs=1e-5)
    assert one[0]["grad_norm"] == pytest.approx(two[0]["grad_norm"], rel=1e-5)
    w1 = _weights(tmp_path / "one" / "ckpt", tmp_path / "one.pt")
    w2 = _weights(two_tmp / "two" / "ckpt", tmp_path / "two.pt")
    base = load_file(str(tiny_qwen3 / "model.safetensors"))
    assert w1.keys() == w2.keys()
    moved = 0.0
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-5, rtol=0), name
        if name in base:
            moved = max(moved, float((w1[name] - base[name]).abs().max()))
    assert moved > 1e-4  # the step really changed the weights
