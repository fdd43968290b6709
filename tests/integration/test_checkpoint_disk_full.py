"""A checkpoint volume that fills up: the trainer stops with one line that says so and names the flags that
keep fewer checkpoints, removes the partial directory, and acks nothing it could not save; a restart with room
trains the same trajectories.

The full disk is real: the checkpoint folder is a 1 MiB tmpfs mounted in a user and mount namespace of the
trainer's own (``unshare -Urm``); the test is skipped where such namespaces are not allowed. Torch's writers
report a full disk as a size mismatch ("unexpected pos"), which is why the message states the free space.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.integration.trainer_testlib import (
    ROOT,
    audit,
    delete_stream,
    env,
    lag,
    put,
    run_trainer,
    stream_flags,
    synthetic_groups,
    trainer_cmd,
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]
UNSHARE = shutil.which("unshare")


def _on_small_fs(mount: Path, argv: list[str], size: str = "1m") -> list[str]:
    """``argv`` run with a ``size`` tmpfs over ``mount``, in namespaces of its own; what the tmpfs holds at the
    end is printed last (``left: <names>``), since it goes with the namespace."""
    assert UNSHARE is not None
    where = shlex.quote(str(mount))
    run = f'"$@"; rc=$?; echo "left: $(ls -A {where})"; exit $rc'
    return [UNSHARE, "-Urm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {where} && {{ {run}; }}", "sh", *argv]


def _trainer_on_small_fs(mount: Path, flags: list[str], size: str = "1m") -> subprocess.CompletedProcess:
    argv = _on_small_fs(mount, trainer_cmd() + flags, size)
    return subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def small_fs_allowed(tmp_path_factory):
    mount = tmp_path_factory.mktemp("probe")
    if UNSHARE is None or subprocess.run(_on_small_fs(mount, ["true"]), capture_output=True).returncode != 0:
        pytest.skip("no unprivileged user and mount namespaces here: cannot mount a small tmpfs")


def test_a_full_checkpoint_volume_stops_the_trainer_with_the_fix_and_loses_nothing(
    small_fs_allowed, tiny_qwen3, redis_url, tmp_path
):
    stream = f"molt:test:diskfull:{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    flags = stream_flags(tiny_qwen3, redis_url, stream, tmp_path, "--train.read_block_s", "0.2")
    flags += ["--ckpt.path", str(ckpt / "run"), "--ckpt.save_steps", "1", "--train.num_steps", "2"]
    trajs = synthetic_groups(2, 2)
    try:
        put(redis_url, stream, trajs)
        proc = _trainer_on_small_fs(ckpt, flags)
        assert proc.returncode == 1, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("python -m services.trainer: error: could not write checkpoint global_step1")
        assert "free when it failed" in last and "--ckpt.max_num" in last and "--ckpt.max_mem" in last
        assert lag(redis_url, stream).pending == len(trajs)  # read, never saved: nothing acked

        # With room (the tmpfs is gone with the namespace), the restart trains the same trajectories.
        run_trainer(flags)
        trained = [t for e in audit(tmp_path / "audit.jsonl") for t in e["trajectory_ids"]]
        assert sorted(trained[-4:]) == sorted(t.trajectory_id for t in trajs)
        assert lag(redis_url, stream).pending == 0
        assert not list((ckpt / "run").glob(".tmp-*"))
    finally:
        delete_stream(redis_url, stream)


def test_a_final_model_that_does_not_fit_is_one_line_naming_molt_export_and_leaves_nothing_half_written(
    small_fs_allowed, tiny_qwen3, redis_url, tmp_path
):
    stream = f"molt:test:diskfull:{uuid.uuid4().hex[:8]}"
    out = tmp_path / "final"
    out.mkdir()
    flags = stream_flags(tiny_qwen3, redis_url, stream, tmp_path, "--train.read_block_s", "0.2")
    flags += ["--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.save_steps", "1", "--train.num_steps", "1"]
    flags += ["--ckpt.output_dir", str(out / "model")]
    try:
        put(redis_url, stream, synthetic_groups(1, 2))
        proc = _trainer_on_small_fs(out, flags, size="256k")
        assert proc.returncode == 1, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("python -m services.trainer: error: could not write the HF model directory")
        assert "molt export" in last and "--ckpt.output_dir" in last
        assert proc.stdout.strip().splitlines()[-1] == "left:"  # the partial model directory was removed
        assert lag(redis_url, stream).pending == 0  # the step was checkpointed and acked before the export
    finally:
        delete_stream(redis_url, stream)
