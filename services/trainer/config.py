"""Trainer settings: Molt's flag names and defaults, plus what a networked trainer adds.

Flags read as in Molt (``--actor.adam.lr``, ``--algo.advantage.estimator``, ``--train.async_queue_size``).
Additions, each because the services design needs it: ``--train.dispatch`` (consume the stream only),
``--train.num_steps``, ``--logger.steps_jsonl``, ``--envs.*`` (env worker URLs), ``--rollout.urls`` /
``--rollout.grpc_targets`` (pods to push weights to), ``--fsdp.strategy``, ``--redis.*``, ``--server.*``,
``--metrics.port``. The cross-flag rules, applied once after parsing, are services/trainer/checks.py's.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field, field_validator

from molt.algorithms import (
    ActorLossConfig,
    AlgoConfig,
    CriticLossConfig,
    RewardConfig,
)
from molt.config import (
    HostPort,
    MetricsConfig,
    ModelConfig,
    RedisConfig,
    Section,
    ServerConfig,
    ServiceUrl,
    split_list,
)
from services.trainer.optim_config import AdamConfig, LoraConfig, OptimizerConfig, checkpoint_mode


class ActorConfig(ActorLossConfig, OptimizerConfig):
    model_name_or_path: str | None = None
    """Local HF model directory of the policy (required)."""
    gradient_checkpoint: str = "full"
    """Activation checkpointing of every decoder layer: full (recompute in backward) or none/off/false/0/''
    (off), as Molt spells them; Molt's 'selective' (per-op) is not offered."""
    freeze_moe_router: bool = False
    """Exclude MoE router (gate) weights from the optimizer and from weight sync."""
    freeze_visual_encoder: bool = False
    """Vision-language policy: exclude the vision tower from the optimizer and from weight sync."""
    freezing_steps: int = Field(0, ge=0)
    """gae only: the actor is not updated for the first N steps (critic warmup)."""
    aux_loss_coef: float = Field(0.0, ge=0.0)
    """MoE load-balancing loss coefficient (HF router aux loss), 0 = off."""
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("gradient_checkpoint", mode="before")
    @classmethod
    def _ac(cls, v):
        return checkpoint_mode(v)


class CriticAdam(AdamConfig):
    lr: float = Field(5e-6, gt=0.0)
    """Critic AdamW learning rate."""


class CriticConfig(CriticLossConfig, OptimizerConfig):
    adam: CriticAdam = Field(default_factory=CriticAdam)
    model_name_or_path: str | None = None
    """Critic backbone (a value head is added). Unset: the actor's path."""
    freeze_moe_router: bool = False
    """Freeze the critic's MoE routers."""
    max_epochs: int | None = Field(None, gt=0)
    """Passes the critic makes over each step's batch. Unset: --train.max_epochs (a PPO critic often wants more)."""


class RefConfig(Section):
    model_name_or_path: str | None = None
    """Reference model (the teacher for on_policy_distill). Unset: the actor's path. Loaded only when
    --algo.kl.init_coef > 0."""


