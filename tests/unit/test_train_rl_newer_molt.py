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
from molt.stack import train_rl_helm as trh
from services.rollout.config import RolloutSettings
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings

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
    trh.helm_values(r)


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


# Every flag of Molt 0.1.6's train_rl_ray that no launch script passes: routed, noted or refused with the reason.
def _route(*flags):
    return tr.route(["--actor.model_name_or_path", "/m", "--train.agent_path", "/a.py", *flags], "local", gpus=0)


def test_vllm_engine_flags_reach_the_pods():
    r = _route(
        *("--vllm.block_size", "32", "--vllm.enable_chunked_prefill", "--vllm.async_scheduling"),
        *("--vllm.decode_context_parallel_size", "1"),
    )
    pods = parse_settings(RolloutSettings, r.rollout, prog="rollout").vllm
    assert (pods.block_size, pods.enable_chunked_prefill, pods.async_scheduling) == (32, True, True)
    with pytest.raises(ValueError, match="decode context parallelism shards the KV cache over GPUs"):
        _route("--vllm.decode_context_parallel_size", "2")


def test_data_and_critic_flags_reach_the_trainer():
    r = _route(
        *("--data.prompt_dataset", "/a,/b", "--data.prompt_probs", "0.7,0.3", "--data.prompt_split", "test"),
        *("--critic.max_epochs", "4", "--eval.batch_size", "8", "--ckpt.best_metric_key", "eval_default_pass1"),
        *(
            "--train.dynamic_batch_enable",
            "--train.max_tokens_per_gpu",
            "4096",
            "--rollout.max_tokens_per_gpu",
            "8192",
            "--train.dynamic_batch_pad_to_multiple",
            "1024",
        ),
    )
    s = parse_settings(TrainerSettings, r.trainer + ["--train.dispatch", "false"], prog="trainer", environ={})
    assert (s.data.prompt_probs, s.data.prompt_split, s.critic.max_epochs) == ("0.7,0.3", "test", 4)
    assert (s.eval.batch_size, s.ckpt.best_metric_key) == (8, "eval_default_pass1")
    assert (s.train.dynamic_batch_enable, s.train.max_tokens_per_gpu, s.rollout.max_tokens_per_gpu) == (
        True,
        4096,
        8192,
    )
    assert s.train.dynamic_batch_pad_to_multiple == 1024  # a later Molt's flag (its replay-buffer tests)


def test_flags_without_a_counterpart_are_noted_or_refused_with_the_reason():
    r = _route(
        *("--data.dataloader_num_workers", "4", "--vllm.router_policy", "round_robin"),
    )
    notes = "\n".join(r.notes)
    assert "--vllm.router_policy: the gateway routes every session to one pod" in notes
    assert "--data.dataloader_num_workers" in notes
    with pytest.raises(ValueError) as err:
        _route("--data.disable_fast_tokenizer")
    msg = str(err.value)
    assert "--data.disable_fast_tokenizer: the gateway tokenizes with the model's fast tokenizer" in msg


def test_muon_settings_under_adamw_are_inert_and_reach_the_trainer_under_muon():
    """Molt's slurm scripts pass --actor.muon.* on every run, with --actor.optim adam."""
    r = _route("--actor.optim", "adam", "--actor.muon.lr", "0.02", "--actor.muon.ns_steps", "5")
    assert "--actor.muon.lr: only read with --actor.optim muon; AdamW runs" in r.notes
    assert "--actor.muon.lr" not in r.trainer
    r = _route("--actor.optim", "muon", "--actor.muon.lr", "0.02")
    assert r.trainer[-4:] == ["--actor.optim", "muon", "--actor.muon.lr", "0.02"]


def test_vllm_kernel_choices_reach_the_pods():
    r = _route(
        *("--vllm.attention_backend", "TRITON_ATTN", "--vllm.mm_encoder_attn_backend", "TORCH_SDPA"),
        *("--vllm.gdn_prefill_backend", "triton", "--vllm.mamba_ssm_cache_dtype", "float32"),
        "--fsdp.param_dtype",
        "bf16",
    )
    v = parse_settings(RolloutSettings, r.rollout, prog="rollout").vllm
    assert (v.attention_backend, v.mm_encoder_attn_backend) == ("TRITON_ATTN", "TORCH_SDPA")
    assert (v.gdn_prefill_backend, v.mamba_ssm_cache_dtype) == ("triton", "float32")
    with pytest.raises(ValueError, match="--fsdp.bf16_master_weights: bf16 master weights are for NeMo AutoModel"):
        _route("--fsdp.bf16_master_weights")


