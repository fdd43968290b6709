"""`molt train-rl` with the flags of Molt's launch scripts added after release 0.1.6: every flag is known,
routed, and parsed and validated by the service it goes to.

The flag lists are those of labs-molt's examples/scripts/quick_start/rl_flash_reinforce_r1d_1p5b.sh
(FlashREINFORCE), rl_qwen25_1p5b_bi.sh (batch-invariance smoke test) and rl_qwen3_4b_alfworld.sh (multi-turn
AlfWorld), with the shell variables at the scripts' defaults and paths made up.
"""

from __future__ import annotations

import pytest

from molt.config import parse_settings
from molt.stack import train_rl as tr
from services.rollout.config import RolloutSettings
from services.trainer.config import TrainerSettings, validate_settings

COMMON = (
    "--actor.model_name_or_path /models/policy --data.input_key prompt --data.apply_chat_template "
    "--rollout.micro_batch_size 1 --train.micro_batch_size 1 --train.max_epochs 1 --train.colocate_fsdp_models "
    "--actor.num_nodes 1 --ref.num_nodes 1 --vllm.sync_backend nccl --fsdp.param_dtype bf16 "
    "--reward.clip_range -10 10 "
    "--logger.logging_steps 1 --logger.wandb.project p --logger.wandb.run_name r "
    "--ckpt.output_dir /save/hf --ckpt.path /save/state "
)
SCRIPTS = {
    "rl_flash_reinforce_r1d_1p5b.sh": COMMON
    + "--data.prompt_dataset /data/train --data.label_key reward_model --data.max_samples 1460 --data.max_len 9216 "
    "--rollout.batch_size 128 --rollout.vllm_generate_batch_size 512 --rollout.n_samples_per_prompt 1 "
    "--rollout.max_new_tokens 8192 --rollout.temperature 1.0 --rollout.top_p 1.0 --train.batch_size 128 "
    "--train.num_episodes 1000 --train.async_queue_size 8 --train.partial_rollout_enable --train.force_on_policy "
    "--actor.num_gpus_per_node 1 --ref.num_gpus_per_node 1 --vllm.num_engines 7 --vllm.tensor_parallel_size 1 "
    "--vllm.gpu_memory_utilization 0.9 --fsdp.attn_implementation flash_attention_2 --fsdp.packing_samples "
    "--actor.gradient_checkpoint full --actor.adam.lr 1e-6 --actor.adam.weight_decay 0.1 "
    "--actor.lr_scheduler cosine_with_min_lr --actor.loss_agg_mode seq-mean-token-mean "
    "--algo.advantage.estimator flash_reinforce --algo.advantage.is_correction_level seq "
    "--algo.advantage.is_correction_gating binary_kl --algo.advantage.is_correction_threshold 5e-3 "
    "--algo.kl.init_coef 0 --train.agent_path /molt/examples/python/agents/math.py --eval.dataset /data/eval "
    "--eval.steps 128 --eval.n_samples_per_prompt 32 --eval.temperature 0.6 --eval.top_p 0.95 --eval.eval_at_start "
    "--ckpt.save_steps 50",
    "rl_qwen25_1p5b_bi.sh": COMMON
    + "--data.prompt_dataset /data/dapo.parquet --data.label_key reward_model --data.max_samples 4 "
    "--data.max_len 1024 "
    "--rollout.batch_size 4 --rollout.vllm_generate_batch_size 4 --rollout.n_samples_per_prompt 1 "
    "--rollout.max_new_tokens 128 --rollout.temperature 1.0 --rollout.top_p 1.0 --train.batch_size 4 "
    "--train.num_episodes 1 --train.async_queue_size 1 --train.seed 42 --train.force_on_policy "
    "--train.force_sync_mode "
    "--train.full_determinism_enable --actor.num_gpus_per_node 2 --ref.num_gpus_per_node 2 --vllm.num_engines 2 "
    "--vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.8 --vllm.enable_prefix_caching "
    "--vllm.max_num_batched_tokens 8192 --fsdp.attn_implementation sdpa --fsdp.tp_size 1 --fsdp.ep_size 1 "
    "--fsdp.cp_size 1 --actor.gradient_checkpoint none --actor.adam.lr 1e-6 --actor.loss_agg_mode seq-mean-token-mean "
    "--algo.advantage.estimator flash_reinforce --algo.advantage.is_correction_level token "
    "--algo.advantage.is_correction_gating ratio --algo.advantage.is_correction_mode clip "
    "--algo.advantage.is_correction_threshold 0.0 1000.0 --algo.kl.init_coef 0 "
    "--train.agent_path /molt/examples/python/agents/math.py --ckpt.save_steps -1 --ckpt.disable_final_save "
    "--eval.steps -1",
    "rl_qwen3_4b_alfworld.sh": COMMON
    + "--data.prompt_dataset /data/train.jsonl --data.label_key label --data.max_samples 4800 --data.max_len 16384 "
    "--rollout.batch_size 16 --rollout.vllm_generate_batch_size 4 --rollout.n_samples_per_prompt 8 "
    "--rollout.max_new_tokens 32 --rollout.temperature 1.0 --train.batch_size 128 --train.num_episodes 1 "
    "--train.async_queue_size 2 --actor.num_gpus_per_node 4 --ref.num_gpus_per_node 4 --vllm.num_engines 1 "
    "--vllm.tensor_parallel_size 4 --vllm.gpu_memory_utilization 0.8 --vllm.disable_custom_all_reduce "
    "--vllm.distributed_executor_backend mp --fsdp.attn_implementation flash_attention_2 --fsdp.tp_size 1 "
    "--fsdp.ep_size 1 --fsdp.cp_size 1 --fsdp.packing_samples --actor.gradient_checkpoint full --actor.adam.lr 1e-6 "
    "--actor.eps_clip_low_high 0.2 0.27 --actor.dual_clip 10.0 --algo.advantage.estimator reinforce_baseline "
    "--algo.advantage.is_correction_level geo --algo.advantage.is_correction_threshold 0.99 1.01 --algo.kl.use_loss "
    "--algo.kl.estimator k2 --algo.kl.init_coef 0.001 --algo.dynamic_filtering_enable "
    "--algo.dynamic_filtering_range 0.01 0.99 --train.agent_path /molt/examples/python/agents/alfworld.py "
    "--eval.dataset /data/eval.jsonl --eval.steps 5 --eval.n_samples_per_prompt 1 --ckpt.save_steps 5 "
    "--logger.wandb.key local --logger.tensorboard_dir /save/tb",
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_newer_molt_scripts_route_and_each_service_accepts_its_part(script):
    r = tr.route(SCRIPTS[script].split(), "helm")
    # as molt up / the chart start it: dispatching to env workers
    trainer = parse_settings(
        TrainerSettings, r.trainer + ["--envs.urls", "http://envs:8002"], prog="trainer", environ={}
    )
    validate_settings(trainer)
    parse_settings(RolloutSettings, r.rollout, prog="rollout")
    tr.helm_values(r)


def test_flash_reinforce_reaches_the_trainer_as_molt_composes_it():
    r = tr.route(SCRIPTS["rl_flash_reinforce_r1d_1p5b.sh"].split(), "helm")
    s = parse_settings(TrainerSettings, r.trainer + ["--train.dispatch", "false"], prog="trainer", environ={})
    adv = s.algo.advantage
    assert (adv.estimator, adv.is_correction_level, adv.is_correction_gating) == (
        "flash_reinforce",
        "seq",
        "binary_kl",
    )
    assert adv.is_correction_threshold == [0.0, 5e-3]
    assert s.actor.loss_agg_mode == "seq-mean-token-mean" and s.train.force_on_policy


def test_full_determinism_reaches_the_trainer_and_runs_the_pods_engines_in_process():
    r = tr.route(SCRIPTS["rl_qwen25_1p5b_bi.sh"].split(), "helm")
    assert "--train.full_determinism_enable" in r.trainer
    pods = parse_settings(RolloutSettings, r.rollout, prog="rollout")
    assert pods.vllm.multiprocessing is False and pods.vllm.enable_prefix_caching


def test_disable_custom_all_reduce_reaches_the_pods():
    r = tr.route(SCRIPTS["rl_qwen3_4b_alfworld.sh"].split(), "helm")
    assert parse_settings(RolloutSettings, r.rollout, prog="rollout").vllm.disable_custom_all_reduce


@pytest.mark.parametrize(("value", "mode"), [("none", "off"), ("", "off"), ("off", "off"), ("full", "full")])
def test_molts_activation_checkpoint_spellings(value, mode):
    flags = ["--actor.model_name_or_path", "m", "--train.dispatch", "false", "--actor.gradient_checkpoint", value]
    assert parse_settings(TrainerSettings, flags, environ={}).actor.gradient_checkpoint == mode


def test_selective_activation_checkpointing_is_refused_with_the_alternatives():
    flags = [
        "--actor.model_name_or_path",
        "m",
        "--train.dispatch",
        "false",
        "--actor.gradient_checkpoint",
        "selective",
    ]
    with pytest.raises(ValueError, match="selective .* is not offered; use full"):
        validate_settings(parse_settings(TrainerSettings, flags, environ={}))


def test_eval_only_needs_the_eval_set_and_nothing_to_train_on():
    base = ["--actor.model_name_or_path", "m", "--envs.urls", "http://envs:8002", "--eval.eval_only"]
    with pytest.raises(ValueError, match="--eval.eval_only evaluates --eval.dataset"):
        validate_settings(parse_settings(TrainerSettings, base, environ={}))
    # no --data.prompt_dataset, no --eval.steps, and a group estimator with one sample per prompt: all fine
    s = parse_settings(
        TrainerSettings,
        [
            *base,
            "--eval.dataset",
            "e.jsonl",
            "--algo.advantage.estimator",
            "grpo",
            "--rollout.n_samples_per_prompt",
            "1",
        ],
        environ={},
    )
    validate_settings(s)
