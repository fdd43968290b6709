"""Trainer flags: Molt's names and defaults; invalid combinations rejected with the flag name."""

from __future__ import annotations

import pytest

from molt.config import parse_settings
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings, max_versions_ahead, needs_critic, needs_reference

BASE = ["--actor.model_name_or_path", "m", "--train.dispatch", "false"]


def _settings(*flags: str) -> TrainerSettings:
    return parse_settings(TrainerSettings, [*BASE, *flags], environ={})


def test_molt_defaults():
    s = _settings()
    validate_settings(s)
    assert s.actor.adam.lr == 1e-6 and s.critic.adam.lr == 5e-6 and s.actor.adam.betas == [0.9, 0.95]
    assert s.actor.eps_clip_low_high == [0.2, 0.2] and s.actor.max_norm == 1.0
    assert s.train.async_queue_size == 1 and s.train.batch_size == 128 and s.rollout.batch_size == 1024
    assert s.algo.kl.init_coef == 0.01 and needs_reference(s) and not needs_critic(s)
    assert s.ckpt.path == "./ckpt/checkpoints_rl_ray" and s.ckpt.save_steps == -1
    assert max_versions_ahead(s.train) == 1


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--algo.advantage.estimator", "grpo"], "--rollout.n_samples_per_prompt"),
        (["--train.async_queue_size", "2"], "--algo.advantage.is_correction_level"),
        (["--train.force_on_policy", "--train.max_epochs", "2"], "--train.force_on_policy"),
        (
            [
                "--train.routing_replay",
                "--train.partial_rollout_enable",
                "--algo.advantage.is_correction_level",
                "token",
            ],
            "--train.routing_replay",
        ),
        (
            ["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "clip"],
            "--algo.advantage.is_correction_mode",
        ),
        (["--algo.advantage.is_correction_level", "token", "--rollout.top_p", "0.9"], "--rollout.top_p"),
        (["--actor.loss_mode", "gspo", "--actor.dual_clip", "3"], "--actor.dual_clip"),
        (["--actor.dual_clip", "0.5"], "--actor.dual_clip"),
        (["--actor.loss_mode", "cispo", "--actor.eps_clip_low_high", "0.2", "0.5"], "--actor.eps_clip_low_high"),
        (["--algo.dynamic_filtering_enable"], "--algo.dynamic_filtering_enable"),
        (["--algo.advantage.estimator", "on_policy_distill"], "--ref.model_name_or_path"),
        (["--train.batch_size", "6", "--train.micro_batch_size", "4"], "--train.micro_batch_size"),
        (["--fsdp.pp_size", "2"], "--fsdp.pp_size"),
        (["--fsdp.cp_size", "2"], "--fsdp.cp_size"),
        (["--train.dispatch", "true"], "--data.prompt_dataset"),
        (["--train.dispatch", "true", "--data.prompt_dataset", "p.jsonl"], "--envs.urls"),
        (["--algo.advantage.estimator", "nope"], "--algo.advantage.estimator"),
        (["--eval.dataset", "e.jsonl", "--eval.steps", "5"], "--eval.dataset .*--train.dispatch"),
    ],
)
def test_invalid_combinations_name_the_flag(flags, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace(r"\.*", ".*")):
        validate_settings(_settings(*flags))


def test_model_path_is_required():
    with pytest.raises(ValueError, match=r"--actor\.model_name_or_path"):
        validate_settings(parse_settings(TrainerSettings, ["--train.dispatch", "false"], environ={}))


def test_field_errors_exit_with_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_settings(TrainerSettings, [*BASE, "--train.async_queue_size", "0"], environ={})
    assert exc.value.code == 2
    assert "--train.async_queue_size" in capsys.readouterr().err


def test_valid_async_setup_and_gae():
    s = _settings(
        "--train.async_queue_size",
        "4",
        "--algo.advantage.is_correction_level",
        "geo",
        "--algo.advantage.is_correction_threshold",
        "0.99",
        "1.01",
        "--algo.advantage.estimator",
        "gae",
        "--algo.kl.init_coef",
        "0",
    )
    validate_settings(s)
    assert needs_critic(s) and not needs_reference(s) and max_versions_ahead(s.train) == 4


