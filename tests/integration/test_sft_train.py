"""SFT through the real CLIs: 2 gloo processes equal 1, kill or SIGTERM + resume continues the same curve (and a
resume of a finished run still exports), the HF export loads in transformers and in the RL trainer, bad input is a
clear error. SIGTERM during an evaluation abandons it (every rank, whichever got the signal), the step trained
before it is saved, nothing is recorded for the evaluation, and the process exits 0."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.integration.sft_testlib import (
    LETTERS,
    ROOT,
    lines,
    reversal_rows,
    run_sft,
    sft_cmd,
    sft_start_up,
    write_jsonl,
)
from tests.integration.trainer_testlib import delete_stream, env, put, run_trainer, synthetic_groups

pytestmark = pytest.mark.timeout(600)


def _flags(model, data, tmp, tag, *extra):
    return [
        "--model.model_name_or_path",
        str(model),
        "--data.dataset",
        str(data / "train.jsonl"),
        "--data.input_key",
        "prompt",
        "--data.output_key",
        "response",
        "--data.max_len",
        "64",
        "--eval.dataset",
        str(data / "eval.jsonl"),
        "--eval.steps",
        "1",
        "--train.batch_size",
        "8",
        "--train.micro_batch_size",
        "2",
        "--train.max_epochs",
        "1",
        "--adam.lr",
        "1e-3",
        "--max_norm",
        "100",
        "--model.gradient_checkpoint",
        "full",
        "--ckpt.path",
        str(tmp / tag / "state"),
        "--ckpt.output_dir",
        str(tmp / tag / "hf"),
        "--ckpt.save_steps",
        "2",
        "--logger.logging_steps",
        "1",
        "--logger.steps_jsonl",
        str(tmp / f"{tag}.jsonl"),
        "--logger.wandb.project",
        "p",
        "--logger.wandb.run_name",
        "r",
        "--fsdp.param_dtype",
        "bf16",
        "--fsdp.tp_size",
        "1",
        "--fsdp.ep_size",
        "1",
        "--fsdp.cp_size",
        "1",
        *extra,
    ]


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "train.jsonl", reversal_rows(48, seed=1))  # 6 steps of 8
    write_jsonl(d / "eval.jsonl", reversal_rows(6, seed=2))
    return d


@pytest.fixture(scope="module")
def uninterrupted(tiny_qwen3, tmp_path_factory):
    """An 8-step run (checkpoints every 2 steps with HF snapshots, the newest two kept) in a folder that also
    holds its data: the curve that the interrupted and resumed runs of several tests here must follow, run once
    for them all (each run costs a process start)."""
    tmp = tmp_path_factory.mktemp("sft_uninterrupted")
    (tmp / "data").mkdir()
    write_jsonl(tmp / "data" / "train.jsonl", reversal_rows(64, seed=1))  # 8 steps of 8
    write_jsonl(tmp / "data" / "eval.jsonl", reversal_rows(6, seed=2))
    run_sft(_flags(tiny_qwen3, tmp / "data", tmp, "whole", "--ckpt.save_hf", "--ckpt.max_num", "2"))
    return tmp


def _exports_agree(tmp_path, source):
    """The 1- and 2-process runs' final models: the source's tensor names, equal within 1e-5. Returns the
    1-process weights and the source's."""
    w1 = load_file(str(tmp_path / "one" / "hf" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "hf" / "model.safetensors"))
    base = load_file(str(source / "model.safetensors"))
    assert w1.keys() == w2.keys() == base.keys()
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-5, rtol=0), name
    return w1, base


def _curve(path):
    train = {x["step"]: x for x in lines(path) if "loss" in x}
    evals = {x["step"]: x["eval_loss"] for x in lines(path) if "eval_loss" in x}
    return train, evals


