"""SFT through the real CLIs: 2 gloo processes equal 1, kill or SIGTERM + resume continues the same curve, the HF
export loads in transformers and in the RL trainer, bad input is a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.sft_testlib import ROOT, lines, reversal_rows, run_sft, sft_cmd, write_jsonl
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
def test_resume_after_a_kill_or_a_sigterm_continues_the_same_curve(tiny_qwen3, data, tmp_path):
    run_sft(_flags(tiny_qwen3, data, tmp_path, "whole", "--ckpt.save_hf", "--ckpt.max_num", "2"))
    whole, whole_eval = _curve(tmp_path / "whole.jsonl")
    assert sorted(whole) == [1, 2, 3, 4, 5, 6]
    # --ckpt.max_num 2 keeps the newest two checkpoints and HF snapshots
    assert sorted(p.name for p in (tmp_path / "whole" / "state").glob("global_step*")) == [
        "global_step4",
        "global_step6",
    ]
    snapshots = tmp_path / "whole" / "state" / "_hf"
    assert sorted(p.name for p in snapshots.iterdir()) == ["global_step4", "global_step6"]
    assert torch.equal(
        load_file(str(snapshots / "global_step6" / "model.safetensors"))["model.norm.weight"],
        load_file(str(tmp_path / "whole" / "hf" / "model.safetensors"))["model.norm.weight"],
    )

    flags = _flags(tiny_qwen3, data, tmp_path, "cut")
    proc = subprocess.Popen(
        sft_cmd() + flags, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 180
        while 3 not in _curve(tmp_path / "cut.jsonl")[0]:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 3"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert not (tmp_path / "cut" / "hf").exists()
    saved = sorted(p.name for p in (tmp_path / "cut" / "state").glob("global_step*"))
    assert saved in (["global_step2"], ["global_step2", "global_step4"])  # killed at step 3 or just after 4
    proc = run_sft(flags + ["--ckpt.load_enable"])
    assert f"(step {saved[-1][11:]})" in proc.stderr
    cut, cut_eval = _curve(tmp_path / "cut.jsonl")  # later lines of a re-run step replace the killed run's
    assert sorted(cut) == [1, 2, 3, 4, 5, 6]
    for k in cut:
        assert cut[k]["loss"] == pytest.approx(whole[k]["loss"], abs=1e-5), k
        assert cut_eval[k] == pytest.approx(whole_eval[k], abs=1e-5), k
    w1 = load_file(str(tmp_path / "whole" / "hf" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "cut" / "hf" / "model.safetensors"))
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-5, rtol=0), name

    # SIGTERM (a preemption) at step 3: that step is finished and saved, the run exits 0 without the final
    # export, and the resume continues from step 3, not from the last periodic checkpoint.
    flags = _flags(tiny_qwen3, data, tmp_path, "term")
    proc = subprocess.Popen(
        sft_cmd() + flags, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while 3 not in _curve(tmp_path / "term.jsonl")[0]:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 3"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    stopped = max(_curve(tmp_path / "term.jsonl")[0])
    assert stopped < 6
    assert f"stopped by a signal after step {stopped} of 6" in err
    assert not (tmp_path / "term" / "hf").exists()
    assert f"global_step{stopped}" in {p.name for p in (tmp_path / "term" / "state").glob("global_step*")}
    proc = run_sft(flags + ["--ckpt.load_enable"])
    assert f"(step {stopped})" in proc.stderr
    term, _ = _curve(tmp_path / "term.jsonl")
    assert sorted(term) == [1, 2, 3, 4, 5, 6]
    for k in term:
        assert term[k]["loss"] == pytest.approx(whole[k]["loss"], abs=1e-5), k


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


def test_bad_input_is_a_clear_error(tiny_qwen3, data, tmp_path):
    proc = run_sft(_flags(tiny_qwen3, data, tmp_path, "x", "--data.input_key", "question"), check=False)
    assert proc.returncode == 2  # refused at start-up, before the model loads: a key no row holds
    assert f"--data.dataset {data / 'train.jsonl'}: no row has 'question' (--data.input_key)" in proc.stderr
    proc = run_sft(_flags(tiny_qwen3, data, tmp_path, "x", "--fsdp.tp_size", "2"), check=False)
    assert proc.returncode != 0 and "need GPUs" in proc.stderr
    proc = run_sft(_flags(tiny_qwen3, data, tmp_path, "x", "--data.image_key", "images"), check=False)
    assert proc.returncode != 0 and "--data.image_key: " in proc.stderr and "takes no images" in proc.stderr


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

    flags = ["--model.lora.rank", "4", "--model.lora.alpha", "8", "--model.lora.target_modules", "*_proj"]
    flags += ["--train.num_steps", "2", "--adam.lr", "1e-2", "--adam.eps", "1e-5"]
    proc = run_sft(_flags(tiny_qwen3, data, tmp_path, "one", *flags))
    assert "--model.lora.rank 4: " in proc.stderr and "parameters train (the adapters)" in proc.stderr
    run_sft(_flags(tiny_qwen3, data, tmp_path, "two", *flags), nproc=2)
    (one, one_eval), (two, two_eval) = _curve(tmp_path / "one.jsonl"), _curve(tmp_path / "two.jsonl")
    for k in (1, 2):
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
    assert ce / n == pytest.approx(one_eval[2], abs=1e-4)

    # the adapters alone, in PEFT's layout: PEFT on the base model gives the merged model's logits
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32), tmp_path / "one" / "hf" / "adapter"
    )
    ids = torch.as_tensor(examples[0].input_ids)[None]
    with torch.no_grad():
        assert torch.allclose(adapted(ids).logits, hf(ids).logits, atol=1e-5)

    offline = export_checkpoint(tmp_path / "one" / "state" / "global_step2", tmp_path / "offline")
    w3 = load_file(str(offline / "model.safetensors"))
    assert w3.keys() == w1.keys() and all(torch.allclose(w3[n], w1[n], atol=1e-6, rtol=0) for n in w1)

    three = [*flags, "--train.num_steps", "3"]
    run_sft(_flags(tiny_qwen3, data, tmp_path, "three", *three))
    proc = run_sft(_flags(tiny_qwen3, data, tmp_path, "one", *three, "--ckpt.load_enable"))
    assert "(step 2)" in proc.stderr
    (whole, _), (resumed, _) = _curve(tmp_path / "three.jsonl"), _curve(tmp_path / "one.jsonl")
    assert resumed[3]["loss"] == pytest.approx(whole[3]["loss"], abs=1e-5)
    w4 = load_file(str(tmp_path / "three" / "hf" / "model.safetensors"))
    w5 = load_file(str(tmp_path / "one" / "hf" / "model.safetensors"))
    assert all(torch.allclose(w4[n], w5[n], atol=1e-5, rtol=0) for n in w4)