def test_env_overrides_and_dry_run(capsys):
    s = parse_settings(TrainerSettings, BASE, environ={"MOLT_TRAIN__ASYNC_QUEUE_SIZE": "3"})
    assert s.train.async_queue_size == 3
    with pytest.raises(SystemExit) as exc:
        parse_settings(TrainerSettings, [*BASE, "--dry-run"], environ={})
    assert exc.value.code == 0 and '"async_queue_size": 1' in capsys.readouterr().out


def test_plugins_register_custom_estimators(tmp_path):
    plugin = tmp_path / "my_algo.py"
    plugin.write_text(
        "from molt.algorithms import register_advantage_estimator\n"
        "@register_advantage_estimator('trainer_test_est', grouped=False)\n"
        "def est(batch):\n"
        "    adv = batch.broadcast(batch.rollout_rewards)\n"
        "    return adv, adv\n"
    )
    validate_settings(_settings("--train.plugins", str(plugin), "--algo.advantage.estimator", "trainer_test_est"))
    with pytest.raises(ValueError, match=r"--train\.plugins"):
        validate_settings(_settings("--train.plugins", "no_such_module_xyz"))


def test_shared_model_path_and_comma_separated_urls():
    s = parse_settings(
        TrainerSettings,
        [
            "--model.path",
            "/m",
            "--rollout.urls",
            "http://a:1,http://b:2",
            "--envs.urls",
            "http://e:1",
            "http://e:2",
            "--data.prompt_dataset",
            "p.jsonl",
            "--rollout.grpc_targets",
            "a:5,b:6",
        ],
        environ={},
    )
    validate_settings(s)
    assert s.actor.model_name_or_path == "/m"
    assert s.rollout.urls == ["http://a:1", "http://b:2"] and s.rollout.grpc_targets == ["a:5", "b:6"]
    assert s.envs.urls == ["http://e:1", "http://e:2"]


def test_molts_output_and_semantics_flags():
    s = _settings(
        "--fsdp.packing_samples",
        "--train.pack_shared_prefix",
        "false",
        "--train.check_weight_update_equal",
        "--rollout.vllm_generate_batch_size",
        "8",
        "--ckpt.save_hf",
    )
    validate_settings(s)
    assert s.train.pack_shared_prefix and s.train.check_weight_update_equal  # packing_samples turns packing on
    assert s.rollout.vllm_generate_batch_size == 8 and s.ckpt.save_hf and not s.ckpt.disable_final_save
    import os

    assert s.ckpt.final_dir() == os.path.abspath("./ckpt")  # Molt's default --ckpt.output_dir
    assert _settings("--ckpt.output_dir", "/out").ckpt.final_dir() == "/out"
    # the folder holding a --ckpt.path of ./ckpt is the working directory: its files are not overwritten
    with pytest.raises(ValueError, match="--ckpt.path ./ckpt: the final model would be written"):
        validate_settings(_settings("--ckpt.path", "./ckpt"))
    for fine in (("--ckpt.output_dir", "out"), ("--ckpt.disable_final_save",)):
        validate_settings(_settings("--ckpt.path", "./ckpt", *fine))


def test_moe_aux_loss_is_divided_by_the_windows_micro_batches():
    import torch

    from services.trainer.learner import moe_aux_term

    # Molt: coef * aux / num_microbatches; two micro-batches with aux 0.4 and 0.8, coef 0.01 -> 0.01 * mean 0.6
    terms = [moe_aux_term(torch.tensor(a), 0.01, num_micro=2) for a in (0.4, 0.8)]
    assert float(sum(terms)) == pytest.approx(0.006)


def test_molt_up_sync_and_queue_flags_reach_the_trainer():
    from molt.stack.recipes import RECIPES
    from molt.stack.up import UpOptions, mode_args

    sync = _settings(*RECIPES["tiny"].trainer, *mode_args(UpOptions(force_sync=True)))
    validate_settings(sync)
    assert sync.train.force_sync_mode and max_versions_ahead(sync.train) == 0
    queued = _settings(*RECIPES["tiny"].trainer, *mode_args(UpOptions(async_queue_size=3)))
    assert not queued.train.force_sync_mode and queued.train.async_queue_size == 3


