"""SFT flags: Molt's train_sft names and defaults; what this build cannot do is refused with the reason."""

import pytest

from molt.config import parse_settings
from services.trainer.sft_config import SftSettings, validate_sft

BASE = ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"]


def _s(*flags):
    return parse_settings(SftSettings, BASE + list(flags), prog="t")


def test_molt_defaults():
    s = _s()
    assert (s.adam.lr, s.train.batch_size, s.train.micro_batch_size, s.train.max_epochs) == (5e-6, 128, 8, 2)
    assert (s.data.max_len, s.data.max_samples, s.data.input_key, s.eval.steps) == (2048, 1_000_000, "input", -1)
    assert (s.ckpt.path, s.ckpt.output_dir, s.logger.wandb.project) == (
        "./ckpt/checkpoints_sft",
        "./ckpt",
        "molt_train_sft",
    )
    assert s.model.gradient_checkpoint == "full"


@pytest.mark.parametrize(
    "value, mode",
    # as Molt reads the flag: the off words turn it off, any other word (a typo too) is full
    [("full", "full"), ("", "off"), ("none", "off"), ("off", "off"), ("false", "off"), ("0", "off")]
    + [("selective", "selective"), ("true", "full"), ("ful", "full"), ("yes", "full")],
)
def test_gradient_checkpoint_modes(value, mode):
    assert _s("--model.gradient_checkpoint", value).model.gradient_checkpoint == mode


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--fsdp.tp_size", "2"], "need GPUs"),
        (["--fsdp.ep_size", "8"], "need GPUs"),
        (["--fsdp.cp_size", "8"], "need GPUs"),
        (["--fsdp.pp_size", "2"], "pipeline"),
        (["--optim", "muon", "--fsdp.offload", "optimizer"], "--optim muon"),
        (["--use_ms"], "nothing is downloaded"),
        (["--model.gradient_checkpoint", "selective"], "selective"),
        (["--fsdp.use_liger_kernel"], "GPUs"),
        (["--fsdp.bf16_master_weights"], "GPUs"),
        (["--ckpt.max_mem", "0"], "--ckpt.max_mem must be > 0"),
        (["--fsdp.attn_implementation", "flash_attention_2"], "on CPU use sdpa"),
        (["--data.dataset_probs", "0.5,0.5"], "--data.dataset_probs '0.5,0.5': --data.dataset names 1 datasets"),
        (["--eval.steps", "0"], "--eval.steps"),
        (["--data.tokenizer_chat_template", "./templats/chatml.jinja"], "no such file, and not a Jinja template"),
    ],
)
def test_what_cpu_cannot_do_is_refused_with_the_reason(flags, needle):
    with pytest.raises(ValueError, match=needle):
        validate_sft(_s(*flags))