def test_vllm_compilation_config_reaches_the_pods_as_an_object(capsys):
    """Molt after 0.1.6 takes --vllm.compilation_config as JSON (vLLM's CompilationConfig); so do the pods, from
    the command line, the environment and Helm values (an object there)."""
    cc = '{"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}'
    r = _route("--vllm.compilation_config", cc)
    assert r.rollout[-2:] == ["--vllm.compilation_config", cc]
    v = parse_settings(RolloutSettings, r.rollout, prog="rollout").vllm
    assert v.compilation_config == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}
    env = {"MOLT_VLLM__COMPILATION_CONFIG": '{"mode": 0}'}
    assert parse_settings(RolloutSettings, [], prog="rollout", environ=env).vllm.compilation_config == {"mode": 0}
    helm = ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a.py", "--vllm.compilation_config", cc]
    values = trh.helm_values(tr.route(helm, "helm"))
    assert values["rollout"]["extraArgs"][-2:] == ["--vllm.compilation_config", cc]
    assert RolloutSettings.model_validate({"vllm": {"compilation_config": {"mode": 0}}}).vllm.compilation_config
    for bad, why in (("{mode: 0}", "not JSON"), ("[1, 2]", "must be a JSON object")):
        with pytest.raises(SystemExit):
            parse_settings(RolloutSettings, ["--vllm.compilation_config", bad], prog="rollout")
        assert f"--vllm.compilation_config {bad}: {why}" in capsys.readouterr().err


# The name of every option of Molt 0.1.6's `python -m molt.cli.train_rl_ray` (its argparse parser).
MOLT_0_1_6_FLAGS = (
    "actor.aux_loss_coef actor.dual_clip actor.entropy_coef actor.eps_clip_low_high actor.freeze_moe_router "
    "actor.freeze_visual_encoder actor.freezing_steps actor.gradient_checkpoint actor.loss_mode "
    "actor.model_name_or_path actor.num_gpus_per_node actor.num_nodes algo.advantage.estimator "
    "algo.advantage.gamma algo.advantage.is_correction_level algo.advantage.is_correction_mode "
    "algo.advantage.is_correction_threshold algo.advantage.lam algo.advantage.no_whiten "
    "algo.dynamic_filtering_enable algo.dynamic_filtering_range algo.kl.estimator algo.kl.horizon "
    "algo.kl.init_coef algo.kl.target algo.kl.use_loss ckpt.best_metric_key ckpt.warm_resume_rollouts "
    "critic.freeze_moe_router critic.max_epochs critic.model_name_or_path critic.value_clip "
    "data.apply_chat_template data.dataloader_num_workers data.disable_fast_tokenizer data.image_key "
    "data.input_key data.label_key data.max_images_per_prompt data.max_len data.max_samples data.prompt_dataset "
    "data.prompt_probs data.prompt_split data.tools_key eval.batch_size eval.dataset eval.eval_at_start "
    "eval.eval_only eval.max_new_tokens eval.n_samples_per_prompt eval.split eval.steps eval.temperature "
    "eval.top_p ref.model_name_or_path ref.num_gpus_per_node ref.num_nodes reward.clip_range rollout.batch_size "
    "rollout.max_new_tokens rollout.max_tokens_per_gpu rollout.micro_batch_size rollout.n_samples_per_prompt "
    "rollout.num_runners rollout.temperature rollout.top_p rollout.vllm_generate_batch_size train.agent_path "
    "train.async_queue_size train.batch_size train.check_weight_update_equal train.colocate_fsdp_models "
    "train.dynamic_batch_enable train.force_on_policy train.force_sync_mode train.full_determinism_enable "
    "train.max_epochs train.max_tokens_per_gpu train.micro_batch_size train.num_episodes "
    "train.partial_rollout_enable train.rollout_dump_dir train.rollout_replay_dir train.routing_replay train.seed "
    "vllm.async_scheduling vllm.attention_backend vllm.block_size vllm.data_parallel_size "
    "vllm.decode_context_parallel_size vllm.disable_custom_all_reduce vllm.distributed_executor_backend "
    "vllm.dtype vllm.enable_chunked_prefill vllm.enable_expert_parallel vllm.enable_prefix_caching "
    "vllm.enforce_eager vllm.gdn_prefill_backend vllm.gpu_memory_utilization vllm.mamba_ssm_cache_dtype "
    "vllm.max_num_batched_tokens vllm.mm_encoder_attn_backend vllm.mtp_num_speculative_tokens vllm.num_engines "
    "vllm.pipeline_parallel_size vllm.router_policy vllm.sync_backend vllm.tensor_parallel_size"
).split()