@pytest.mark.parametrize(
    "flags",
    [
        ["--fsdp.use_liger_kernel"],
        ["--fsdp.bf16_master_weights"],
        ["--fsdp.offload", "optimizer"],
        ["--fsdp.tp_size", "2"],
        ["--fsdp.attn_implementation", "flash_attention_2"],
    ],
)
def test_gpu_only_flags_are_refused_where_the_trainer_runs_on_cpu(flags):
    """The CPU loader refuses these; validation with the device known refuses them first, so a dry run
    does; on a GPU with NeMo (strategy auto) they pass, and with --fsdp.strategy torch the NeMo-only ones don't."""
    with pytest.raises(ValueError, match=flags[0]):
        validate_settings(_settings(*flags), on_gpu=False)
    validate_settings(_settings(*flags), on_gpu=True)
    if flags[0] != "--fsdp.attn_implementation":
        with pytest.raises(ValueError, match=flags[0]):
            validate_settings(_settings(*flags, "--fsdp.strategy", "torch"), on_gpu=True)


def test_dry_run_of_the_trainer_process_refuses_a_gpu_only_flag_on_cpu(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "services.trainer", *BASE, "--fsdp.use_liger_kernel", "--dry-run"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={"MOLT_TRAINER_DEVICE": "cpu"}, cwd=tmp_path)
    assert out.returncode == 2 and "--fsdp.use_liger_kernel" in out.stderr and out.stdout == ""


def test_the_actors_schedule_spans_only_the_steps_it_takes():
    """As Molt: with a critic warmup (--actor.freezing_steps, gae) the actor takes no optimizer step for those
    train steps, so its LR schedule is that much shorter (else its warmup and decay shift and min_lr is never
    reached); the critic keeps the whole horizon."""
    from services.trainer.config import actor_schedule_steps, planned_optimizer_steps

    flags = ["--train.num_steps", "10", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2"]
    flags += ["--train.batch_size", "4", "--train.max_epochs", "2", "--algo.kl.init_coef", "0"]
    gae = _settings(*flags, "--algo.advantage.estimator", "gae", "--actor.freezing_steps", "3")
    total = planned_optimizer_steps(gae, None)
    assert total == 10 * 2 * 2  # 2 windows of 4 samples, 2 epochs
    assert actor_schedule_steps(gae, total) == total - 3 * 2 * 2
    assert actor_schedule_steps(_settings(*flags, "--algo.advantage.estimator", "grpo"), total) == total


@pytest.mark.parametrize(
    "flags, hint",
    [
        (["--train.force_sync_mode", "--train.async_queue_size", "2", "--algo.advantage.is_correction_level", "token"],
         "--train.async_queue_size 2 has no effect"),
        (["--actor.freezing_steps", "2"], "--actor.freezing_steps is a critic warmup"),
        (["--eval.dataset", "e.jsonl", "--train.dispatch", "true", "--data.prompt_dataset", "p.jsonl",
          "--envs.urls", "http://e"], "--eval.dataset is never evaluated"),
    ],
)  # fmt: skip
def test_combinations_molt_accepts_are_run_and_said_not_refused(flags, hint):
    """Molt runs these (a Molt script must run unchanged); what this trainer makes of them is logged."""
    assert any(hint in h for h in validate_settings(_settings(*flags)))


def test_a_policy_path_other_than_the_pods_model_is_refused(tmp_path):
    """`molt up` passes --model.path to every service: a policy from another directory would train other weights
    than the pods serve. The same directory spelled two ways is fine."""
    with pytest.raises(ValueError, match="--actor.model_name_or_path m and --model.path other name different"):
        validate_settings(_settings("--model.path", "other"))
    (tmp_path / "m").mkdir()
    s = parse_settings(
        TrainerSettings,
        [
            "--actor.model_name_or_path",
            str(tmp_path / "m"),
            "--model.path",
            f"{tmp_path}/./m/",
            "--train.dispatch",
            "false",
        ],
        environ={},
    )
    validate_settings(s)
    assert s.actor.model_name_or_path == str(tmp_path / "m")