def test_a_chat_template_is_a_file_or_a_template(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    for value in (str(tmp_path / "t.jinja"), "{% for m in messages %}{{ m.content }}{% endfor %}"):
        validate_sft(_s("--data.tokenizer_chat_template", value))


def test_required_inputs():
    with pytest.raises(ValueError, match="--model.model_name_or_path is required"):
        validate_sft(parse_settings(SftSettings, ["--data.dataset", "d"], prog="t"))
    with pytest.raises(ValueError, match="--data.dataset is required"):
        validate_sft(parse_settings(SftSettings, ["--model.model_name_or_path", "m"], prog="t"))


def test_gpu_parallelism_passes_on_gpu():
    validate_sft(_s("--fsdp.tp_size", "2", "--fsdp.ep_size", "8"), on_gpu=True)


# The flags of Molt's examples/scripts/quick_start/sft_qwen3_4b.sh and sft_qwen3_4b_alfworld.sh, with the
# attention kernel CPU has (the scripts take it from FSDP_ATTN_IMPLEMENTATION).
QUICK_START = [
    "--data.max_len",
    "4096",
    "--data.dataset",
    "d",
    "--data.input_key",
    "prompt",
    "--data.output_key",
    "response",
    "--data.max_samples",
    "4096",
    "--model.model_name_or_path",
    "m",
    "--ckpt.output_dir",
    "o/hf",
    "--ckpt.path",
    "o/state",
    "--ckpt.save_steps",
    "50",
    "--logger.logging_steps",
    "1",
    "--eval.dataset",
    "e",
    "--eval.steps",
    "20",
    "--train.max_epochs",
    "1",
    "--train.batch_size",
    "64",
    "--train.micro_batch_size",
    "2",
    "--fsdp.param_dtype",
    "bf16",
    "--fsdp.attn_implementation",
    "sdpa",
    "--fsdp.tp_size",
    "1",
    "--fsdp.ep_size",
    "1",
    "--fsdp.cp_size",
    "1",
    "--model.gradient_checkpoint",
    "full",
    "--adam.lr",
    "1e-6",
    "--logger.wandb.project",
    "p",
    "--logger.wandb.run_name",
    "r",
]


def test_molt_quick_start_flags_parse_and_validate_on_cpu():
    s = parse_settings(SftSettings, QUICK_START, prog="t")
    validate_sft(s)
    assert (s.data.input_key, s.data.output_key, s.eval.steps, s.adam.lr) == ("prompt", "response", 20, 1e-6)
    alf = parse_settings(
        SftSettings, QUICK_START + ["--logger.wandb.key", "local", "--logger.tensorboard_dir", "tb"], prog="t"
    )
    validate_sft(alf)
    assert (alf.logger.wandb.key, alf.logger.tensorboard_dir) == ("local", "tb")


def test_molt_vlm_and_lora_script_flags():
    """sft_qwen3_6_35b.sh / sft_omni3_30b.sh add image columns, padding to max_len, no recompute and no final
    save, the LoRA scripts (sft_qwen3_5_35b_lora.sh, sft_qwen3_30b_a3b_lora.sh) rank and alpha: all honoured
    on CPU (with the CPU's attention kernel and parallel sizes 1)."""
    vlm = ["--data.image_key", "images", "--data.max_images_per_prompt", "1", "--data.pad_to_max_len"]
    vlm += ["--ckpt.disable_final_save", "--model.gradient_checkpoint", "", "--model.aux_loss_coef", "0.001"]
    s = parse_settings(SftSettings, QUICK_START + vlm, prog="t")
    validate_sft(s)
    assert (s.data.image_key, s.data.max_images_per_prompt, s.data.pad_to_max_len) == ("images", 1, True)
    assert s.ckpt.disable_final_save and s.model.gradient_checkpoint == "off"
    lora = ["--model.lora.rank", "16", "--model.lora.alpha", "32"]
    s = parse_settings(SftSettings, QUICK_START + vlm + lora, prog="t")
    validate_sft(s)
    assert (s.model.lora.rank, s.model.lora.alpha, s.model.lora.target_modules) == (16, 32.0, ["*_proj"])
    targets = ["--model.lora.target_modules", "*_proj", "*.experts", "--model.lora.dropout", "0.1"]
    s = parse_settings(SftSettings, QUICK_START + lora + targets, prog="t")
    assert (s.model.lora.target_modules, s.model.lora.dropout) == (["*_proj", "*.experts"], 0.1)


def test_a_logger_whose_package_is_missing_is_a_clear_error(monkeypatch, tmp_path):
    import sys

    from services.trainer.sft import Sinks

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ValueError, match="wandb package is not installed"):
        Sinks(_s("--logger.wandb.key", "k"), on=True)
    with pytest.raises(ValueError, match="tensorboard package is not installed"):
        Sinks(_s("--logger.tensorboard_dir", str(tmp_path)), on=True)
    Sinks(_s("--logger.wandb.key", "k"), on=False).close()  # only rank 0 logs


def test_the_steps_file_folder_is_made_at_start_up(tmp_path):
    from services.trainer.sft import Sinks

    Sinks(_s("--logger.steps_jsonl", str(tmp_path / "out" / "steps.jsonl")), on=True).close()
    assert (tmp_path / "out" / "steps.jsonl").exists()


def test_dry_run_runs_every_start_up_check(capsys, tmp_path, monkeypatch):
    """A dry run rejects what start-up rejects, with the same one line: flags, the model directory."""
    from services.trainer.sft import main

    monkeypatch.setenv("MOLT_TRAINER_DEVICE", "cpu")
    model = tmp_path / "m"
    for flags, needle in (
        (["--model.model_name_or_path", str(model)], "--model.model_name_or_path"),
        (["--model.model_name_or_path", str(model), "--fsdp.tp_size", "2"], "need GPUs"),
    ):
        with pytest.raises(SystemExit) as exc:
            main([*flags, "--data.dataset", "d", "--dry-run"])
        assert exc.value.code == 2 and needle in capsys.readouterr().err
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text("{}")