@pytest.mark.slow
def test_two_processes_equal_one_and_the_export_loads_everywhere(tiny_qwen3, data, tmp_path, redis_url, stream_name):
    # Adam moves a weight by lr * g / (|g| + eps): where a gradient is near eps, the float noise of summing it
    # in another order (two ranks) is amplified up to lr / eps. eps 1e-5 keeps that gain at 10, so noise of
    # ~1e-8 in a cancelling gradient stays far under the 1e-5 bound (the default 1e-8 allows a gain of 1e4).
    steps = ["--train.num_steps", "2", "--fsdp.packing_samples", "--adam.lr", "1e-4", "--adam.eps", "1e-5"]
    run_sft(_flags(tiny_qwen3, data, tmp_path, "one", *steps))
    proc = run_sft(_flags(tiny_qwen3, data, tmp_path, "two", *steps), nproc=2, molt_cli=True)
    assert "rank1" in proc.stderr
    assert "--data.dataset: 48 rows, 48 used, 0 truncated to --data.max_len, dropped: none" in proc.stderr
    (one, one_eval), (two, two_eval) = _curve(tmp_path / "one.jsonl"), _curve(tmp_path / "two.jsonl")
    assert sorted(one) == sorted(two) == [1, 2] and sorted(one_eval) == [1, 2]
    for k in (1, 2):
        assert one[k]["loss"] == pytest.approx(two[k]["loss"], abs=1e-5)
        assert one[k]["grad_norm"] == pytest.approx(two[k]["grad_norm"], rel=1e-4)
        assert one_eval[k] == pytest.approx(two_eval[k], abs=1e-5)
    assert (tmp_path / "one" / "state" / "global_step2" / "extra_state.pt").exists()
    w1, base = _exports_agree(tmp_path, tiny_qwen3)
    assert max(float((w1[n] - base[n]).abs().max()) for n in w1) > 1e-4

    # transformers loads the export: the same weights, the same tokenizer and chat template
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "two" / "hf", dtype=torch.float32)
    two = load_file(str(tmp_path / "two" / "hf" / "model.safetensors"))
    assert torch.equal(hf.state_dict()["model.embed_tokens.weight"], two["model.embed_tokens.weight"])
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "two" / "hf").chat_template
        == AutoTokenizer.from_pretrained(tiny_qwen3).chat_template
    )

    # the RL trainer trains on from it (one step on synthetic trajectories)
    put(redis_url, stream_name, synthetic_groups(2, 2, seed=4))
    try:
        run_trainer(
            [
                "--actor.model_name_or_path",
                str(tmp_path / "two" / "hf"),
                "--train.dispatch",
                "false",
                "--redis.url",
                redis_url,
                "--redis.stream",
                stream_name,
                "--algo.advantage.estimator",
                "grpo",
                "--algo.kl.init_coef",
                "0",
                "--rollout.n_samples_per_prompt",
                "2",
                "--rollout.batch_size",
                "2",
                "--train.batch_size",
                "4",
                "--train.num_steps",
                "1",
                "--logger.steps_jsonl",
                str(tmp_path / "rl.jsonl"),
            ]
        )
    finally:
        delete_stream(redis_url, stream_name)
    assert len(lines(tmp_path / "rl.jsonl")) == 1

    # A resume may take another number of ranks (DCP reshards): one rank's step-2 checkpoint goes on with
    # two, two ranks' with one, and step 3 is the same either way.
    step3 = ["--train.num_steps", "3", "--ckpt.load_enable"]
    run_sft(_flags(tiny_qwen3, data, tmp_path, "one", *steps, *step3), nproc=2, molt_cli=True)
    run_sft(_flags(tiny_qwen3, data, tmp_path, "two", *steps, *step3))
    (one, one_eval), (two, two_eval) = _curve(tmp_path / "one.jsonl"), _curve(tmp_path / "two.jsonl")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    assert one[3]["loss"] == pytest.approx(two[3]["loss"], abs=1e-5)
    assert one_eval[3] == pytest.approx(two_eval[3], abs=1e-5)