class TrainConfig(Section):
    batch_size: int = Field(128, gt=0)
    """Samples per optimizer step (one window of micro-batches over all ranks)."""
    micro_batch_size: int = Field(1, gt=0)
    """Samples per forward/backward on one rank (without --train.dynamic_batch_enable)."""
    dynamic_batch_enable: bool = False
    """Cut each rank's micro-batches by tokens instead of samples: as many samples as fit --train.max_tokens_per_gpu
    (a longer sample alone). The loss is the same; memory follows the budget, not the longest sample."""
    max_tokens_per_gpu: int = Field(16192, gt=0)
    """Token budget of one training forward/backward with --train.dynamic_batch_enable (packed: the samples' tokens;
    padded: rows x the longest, rounded up by --train.dynamic_batch_pad_to_multiple)."""
    dynamic_batch_pad_to_multiple: int = Field(1, gt=0)
    """With --train.dynamic_batch_enable and padded micro-batches: pad each micro-batch's length up to a multiple of
    N, so compiled kernels see a few shapes instead of one per length; the token budget prices the padded length.
    Packed micro-batches (--fsdp.packing_samples) are unchanged."""
    max_epochs: int = Field(1, gt=0)
    """Passes over each rollout batch (PPO epochs)."""
    num_episodes: int = Field(1, gt=0)
    """Passes over the prompt dataset (dispatch mode)."""
    num_steps: int | None = Field(None, gt=0)
    """Stop after this many train steps (rollout batches). Unset: when the dataset is exhausted (dispatch) or
    never (stream-only; SIGTERM stops it)."""
    seed: int = 42
    """Seed for shuffling and initialisation."""
    force_on_policy: bool = False
    """The whole rollout batch is one window: exactly one optimizer step, old log-probs = current forward."""
    async_queue_size: int = Field(1, gt=0)
    """How many rollout batches may be generated ahead of the trainer (policy versions ahead)."""
    partial_rollout_enable: bool = False
    """Let rollouts continue across weight updates (the pods swap weights under running requests)."""
    force_sync_mode: bool = False
    """Strictly on-policy dispatch: batch k is dispatched only after step k-1's weights are pushed."""
    rollout_dump_dir: str | None = None
    """Also write each step's trajectories to <dir>/rollout_step<N>.msgpack (N: the step they train), for
    --train.rollout_replay_dir."""
    rollout_replay_dir: str | None = None
    """Train on <dir>/rollout_step<N>.msgpack, step after step, instead of generating: no episodes are
    dispatched and the stream is not read; the run ends at the first step without a file."""
    full_determinism_enable: bool = False
    """Reproducible training: every seed from --train.seed and deterministic torch kernels (warn-only where
    none exists; transformers.enable_full_determinism). `molt train-rl` also runs the pods' engines in-process,
    whose scheduling is then deterministic."""
    routing_replay: bool = False
    """Replay the rollout's MoE top-k expert choice (Trajectory routed_experts) in training forwards."""
    check_weight_update_equal: bool = False
    """After each weight push, every pod recomputes a fixed probe's prompt logprobs and refuses the new weights
    (keeping the previous ones, molt_weightsync_check_failures_total) if they differ from the trainer's."""
    pack_shared_prefix: bool = True
    """Compute each group's common prompt prefix once per micro-batch (rows of prefix + each sample's rest under
    a 4-D attention mask) and the LM head only at action steps. Same log-probs, fewer tokens; needs sdpa or eager
    attention (otherwise, and under routing replay, the plain padded layout is used)."""
    pack_max_tokens: int = Field(2048, gt=0)
    """Longest packed row in tokens; a group that does not fit is split over rows that repeat its prefix."""
    dispatch: bool = True
    """Drive rollouts: dispatch prompts to --envs.urls. False: only consume what others put on the stream."""
    plugins: list[str] = []
    """Modules or .py files imported at start-up, before validation: register custom advantage estimators and
    policy losses there (molt.algorithms.register_advantage_estimator / register_policy_loss)."""
    consumer: str = "trainer-0"
    """Consumer name in the Redis group; keep it stable across restarts to resume pending entries."""
    reclaim_idle_s: float = Field(300.0, gt=0.0)
    """Take over entries another consumer left pending for this long."""
    read_block_s: float = Field(1.0, gt=0.0)
    """Longest wait for new stream entries in one read."""


class WandbConfig(Section):
    key: str | None = None
    """W&B API key; set, the run logs to W&B (as Molt). Unset: W&B only with --logger.wandb.mode offline."""
    mode: Literal["online", "offline"] = "online"
    """offline: write the W&B run locally (wandb sync uploads it later); needs no key."""
    org: str | None = None
    """W&B entity."""
    group: str | None = None
    """W&B run group."""
    project: str = "molt_train_rl"
    """W&B project."""
    run_name: str | None = None
    """Run name (W&B run, TensorBoard subfolder). Unset: rl_<MMDD>T<HH:MM>."""
    dir: str | None = None
    """Where W&B writes its files (the wandb/ folder). Unset: the working directory."""