def test_every_option_of_molt_0_1_6_train_rl_ray_is_known():
    every = tr.trainer_flag_names() | tr.POD_FLAGS | set(tr.PLACEMENT) | set(tr.MISSING) | tr.WIRING
    every |= {"actor.num_nodes", "actor.num_gpus_per_node"}
    assert len(MOLT_0_1_6_FLAGS) == 109
    assert sorted(set(MOLT_0_1_6_FLAGS) - every) == []


# The flag names of labs-molt's later slurm launchers (rl_qwen3_6_35b.sh as rl_muse_glimmer_30b.sh and
# rl_qwen3_6.sh run it, rl_deepseek_v4_flash.sh, rl_qwen3_5_397b.sh), every branch of their RL_ARGS taken.
LATER_SLURM_FLAGS = """
actor.model_name_or_path data.prompt_dataset data.input_key data.label_key data.tools_key data.apply_chat_template
data.image_key data.max_images_per_prompt data.max_samples data.max_len rollout.batch_size
rollout.vllm_generate_batch_size rollout.micro_batch_size rollout.n_samples_per_prompt rollout.max_new_tokens
rollout.temperature rollout.top_p train.batch_size train.micro_batch_size train.max_epochs train.num_episodes
train.async_queue_size train.colocate_fsdp_models train.routing_replay actor.num_nodes actor.num_gpus_per_node
ref.num_nodes ref.num_gpus_per_node vllm.num_engines vllm.tensor_parallel_size vllm.data_parallel_size
vllm.pipeline_parallel_size vllm.sync_backend vllm.gpu_memory_utilization vllm.mm_encoder_attn_backend
vllm.gdn_prefill_backend vllm.mamba_ssm_cache_dtype vllm.distributed_executor_backend
vllm.mtp_num_speculative_tokens vllm.enable_prefix_caching fsdp.param_dtype fsdp.attn_implementation fsdp.tp_size
fsdp.ep_size fsdp.cp_size actor.gradient_checkpoint actor.optim actor.adam.lr actor.adam.betas
actor.adam.weight_decay actor.muon.lr actor.muon.momentum actor.muon.weight_decay actor.muon.ns_steps
actor.eps_clip_low_high actor.dual_clip actor.aux_loss_coef actor.entropy_coef algo.advantage.estimator
critic.model_name_or_path algo.advantage.is_correction_level algo.advantage.is_correction_threshold
algo.kl.use_loss algo.kl.estimator algo.kl.init_coef reward.clip_range ckpt.output_dir ckpt.path ckpt.save_steps
ckpt.max_num logger.logging_steps logger.wandb.project logger.wandb.run_name train.agent_path vllm.enforce_eager
vllm.attention_backend train.force_on_policy train.partial_rollout_enable fsdp.offload fsdp.sequence_parallel
vllm.enable_expert_parallel fsdp.bf16_master_weights actor.freeze_visual_encoder actor.freeze_moe_router
ckpt.load_enable eval.dataset eval.steps eval.n_samples_per_prompt eval.eval_at_start algo.dynamic_filtering_enable
algo.dynamic_filtering_range ckpt.disable_final_save logger.wandb.key
""".split()


