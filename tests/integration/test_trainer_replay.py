"""Molt's ``--train.rollout_dump_dir`` / ``--train.rollout_replay_dir``: a run that dumps its rollout batches, then a
run that trains on the dump alone (an empty stream, no episodes) and makes the same steps to the same weights. The
dumping run also keeps checkpoints as Molt's retention flags say."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.integration.trainer_testlib import audit, delete_stream, put, run_trainer, synthetic_groups

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _flags(model, redis_url, stream, tmp, tag, *extra):
    return [
        *("--actor.model_name_or_path", str(model), "--train.dispatch", "false"),
        *("--redis.url", redis_url, "--redis.stream", stream),
        *("--algo.advantage.estimator", "grpo", "--algo.kl.init_coef", "0", "--rollout.n_samples_per_prompt", "2"),
        *("--rollout.batch_size", "2", "--train.batch_size", "4", "--actor.adam.lr", "1e-3"),
        *("--ckpt.path", str(tmp / tag / "ckpt"), "--ckpt.save_steps", "2"),
        *("--logger.steps_jsonl", str(tmp / f"{tag}.jsonl"), "--ckpt.disable_final_save"),
        *extra,
    ]


def _weights(tmp, tag):
    out = tmp / f"{tag}.pt"
    dcp_to_torch_save(str(tmp / tag / "ckpt" / "global_step2" / "model_optim"), str(out))
    return torch.load(out, weights_only=False)["actor"]


def test_a_dumped_run_replays_to_the_same_steps_and_weights(tiny_qwen3, redis_url, stream_name, tmp_path):
    dump = tmp_path / "rollouts"
    streams = [stream_name + ":live", stream_name + ":replay"]
    try:
        put(redis_url, streams[0], synthetic_groups(4, 2, seed=5))  # 2 steps of 2 groups
        run_trainer(
            _flags(tiny_qwen3, redis_url, streams[0], tmp_path, "live", "--train.num_steps", "2")
            + ["--train.rollout_dump_dir", str(dump)]
            # Molt's retention: --ckpt.max_num counts the HF snapshots, --ckpt.dcp_max_num the resumable ones
            + ["--ckpt.save_steps", "1", "--ckpt.save_hf", "--ckpt.max_num", "2", "--ckpt.dcp_max_num", "1"]
        )
        assert sorted(p.name for p in dump.iterdir()) == ["rollout_step1.msgpack", "rollout_step2.msgpack"]
        ckpt = tmp_path / "live" / "ckpt"
        assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step2"]
        assert sorted(p.name for p in (ckpt / "_hf").iterdir()) == ["global_step1", "global_step2"]
        # the replay's stream is empty: it trains on the files and ends at the first step without one
        proc = run_trainer(
            _flags(tiny_qwen3, redis_url, streams[1], tmp_path, "replay", "--train.rollout_replay_dir", str(dump))
        )
        assert "no rollout_step3.msgpack, the replay ends" in proc.stderr
    finally:
        for s in streams:
            delete_stream(redis_url, s)
    live, replay = audit(tmp_path / "live.jsonl"), audit(tmp_path / "replay.jsonl")
    assert [s["step"] for s in replay] == [1, 2]
    for a, b in zip(live, replay, strict=True):
        assert a["trajectory_ids"] == b["trajectory_ids"]
        assert a["policy_loss"] == pytest.approx(b["policy_loss"], abs=1e-6)
    w_live, w_replay = _weights(tmp_path, "live"), _weights(tmp_path, "replay")
    assert all(torch.allclose(w_live[k], w_replay[k], atol=1e-6, rtol=0) for k in w_live)