class LoggerConfig(Section):
    steps_jsonl: str | None = None
    """Append one JSON line per train step (step, policy_version, reward_mean, mismatch_kl, staleness_mean,
    samples, seconds, losses, the mean of each Result.info key, and the trajectory ids trained) to this file."""
    logging_steps: int = Field(1, gt=0)
    """Log to TensorBoard / W&B every N steps (the JSONL file gets every step)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard event files to <dir>/<run_name> (scalars train/<key>, eval/<key>)."""
    eval_jsonl: str | None = None
    """Append one JSON line per evaluation (step and the eval_* metrics) to this file."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)


class RolloutConfig(Section):
    batch_size: int = Field(1024, gt=0)
    """Prompt groups per train step."""
    n_samples_per_prompt: int = Field(1, gt=0)
    """Rollouts per prompt (group size)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; training log-probs are computed on logits / temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling (must be 1.0 with IS correction)."""
    max_new_tokens: int | None = Field(None, gt=0)
    """Max tokens per generation turn. Unset: the remaining context."""
    max_tokens_per_gpu: int | None = Field(None, gt=0)
    """Token budget of the no-grad forwards (old and reference log-probs, values) with --train.dynamic_batch_enable.
    Unset: --train.max_tokens_per_gpu."""
    vllm_generate_batch_size: int | None = Field(None, gt=0)
    """Most prompt groups in flight at once (Molt's in-flight capacity). Unset: as many as the policy-version
    bound (--train.async_queue_size) lets dispatch run ahead."""
    urls: list[ServiceUrl] = []
    """Rollout pod base URLs (http://host:port), space- or comma-separated (weights are pushed to them after every
    step; their gRPC ports come from /readyz)."""
    grpc_targets: list[HostPort] = []
    """Explicit HOST:PORT weight-sync targets (overrides discovery through --rollout.urls)."""
    startup_wait_s: float = Field(600.0, ge=0)
    """At start-up: how long to wait for a --rollout.urls pod that does not answer /readyz yet (its engine still
    loading, or it restarts), retrying with backoff and reporting not ready meanwhile; then the trainer exits."""

    @field_validator("urls", "grpc_targets", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return split_list(v)


class EnvsConfig(Section):
    urls: list[ServiceUrl] = []
    """Env worker base URLs (http://host:port; POST /v1/episodes:run), space- or comma-separated; requests are
    spread over them."""

    @field_validator("urls", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return split_list(v)

    agent: str = "default"
    """Agent name sent with every episode."""
    max_inflight: int = Field(64, gt=0)
    """Episodes in flight per worker."""
    max_retries: int = Field(6, ge=0)
    """Retries of a failed episode (one that ran and wrote no trajectory), with backoff. An unreachable worker
    is not a failure: episodes wait for it however long it is down."""
    max_consecutive_failures: int = Field(64, ge=0)
    """Stop the run with the last failure's error once this many training episodes in a row failed for good (each
    after its retries) with none written between them: an env that raises on every episode. 0: never stop."""
    retry_backoff_s: float = Field(1.0, gt=0.0)
    """First wait before retrying a failed episode or an unreachable worker; doubles on each retry."""
    retry_backoff_max_s: float = Field(30.0, gt=0.0)
    """Cap of that wait."""
    timeout_s: float | None = Field(None, gt=0.0)
    """HTTP timeout of one episode. Unset: each env worker's --envs.episode_timeout_s + --envs.finish_retry_s (read
    from its /readyz) + 60 s (one that reports none: the longest another reported, else 960). A value below a
    worker's is raised to it with a warning: cut off first, an episode still finishing is run again (its work
    lost, a second trajectory dropped)."""


class DataConfig(Section):
    prompt_dataset: str | None = None
    """Prompt dataset: a datasets.save_to_disk directory, a parquet / JSONL / JSON file, or a folder of them;
    several comma-separated are concatenated (or mixed by --data.prompt_probs)."""
    prompt_probs: str | None = None
    """Comma-separated sampling weights, one per prompt dataset (each gives its share of --data.max_samples)."""
    prompt_split: str = "train"
    """Split to read from a saved DatasetDict, or from a folder whose file or folder names name splits (train,
    test, validation: as HF datasets reads a folder)."""
    input_key: str = "input"
    """Key of the prompt (a string or a list of chat messages)."""
    label_key: str | None = None
    """Key of the label handed to the env. Unset: label ""."""
    apply_chat_template: bool = False
    """Send string prompts as [{"role": "user", "content": prompt}] so the gateway renders the chat template."""
    max_len: int = Field(2048, gt=1)
    """Total context per trajectory (sent as max_length; longer sequences are cut for training)."""
    max_samples: int = Field(100_000_000, gt=0)
    """Use at most this many prompts."""
    tools_key: str | None = None
    """Key of the row's tool schemas (OpenAI function list, or its JSON string), sent to the agent as tools."""
    image_key: str = "images"
    """Key of the row's images (one or a list: PIL images, datasets Image values, bytes, paths or data URLs), sent
    to the agent as data URLs; read only with --data.max_images_per_prompt > 0."""
    max_images_per_prompt: int = Field(0, ge=0)
    """Most images a row may hold (a row with more is an error); 0: text-only, images are not read."""


