"""SFT through the real CLI: SIGTERM during an evaluation abandons it (every rank, whichever got the signal), the
step trained before it is saved, nothing is recorded for the evaluation, and the process exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from tests.integration.sft_testlib import ROOT, lines, reversal_rows, run_sft, sft_cmd, write_jsonl
from tests.integration.test_sft_train import _flags
from tests.integration.trainer_testlib import env

pytestmark = pytest.mark.timeout(300)

# One micro-batch per row: far more eval forwards than the few before a stop request is seen. The full
# evaluation takes tens of seconds on CPU, so an exit within PATIENCE after the signal means it was abandoned.
EVAL_ROWS = 30000
PATIENCE = 30


def _rank_process(torchrun: psutil.Process, rank: int) -> psutil.Process:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for p in torchrun.children(recursive=True):
            try:
                if p.environ().get("RANK") == str(rank) and "services.trainer.sft" in p.cmdline():
                    return p
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} worker under torchrun")


def _kill_tree(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for p in psutil.Process(proc.pid).children(recursive=True):
        p.kill()
    proc.kill()
    proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_during_an_evaluation_abandons_it_and_saves_the_step(tiny_qwen3, tmp_path, nproc):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", reversal_rows(48, seed=1))  # 6 steps of 8
    write_jsonl(data / "eval.jsonl", reversal_rows(EVAL_ROWS, seed=2))
    # evaluations at steps 3 and 6; periodic checkpoints at 2, 4 and 6: step 3's can only come from the stop
    flags = _flags(tiny_qwen3, data, tmp_path, "term", "--eval.steps", "3", "--train.micro_batch_size", "1")
    log_path = tmp_path / "stderr.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            sft_cmd(nproc) + flags, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=log_file
        )
    try:
        deadline = time.monotonic() + 180
        while "step 3 evaluating" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        # With two ranks only rank 1 is signalled: rank 0 leaves its evaluation because they agree on the stop.
        target = proc.pid if nproc == 1 else _rank_process(psutil.Process(proc.pid), 1).pid
        signalled = time.monotonic()
        os.kill(target, signal.SIGTERM)
        proc.wait(timeout=PATIENCE)
        took = time.monotonic() - signalled
    finally:
        _kill_tree(proc)
    err = log_path.read_text()
    assert proc.returncode == 0, err[-3000:]
    assert took < PATIENCE
    done = re.search(r"step 3 evaluation abandoned after (\d+) of (\d+) batches", err)
    assert done is not None, err[-3000:]
    assert int(done[2]) == EVAL_ROWS // nproc and int(done[1]) < int(done[2]) // 10
    assert "step 3 eval_loss" not in err
    assert "stopped by a signal after step 3 of 6" in err
    state = tmp_path / "term" / "state"
    assert (state / "global_step3" / "extra_state.pt").exists()
    assert not (tmp_path / "term" / "hf").exists()
    records = lines(tmp_path / "term.jsonl")
    assert [x["step"] for x in records if "loss" in x] == [1, 2, 3]
    assert not any("eval_loss" in x for x in records)

    if nproc == 2:
        return
    # The resume goes on from step 3 with the uninterrupted run's curve (a small eval set keeps both quick).
    write_jsonl(data / "small_eval.jsonl", reversal_rows(6, seed=2))
    small = ["--eval.dataset", str(data / "small_eval.jsonl")]
    run_sft(_flags(tiny_qwen3, data, tmp_path, "whole", "--train.micro_batch_size", "1", *small))
    proc2 = run_sft([*flags, *small, "--ckpt.load_enable"])
    assert "(step 3)" in proc2.stderr
    whole = {x["step"]: x["loss"] for x in lines(tmp_path / "whole.jsonl") if "loss" in x}
    resumed = {x["step"]: x["loss"] for x in lines(tmp_path / "term.jsonl") if "loss" in x}
    assert sorted(resumed) == sorted(whole) == [1, 2, 3, 4, 5, 6]
    for k in whole:
        assert resumed[k] == pytest.approx(whole[k], abs=1e-5), k