def test_sft_logs_losses_under_molts_names_and_step_axes(tmp_path, monkeypatch):
    """W&B and TensorBoard get Molt's SFT names (train/sft_loss, eval/'eval sft_loss') so dashboards built on
    Molt's runs keep working; W&B steps train/* and eval/* by their own global_step, as Molt defines them."""
    import sys
    import types

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from services.trainer.sft import Sinks

    s = _s("--logger.tensorboard_dir", str(tmp_path / "tb"), "--logger.wandb.run_name", "r")
    sinks = Sinks(s, on=True)
    sinks.write("train", 1, {"loss": 2.0, "lr": 1e-3})
    sinks.write("eval", 1, {"eval_loss": 3.0})
    sinks.close()
    events = EventAccumulator(str(tmp_path / "tb" / "r"))
    events.Reload()
    assert {"train/sft_loss", "train/lr", "eval/eval sft_loss"} <= set(events.Tags()["scalars"])

    logged, defined = [], []
    fake = types.SimpleNamespace(
        api=types.SimpleNamespace(api_key="set"),
        init=lambda **kw: None,
        define_metric=lambda name, **kw: defined.append((name, kw.get("step_metric"))),
        log=logged.append,
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sinks = Sinks(_s("--logger.wandb.key", "k"), on=True)
    sinks.write("train", 4, {"loss": 2.0})
    sinks.write("eval", 4, {"eval_loss": 3.0})
    assert logged == [
        {"train/sft_loss": 2.0, "train/global_step": 4},
        {"eval/eval sft_loss": 3.0, "eval/global_step": 4},
    ]
    assert ("train/*", "train/global_step") in defined and ("eval/*", "eval/global_step") in defined


def test_dry_run_refuses_a_batch_that_splits_unevenly_and_lora_targets_that_match_nothing(
    capsys, tmp_path, monkeypatch, tiny_qwen3
):
    """Flag-only checks the run would fail after loading: the batch's micro-batches over WORLD_SIZE ranks, and
    LoRA patterns against the model's linears (built from config.json on the meta device, no weights)."""
    from services.trainer.sft import main

    monkeypatch.setenv("MOLT_TRAINER_DEVICE", "cpu")
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "q", "output": "a"}\n')
    base = ["--model.model_name_or_path", str(tiny_qwen3), "--data.dataset", str(data), "--data.output_key", "output"]
    for flags, env, needle in (
        (["--train.batch_size", "6", "--train.micro_batch_size", "4"], "1", "--train.batch_size 6 must be a multiple"),
        (["--train.batch_size", "8", "--train.micro_batch_size", "4"], "4", "x 4 data-parallel ranks"),
        (["--model.lora.rank", "4", "--model.lora.target_modules", "q_proj"], "1", "target_modules q_proj: no linear"),
    ):
        monkeypatch.setenv("WORLD_SIZE", env)
        with pytest.raises(SystemExit) as exc:
            main([*base, *flags, "--dry-run"])
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    ok = ["--train.batch_size", "8", "--train.micro_batch_size", "4", "--model.lora.rank", "4"]
    with pytest.raises(SystemExit) as exc:
        main([*base, *ok, "--model.lora.target_modules", "*.q_proj", "--dry-run"])
    assert exc.value.code in (0, None), capsys.readouterr().err


def test_a_refused_wandb_key_is_a_start_up_error_before_anything_loads(capsys, tmp_path, monkeypatch, tiny_qwen3):
    import sys
    import types

    from services.trainer import sft

    class AuthenticationError(Exception):
        pass

    def login(key):
        raise AuthenticationError("API key must be 40 characters long, yours was 3\nmore")

    fake = types.SimpleNamespace(api=types.SimpleNamespace(api_key=None), login=login)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("MOLT_TRAINER_DEVICE", "cpu")
    monkeypatch.setattr(sft, "load_tokenizer", lambda s: pytest.fail("loaded before the W&B login"))
    monkeypatch.setattr(sft, "init_distributed", lambda: pytest.fail("started before the W&B login"))
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "q", "output": "a"}\n')
    flags = ["--model.model_name_or_path", str(tiny_qwen3), "--data.dataset", str(data), "--data.output_key", "output"]
    with pytest.raises(SystemExit) as exc:
        sft.main([*flags, "--logger.wandb.key", "abc"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert err[-1].startswith("python -m services.trainer.sft: error: --logger.wandb.key: W&B refused the run ")
    assert "(AuthenticationError: API key must be 40 characters long, yours was 3)" in err[-1]