class EvalConfig(Section):
    dataset: str | None = None
    """Eval prompts (same formats and keys as --data.prompt_dataset, plus an optional datasource column)."""
    steps: int = -1
    """Evaluate every N train steps (-1: never)."""
    split: str = "train"
    """Split to read from a saved DatasetDict, or from a folder whose file or folder names name splits (train,
    test, validation: as HF datasets reads a folder)."""
    n_samples_per_prompt: int | None = Field(None, gt=0)
    """Episodes per eval prompt. Unset: --rollout.n_samples_per_prompt."""
    temperature: float | None = Field(None, ge=0.0)
    """Eval sampling temperature. Unset: --rollout.temperature."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    """Eval nucleus sampling. Unset: --rollout.top_p."""
    max_new_tokens: int | None = Field(None, gt=0)
    """Eval per-turn cap. Unset: --rollout.max_new_tokens."""
    eval_at_start: bool = False
    """Also evaluate before the first step of a fresh run (a baseline)."""
    batch_size: int | None = Field(None, gt=0)
    """Eval prompts whose episodes run at once. Unset: --rollout.batch_size."""
    eval_only: bool = False
    """Evaluate the policy once on --eval.dataset and exit without training: the model at
    --actor.model_name_or_path, or the checkpoint --ckpt.load_enable resumes. No --data.prompt_dataset needed."""


class FsdpConfig(Section):
    strategy: Literal["auto", "nemo", "torch"] = "auto"
    """Sharding code: nemo (NeMo AutoModel's fsdp2_strategy_parallelize), torch (fully_shard per decoder layer +
    root), auto (nemo when importable)."""
    tp_size: int = Field(1, gt=0)
    """Tensor parallel size (GPU, NeMo AutoModel)."""
    cp_size: int = Field(1, gt=0)
    """Context parallel size (must be 1 for now: inputs are not sequence-sharded)."""
    ep_size: int = Field(1, gt=0)
    """Expert parallel size (GPU, NeMo AutoModel)."""
    pp_size: int = Field(1, gt=0)
    """Pipeline parallel size (must be 1)."""
    offload: Literal["none", "optimizer", "full"] = "none"
    """CPU offload (GPU, NeMo AutoModel)."""
    param_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Mixed-precision parameter dtype on GPU (master weights fp32). CPU runs fp32 throughout."""
    attn_implementation: str | None = None
    """Attention kernel. Unset: flash_attention_2 on GPU where flash-attn is installed, else sdpa."""
    sequence_parallel: bool = False
    """Sequence parallelism inside the tensor-parallel region (needs --fsdp.tp_size > 1; GPU, NeMo AutoModel)."""
    bf16_master_weights: bool = False
    """Store the policy's weights (and so its optimizer state) in bf16 instead of fp32, for kernels that compute in
    the stored dtype (Molt's DeepSeek-V4 recipe). GPU, NeMo AutoModel only."""
    use_liger_kernel: bool = False
    """Liger's fused Triton kernels (NeMo AutoModel on GPU; dense text models). Off unless set, as in Molt: NeMo's
    own loader would otherwise apply them by default."""
    packing_samples: bool = False
    """Molt's padding-free packing of a micro-batch's samples into rows. Here it turns on
    --train.pack_shared_prefix (rows under a 4-D mask, each group's prompt computed once; sdpa / eager attention;
    with flash attention the learner keeps padded micro-batches and logs why)."""