@pytest.mark.slow
def test_resume_after_a_kill_or_a_sigterm_continues_the_same_curve(tiny_qwen3, uninterrupted, tmp_path):
    data, done = uninterrupted / "data", uninterrupted / "whole"
    whole, whole_eval = _curve(uninterrupted / "whole.jsonl")
    assert sorted(whole) == [1, 2, 3, 4, 5, 6, 7, 8]
    # --ckpt.max_num 2 keeps the newest two checkpoints and HF snapshots
    assert sorted(p.name for p in (done / "state").glob("global_step*")) == ["global_step6", "global_step8"]
    snapshots = done / "state" / "_hf"
    assert sorted(p.name for p in snapshots.iterdir()) == ["global_step6", "global_step8"]
    assert torch.equal(
        load_file(str(snapshots / "global_step8" / "model.safetensors"))["model.norm.weight"],
        load_file(str(done / "hf" / "model.safetensors"))["model.norm.weight"],
    )
    w1 = load_file(str(done / "hf" / "model.safetensors"))
    # Resuming the finished run trains no step and still writes the final model (Molt's final save whenever the
    # run completes): the checkpoint's weights, and a warning saying which and why.
    shutil.rmtree(done / "hf")
    again = _flags(tiny_qwen3, data, uninterrupted, "whole", "--ckpt.save_hf", "--ckpt.max_num", "2")
    assert "the resumed checkpoint's weights (step 8)" in run_sft([*again, "--ckpt.load_enable"]).stderr
    step8 = load_file(str(snapshots / "global_step8" / "model.safetensors"))
    final = load_file(str(done / "hf" / "model.safetensors"))
    assert final.keys() == step8.keys() and all(torch.equal(final[k], step8[k]) for k in final)

    # One chain of runs takes the interruptions (each run costs a process start): SIGKILL at step 3; the resume
    # evaluates a long eval set every 3 steps and gets SIGTERM during its first evaluation; a last resume goes on
    # to the end. 8 steps leave that evaluation room before the last step however late the kill came.
    flags = _flags(tiny_qwen3, data, tmp_path, "cut")
    proc = subprocess.Popen(
        sft_cmd() + flags, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_for_steps(proc, tmp_path / "cut.jsonl", 3)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert not (tmp_path / "cut" / "hf").exists()
    saved = sorted(p.name for p in (tmp_path / "cut" / "state").glob("global_step*"))
    assert saved in (["global_step2"], ["global_step2", "global_step4"])  # killed at step 3 or just after 4

    # SIGTERM (a preemption) during an evaluation abandons it: the step trained before it is saved, nothing is
    # recorded for the evaluation, the run exits 0 without the final export, and the next resume continues
    # from that step, not from the last periodic checkpoint.
    before = len(lines(tmp_path / "cut.jsonl"))
    err = _sigterm_during_evaluation(flags + _long_evals(tmp_path) + ["--ckpt.load_enable"], tmp_path, nproc=1)
    assert f"(step {saved[-1][11:]})" in err  # the kill's newest checkpoint
    stopped = _abandoned(err, nproc=1)
    assert stopped < 8 and f"stopped by a signal after step {stopped} of 8" in err
    assert (tmp_path / "cut" / "state" / f"global_step{stopped}" / "extra_state.pt").exists()
    assert not (tmp_path / "cut" / "hf").exists()
    records = lines(tmp_path / "cut.jsonl")[before:]
    assert [x["step"] for x in records][-1] == stopped and not any("eval_loss" in x for x in records)
    sigtermed = {x["step"] for x in records}

    proc = run_sft(flags + ["--ckpt.load_enable"])
    assert f"(step {stopped})" in proc.stderr
    cut, cut_eval = _curve(tmp_path / "cut.jsonl")  # later lines of a re-run step replace an interrupted run's
    assert sorted(cut) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert set(cut_eval) >= set(cut) - sigtermed  # that run evaluated only its (abandoned) step 3 or 6
    for k in cut:
        assert cut[k]["loss"] == pytest.approx(whole[k]["loss"], abs=1e-5), k
    for k in cut_eval:
        assert cut_eval[k] == pytest.approx(whole_eval[k], abs=1e-5), k
    w2 = load_file(str(tmp_path / "cut" / "hf" / "model.safetensors"))
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-5, rtol=0), name


def _train_lines(path) -> list[dict]:
    return [x for x in lines(path) if "loss" in x]


def _wait_for_steps(proc, path, count: int) -> None:
    """Until ``path`` holds ``count`` training lines (the run is still going)."""
    deadline = time.monotonic() + 180
    while len(_train_lines(path)) < count:
        assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before {count} steps"
        time.sleep(0.02)