def test_every_flag_name_of_molts_later_slurm_launchers_is_known():
    every = tr.trainer_flag_names() | tr.POD_FLAGS | set(tr.PLACEMENT) | set(tr.MISSING) | tr.WIRING
    every |= {"actor.num_nodes", "actor.num_gpus_per_node"}
    assert sorted(set(LATER_SLURM_FLAGS) - every) == []


# rl_muse_glimmer_30b.sh's run of the later rl_qwen3_6_35b.sh launcher, its RL_ARGS at the wrapper's defaults.
MUSE_GLIMMER = (
    "--actor.model_name_or_path /models/muse-glimmer-30b --data.prompt_dataset /data/geo3k/train "
    "--data.input_key prompt --data.label_key reward_model --data.tools_key tools --data.apply_chat_template "
    "--data.image_key images --data.max_images_per_prompt 1 --data.max_samples 65536 --data.max_len 8192 "
    "--rollout.batch_size 2 --rollout.vllm_generate_batch_size 8 --rollout.micro_batch_size 1 "
    "--rollout.n_samples_per_prompt 4 --rollout.max_new_tokens=2048 --rollout.temperature 1.0 --rollout.top_p 1.0 "
    "--train.batch_size 8 --train.micro_batch_size 1 --train.max_epochs 1 --train.num_episodes 1 "
    "--train.async_queue_size 1 --train.colocate_fsdp_models --actor.num_nodes 2 --actor.num_gpus_per_node 8 "
    "--ref.num_nodes 2 --ref.num_gpus_per_node 8 --vllm.num_engines 4 --vllm.tensor_parallel_size 2 "
    "--vllm.data_parallel_size 1 --vllm.sync_backend nccl --vllm.gpu_memory_utilization 0.85 "
    "--vllm.mm_encoder_attn_backend TORCH_SDPA --vllm.gdn_prefill_backend triton --vllm.mamba_ssm_cache_dtype auto "
    "--vllm.distributed_executor_backend mp --vllm.mtp_num_speculative_tokens 0 --fsdp.param_dtype bf16 "
    "--fsdp.attn_implementation sdpa --fsdp.tp_size 2 --fsdp.ep_size 1 --fsdp.cp_size 1 "
    "--actor.gradient_checkpoint full --actor.optim adam --actor.adam.lr 1e-6 --actor.adam.betas 0.9 0.98 "
    "--actor.adam.weight_decay 0.0 --actor.muon.lr 2e-4 --actor.muon.momentum 0.95 --actor.muon.weight_decay 0.0 "
    "--actor.muon.ns_steps 5 --actor.eps_clip_low_high 0.2 0.28 --actor.dual_clip 10.0 --actor.aux_loss_coef 0 "
    "--actor.entropy_coef 0.0 --algo.advantage.estimator reinforce_baseline --algo.advantage.is_correction_level geo "
    "--algo.advantage.is_correction_threshold 0.99 1.01 --algo.kl.use_loss --algo.kl.estimator k2 "
    "--algo.kl.init_coef 0.0 --reward.clip_range -10 10 --ckpt.output_dir /save/hf --ckpt.path /save/state "
    "--ckpt.save_steps 5 --ckpt.max_num 50 --logger.logging_steps 1 --logger.wandb.project molt_muse_glimmer_rl "
    "--logger.wandb.run_name muse_glimmer_rl_1 --train.agent_path /molt/examples/python/agents/chat_geo3k.py "
    "--vllm.enforce_eager --vllm.attention_backend TRITON_ATTN --train.force_on_policy "
    "--actor.freeze_visual_encoder --eval.dataset /data/geo3k/eval --eval.steps 5 --eval.n_samples_per_prompt 4"
)


def test_a_later_slurm_launcher_routes_to_helm_and_each_service_accepts_its_part():
    r = tr.route(MUSE_GLIMMER.split(), "helm")
    trainer = parse_settings(TrainerSettings, r.trainer + ["--envs.urls", "http://envs:8002"], environ={})
    validate_settings(trainer)
    pods = parse_settings(RolloutSettings, r.rollout, prog="rollout")
    values = trh.helm_values(r)
    assert trainer.fsdp.tp_size == 2 and trainer.actor.freeze_visual_encoder and trainer.actor.optim == "adam"
    assert pods.vllm.tensor_parallel_size == 2 and values["rollout"]["replicas"] == 4