class CkptConfig(Section):
    path: str = "./ckpt/checkpoints_rl_ray"
    """Checkpoint root; steps go to <path>/global_step<N>, <path>/latest names the newest."""
    save_steps: int = -1
    """Save every N steps (-1: never; then trajectories are acked right after their step)."""
    load_enable: bool = False
    """Resume from the latest checkpoint under --ckpt.path when there is one."""
    max_num: int = 3
    """Checkpoints to keep (<= 0 keeps all): the HF snapshots of --ckpt.save_hf (the newest) and, unless
    --ckpt.dcp_max_num is set, the resumable ones (see --ckpt.max_mem for which go)."""
    dcp_max_num: int | None = None
    """Resumable checkpoints (model, optimizer, data position) to keep. Unset: --ckpt.max_num."""
    max_mem: float = math.inf
    """Disk budget in GB (1024^3 bytes, fractions allowed) for the resumable checkpoints and the best one. Past it,
    or past --ckpt.dcp_max_num (else --ckpt.max_num) of them, resumable checkpoints are removed as Molt does: first
    those with no metric (saved before any evaluation), then the lowest --ckpt.best_metric_key value (higher is
    better), then the oldest; never the newest one nor the best one (a warning when that still exceeds it)."""
    output_dir: str | None = None
    """Where the final policy is written as an HF model directory (config, safetensors, tokenizer, chat template)
    at the end of the run. Unset: the folder holding --ckpt.path (Molt's ./ckpt with the default path)."""
    disable_final_save: bool = False
    """Do not write the final HF model directory."""
    save_hf: bool = False
    """Also write an HF model directory with every checkpoint, to <path>/_hf/global_step<N> (pruned like them)."""
    best_metric_key: str = ""
    """Eval metric whose best value so far is kept as a checkpoint, <path>/best_global_step<N> (only the best one;
    resuming ignores it). Empty: the first eval_*_pass1 metric; 'none': no best checkpoint."""

    def final_dir(self) -> str:
        return self.output_dir or os.path.dirname(os.path.abspath(self.path))

    def resumable_max(self) -> int:
        return self.max_num if self.dcp_max_num is None else self.dcp_max_num

    def check(self) -> None:
        """Retention flags out of range (``ValueError``)."""
        if not self.max_mem > 0:  # NaN fails too
            raise ValueError(f"--ckpt.max_mem must be > 0 GB (inf: no budget), got {self.max_mem}")


class TrainerSettings(Section):
    """Molt Services trainer: FSDP2 learner over the trajectory stream (python -m services.trainer)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    envs: EnvsConfig = Field(default_factory=EnvsConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    local_rank: int = -1
    """Set by old torch.distributed.launch; the rank comes from the environment."""
    use_ms: bool = False
    """Resolve models from the ModelScope hub (refused: nothing is downloaded; pass a local directory)."""


def planned_optimizer_steps(s: TrainerSettings, num_prompts: int | None) -> int:
    """Scheduler horizon: train steps (--train.num_steps, else the dataset's prompts / --rollout.batch_size,
    else 1000) x windows per step x --train.max_epochs."""
    t, r = s.train, s.rollout
    steps = t.num_steps or (math.ceil(num_prompts * t.num_episodes / r.batch_size) if num_prompts else 1000)
    return max(1, steps * optimizer_steps_per_train_step(s))


def optimizer_steps_per_train_step(s: TrainerSettings) -> int:
    """Optimizer steps one train step takes: its windows (--train.batch_size each) x --train.max_epochs."""
    t, r = s.train, s.rollout
    windows = 1 if t.force_on_policy else math.ceil(r.batch_size * r.n_samples_per_prompt / t.batch_size)
    return windows * t.max_epochs


def actor_schedule_steps(s: TrainerSettings, total_steps: int) -> int:
    """The actor's scheduler horizon: as Molt, the optimizer steps it actually takes, so without the train steps
    it is frozen for the critic's warmup (--actor.freezing_steps, gae); the critic keeps ``total_steps``."""
    if not needs_critic(s) or not s.actor.freezing_steps:
        return total_steps
    return max(1, total_steps - s.actor.freezing_steps * optimizer_steps_per_train_step(s))


def max_versions_ahead(t: TrainConfig) -> int:
    """How far dispatch may run ahead of the trainer's policy version (0 = strictly on-policy)."""
    return 0 if t.force_sync_mode else t.async_queue_size


def needs_reference(s: TrainerSettings) -> bool:
    return s.algo.resolved_kl_coef() > 0


def needs_critic(s: TrainerSettings) -> bool:
    return s.algo.advantage.estimator == "gae"