# Micro-batches of two rows, as in the uninterrupted run: far more eval forwards than the few before a stop request
# is seen. The full evaluation takes tens of seconds on CPU, so an exit within PATIENCE after the signal means it
# was abandoned. Long responses (each token goes through the LM head) make every forward slow, so few rows last
# that long and each rank tokenising the whole eval set stays cheap.
EVAL_ROWS = 3000
FILLER = " ".join(LETTERS * 50)
PATIENCE = 30


def _long_evals(tmp_path) -> list[str]:
    """Flags for an evaluation every 3 steps on EVAL_ROWS long rows."""
    rows = [{**r, "response": f"{r['response']} {FILLER}"} for r in reversal_rows(EVAL_ROWS, seed=2)]
    path = write_jsonl(tmp_path / "long_eval.jsonl", rows)
    return ["--eval.dataset", str(path), "--eval.steps", "3", "--data.max_len", "1024"]


def _sigterm_during_evaluation(cmd_flags: list[str], tmp_path, nproc: int) -> str:
    """Starts the run, sends SIGTERM once it logs an evaluation (with two ranks, to rank 1 only: rank 0 leaves
    its evaluation because they agree on the stop), and returns its stderr after it exited 0 within PATIENCE."""
    log_path = tmp_path / "stderr.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            sft_cmd(nproc) + cmd_flags, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=log_file
        )
    try:
        deadline = time.monotonic() + 180
        while not re.search(r"step \d+ evaluating", log_path.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
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
    return err


def _abandoned(err: str, nproc: int) -> int:
    """The step whose evaluation the stop abandoned, after a tenth of its batches at most (none recorded)."""
    done = re.search(r"step (\d+) evaluation abandoned after (\d+) of (\d+) batches", err)
    assert done is not None, err[-3000:]
    assert int(done[3]) == EVAL_ROWS // nproc // 2 and int(done[2]) < int(done[3]) // 10
    assert f"step {done[1]} eval_loss" not in err
    return int(done[1])


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
@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_during_an_evaluation_stops_every_rank(tiny_qwen3, uninterrupted, tmp_path):
    """Two ranks, the signal to rank 1 alone: both abandon the evaluation at step 3 and save that step. (One
    rank, and the resume after, are the kill-and-SIGTERM chain's.)"""
    # evaluations at steps 3 and 6; periodic checkpoints at 2, 4, 6 and 8: step 3's can only come from the stop
    flags = _flags(tiny_qwen3, uninterrupted / "data", tmp_path, "term", *_long_evals(tmp_path))
    err = _sigterm_during_evaluation(flags, tmp_path, nproc=2)
    assert _abandoned(err, nproc=2) == 3
    assert "stopped by a signal after step 3 of 8" in err
    assert (tmp_path / "term" / "state" / "global_step3" / "extra_state.pt").exists()
    assert not (tmp_path / "term" / "hf").exists()
    records = lines(tmp_path / "term.jsonl")
    assert [x["step"] for x in records if "loss" in x] == [1, 2, 3]
    assert not any("eval_loss" in x for x in records)


@pytest.mark.slow
def test_moe_aux_loss_is_trained(tiny_qwen3_moe, data, tmp_path):
    run_sft(
        _flags(
            tiny_qwen3_moe,
            data,
            tmp_path,
            "moe",
            "--train.num_steps",
            "1",
            "--model.aux_loss_coef",
            "0.01",
            "--ckpt.disable_final_save",
        )
    )
    step = _curve(tmp_path / "moe.jsonl")[0][1]
    assert step["aux_loss"] > 0 and step["loss"] > 0


def test_bad_input_is_a_clear_error(tiny_qwen3, data, tmp_path, capsys, monkeypatch):
    proc = run_sft(_flags(tiny_qwen3, data, tmp_path, "x", "--data.input_key", "question"), check=False)
    assert proc.returncode == 2  # refused at start-up, before the model loads: a key no row holds
    assert f"--data.dataset {data / 'train.jsonl'}: no row has 'question' (--data.input_key)" in proc.stderr
    # The same start-up checks refuse these too, before anything loads: main() in this process exits as the
    # process above did, without a process's imports (sft_start_up).
    code, err = sft_start_up(_flags(tiny_qwen3, data, tmp_path, "x", "--fsdp.tp_size", "2"), capsys, monkeypatch)
    assert code == 2 and "need GPUs" in err
    code, err = sft_start_up(
        _flags(tiny_qwen3, data, tmp_path, "x", "--data.image_key", "images"), capsys, monkeypatch
    )
    assert code == 2 and "--data.image_key: " in err and "takes no images" in err


@pytest.mark.slow
def test_vision_language_sft_two_processes_equal_one(tiny_idefics3, tmp_path):
    """Images from a datasets directory and from files: 2 gloo processes (one of them feeding a blank image
    where its micro-batch has none) equal 1; the export takes images as the source did; a frozen vision
    tower stays as it was."""
    from tests.integration.sft_testlib import save_colour_data

    train, evals = save_colour_data(tmp_path / "vl", 32, 6)
    vl = ["--data.dataset", str(train), "--eval.dataset", str(evals), "--data.image_key", "images"]
    vl += ["--data.max_images_per_prompt", "1", "--data.max_len", "48", "--model.gradient_checkpoint", "none"]
    steps = ["--train.num_steps", "2", "--fsdp.packing_samples", "--adam.lr", "1e-4", "--adam.eps", "1e-5"]
    proc = run_sft(_flags(tiny_idefics3, tmp_path, tmp_path, "one", *vl, *steps))
    assert "--data.dataset: 32 rows, 32 used, 0 truncated to --data.max_len, dropped: none" in proc.stderr
    assert "--fsdp.packing_samples: off (a vision-language model" in proc.stderr
    run_sft(_flags(tiny_idefics3, tmp_path, tmp_path, "two", *vl, *steps), nproc=2)
    (one, one_eval), (two, two_eval) = _curve(tmp_path / "one.jsonl"), _curve(tmp_path / "two.jsonl")
    assert sorted(one) == sorted(two) == [1, 2]
    for k in (1, 2):
        assert one[k]["loss"] == pytest.approx(two[k]["loss"], abs=1e-5)
        assert one_eval[k] == pytest.approx(two_eval[k], abs=1e-5)
    w1, base = _exports_agree(tmp_path, tiny_idefics3)
    vision = [n for n in w1 if ".vision_model." in n]
    assert vision and max(float((w1[n] - base[n]).abs().max()) for n in vision) > 1e-6

    # the export is an image-text model with the source's processor: transformers and the RL trainer's inputs
    from transformers import AutoModelForImageTextToText

    from services.trainer.vision import VisionInputs

    out = tmp_path / "two" / "hf"
    AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    png = next((tmp_path / "vl").glob("eval*_0.png")).read_bytes()
    assert VisionInputs(str(out)).num_tokens(png) == VisionInputs(str(tiny_idefics3)).num_tokens(png)
    # so is a checkpoint exported offline (molt export)
    from services.trainer.export import export_checkpoint

    offline = export_checkpoint(tmp_path / "one" / "state" / "global_step2", tmp_path / "offline")
    assert VisionInputs(str(offline)).num_tokens(png) == VisionInputs(str(tiny_idefics3)).num_tokens(png)
    w3 = load_file(str(offline / "model.safetensors"))
    assert w3.keys() == w1.keys() and all(torch.equal(w3[n], w1[n]) for n in w1)

    run_sft(_flags(tiny_idefics3, tmp_path, tmp_path, "frozen", *vl, *steps, "--model.freeze_visual_encoder"))
    frozen = load_file(str(tmp_path / "frozen" / "hf" / "model.safetensors"))
    assert all(torch.equal(frozen[n], base[n]) for n in vision)
    assert max(float((frozen[n] - base[n]).abs().max()) for n in frozen if n not in vision) > 1e-6

    # with LoRA too (Molt's VLM LoRA scripts): '*_proj' also names the tower's projections, which stay frozen
    lora = ["--model.freeze_visual_encoder", "--model.lora.rank", "4", "--adam.lr", "1e-2"]
    run_sft(_flags(tiny_idefics3, tmp_path, tmp_path, "lora", *vl, *steps, *lora))
    adapted = load_file(str(tmp_path / "lora" / "hf" / "model.safetensors"))
    changed = {n for n in adapted if not torch.equal(adapted[n], base[n])}
    assert changed and all(n.endswith("_proj.weight") and n not in vision for n in changed)


@pytest.mark.slow
def test_lora_trains_adapters_alone_and_the_merged_export_is_the_trained_model(tiny_qwen3, data, tmp_path):
    """Molt's LoRA flags: 2 gloo processes equal 1; the export changes only the targeted projections and
    scores the eval rows as the trainer did; `molt export` of a checkpoint folds the adapters the same way;
    a resume from the step-2 checkpoint continues as an uninterrupted run."""
    import json

    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.export import export_checkpoint
    from services.trainer.sft_data import Tokenized

    # Three steps, checkpointed at step 2 (with its HF snapshot): the run is also the uninterrupted one that
    # the resume from that checkpoint must match, so no separate three-step run is needed.
    flags = ["--model.lora.rank", "4", "--model.lora.alpha", "8", "--model.lora.target_modules", "*_proj"]
    flags += ["--train.num_steps", "3", "--adam.lr", "1e-2", "--adam.eps", "1e-5"]
    proc = run_sft(_flags(tiny_qwen3, data, tmp_path, "one", *flags, "--ckpt.save_hf"))
    assert "--model.lora.rank 4: " in proc.stderr and "parameters train (the adapters)" in proc.stderr
    run_sft(_flags(tiny_qwen3, data, tmp_path, "two", *flags), nproc=2)
    (one, one_eval), (two, two_eval) = _curve(tmp_path / "one.jsonl"), _curve(tmp_path / "two.jsonl")
    for k in (1, 2, 3):
        assert one[k]["loss"] == pytest.approx(two[k]["loss"], abs=1e-5)
        assert one_eval[k] == pytest.approx(two_eval[k], abs=1e-5)
    assert one_eval[2] < one_eval[1]
    w1, base = _exports_agree(tmp_path, tiny_qwen3)
    changed = {n for n in w1 if not torch.equal(w1[n], base[n])}
    assert changed and all(n.endswith("_proj.weight") for n in changed)

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    rows = [json.loads(x) for x in (data / "eval.jsonl").read_text().splitlines()]
    examples, _ = Tokenized(tok, 64, "prompt", "response").build(rows, "--eval.dataset")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "hf", dtype=torch.float32)
    ce, n = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = torch.as_tensor(e.input_ids)[None]
            keep = torch.as_tensor(e.loss_mask[1:])
            ce += float(F.cross_entropy(hf(ids).logits[0, :-1][keep], ids[0, 1:][keep], reduction="sum"))
            n += int(keep.sum())
    assert ce / n == pytest.approx(one_eval[3], abs=1e-4)

    # the adapters alone, in PEFT's layout: PEFT on the base model gives the merged model's logits
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32), tmp_path / "one" / "hf" / "adapter"
    )
    ids = torch.as_tensor(examples[0].input_ids)[None]
    with torch.no_grad():
        assert torch.allclose(adapted(ids).logits, hf(ids).logits, atol=1e-5)

    # molt export of the step-2 checkpoint: the model the trainer exported at that step
    offline = export_checkpoint(tmp_path / "one" / "state" / "global_step2", tmp_path / "offline")
    w3 = load_file(str(offline / "model.safetensors"))
    step2 = load_file(str(tmp_path / "one" / "state" / "_hf" / "global_step2" / "model.safetensors"))
    assert w3.keys() == step2.keys() and all(torch.allclose(w3[n], step2[n], atol=1e-6, rtol=0) for n in step2)

    proc = run_sft(_flags(tiny_qwen3, data, tmp_path, "one", *flags, "--ckpt.load_enable"))
    assert "(step 2)" in proc.stderr
    resumed, _ = _curve(tmp_path / "one.jsonl")  # the resume's step-3 line replaces the uninterrupted one's
    assert resumed[3]["loss"] == pytest.approx(one[3]["loss"], abs=1e-5)
    w5 = load_file(str(tmp_path / "one" / "hf" / "model.safetensors"))
    assert all(torch.allclose(w1[n], w5[n], atol=1e-5, rtol=0) for n in w1)
