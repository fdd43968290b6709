"""The trainer's cross-flag rules, applied once after parsing: ``validate_settings`` (Molt's rules and the
service's, refusing what the run would refuse, with a ``ValueError`` naming the flags) and ``check_datasets``
(the dataset files the flags name). ``--dry-run`` and ``molt up`` call them too, so a bad combination stops
before anything starts.
"""

from __future__ import annotations

import os

from molt.algorithms import get_advantage_estimator, validate_algo
from molt.algorithms.length_shaping import LengthShaping
from molt.data import check_dataset, mix_weights
from services.trainer.config import ActorConfig, TrainerSettings
from services.trainer.device import transformers_path_problem


def load_plugins(paths: list[str]) -> None:
    """Import ``--train.plugins`` (dotted module names or .py files) so their registrations exist."""
    import importlib
    import importlib.util
    from pathlib import Path

    for item in paths:
        if item.endswith(".py"):
            path = Path(item)
            if not path.exists():
                raise ValueError(f"--train.plugins: no such file {item}")
            spec = importlib.util.spec_from_file_location(f"molt_plugin_{path.stem}", path)
            assert spec is not None and spec.loader is not None  # a path ending in .py always has a source loader
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        else:
            try:
                importlib.import_module(item)
            except ImportError as exc:
                raise ValueError(f"--train.plugins: cannot import {item!r} ({exc})") from exc


def validate_settings(s: TrainerSettings, on_gpu: bool | None = None) -> list[str]:
    """Molt's cross-flag rules plus the service's; fills derived defaults; returns hints to log. ``on_gpu``
    (where the trainer runs, when known) adds the checks of what that device's loader refuses."""
    load_plugins(s.train.plugins)
    a_path, m_path = s.actor.model_name_or_path, s.model.path
    if a_path and m_path and os.path.realpath(a_path) != os.path.realpath(m_path):
        # `molt up` wires --model.path into every service; a policy from elsewhere would train other weights
        # than the pods serve (or fail at the first push, if the shapes differ).
        raise ValueError(
            f"--actor.model_name_or_path {a_path} and --model.path {m_path} name different models: the policy "
            "starts from the first, the pods serve the second; pass one of them, or the same directory to both"
        )
    if not s.actor.model_name_or_path:
        s.actor.model_name_or_path = s.model.path  # the shared --model.path block every service reads
    if not s.actor.model_name_or_path:
        raise ValueError("--actor.model_name_or_path (or --model.path) is required: a local HF model directory")
    if s.use_ms:
        raise ValueError(
            "--use_ms: nothing is downloaded here; pass a local model directory to --actor.model_name_or_path"
        )
    s.ckpt.check()
    c = s.ckpt
    if not c.output_dir and not c.disable_final_save and c.final_dir() == os.getcwd():
        # The export writes config.json, model.safetensors and the tokenizer files into that folder.
        raise ValueError(
            f"--ckpt.path {c.path}: the final model would be written to the folder holding it, the working "
            "directory, over any files of those names; pass --ckpt.output_dir DIR (or a --ckpt.path one level down)"
        )
    t = s.train
    if s.fsdp.packing_samples:
        t.pack_shared_prefix = True
    # Combinations Molt accepts and this trainer reads one way: said at start-up, not refused, so Molt's
    # scripts run as they are.
    notes: list[str] = []
    if t.force_sync_mode and t.async_queue_size > 1:
        notes.append(
            f"--train.force_sync_mode dispatches strictly on-policy: --train.async_queue_size {t.async_queue_size} "
            "has no effect"
        )
    if t.force_on_policy and t.max_epochs != 1:
        raise ValueError(f"--train.force_on_policy needs --train.max_epochs 1 (got {t.max_epochs})")
    if t.routing_replay and t.partial_rollout_enable:
        raise ValueError(
            "--train.routing_replay cannot be combined with --train.partial_rollout_enable: routing "
            "captured by the rollout engine is lost on preemption; disable one of them"
        )
    if s.fsdp.pp_size != 1:
        raise ValueError(f"--fsdp.pp_size must be 1 (got {s.fsdp.pp_size}); pipeline parallelism is not supported")
    if s.fsdp.cp_size != 1:
        raise ValueError(
            f"--fsdp.cp_size {s.fsdp.cp_size}: context parallelism needs sequence sharding of the "
            "inputs, which this trainer does not do yet; use --fsdp.cp_size 1"
        )
    if s.fsdp.sequence_parallel and s.fsdp.tp_size == 1:
        raise ValueError("--fsdp.sequence_parallel shards activations inside TP: it needs --fsdp.tp_size > 1")
    if t.batch_size % t.micro_batch_size:
        raise ValueError(
            f"--train.batch_size {t.batch_size} must be a multiple of --train.micro_batch_size {t.micro_batch_size}"
        )
    if on_gpu is False or (on_gpu and s.fsdp.strategy == "torch"):
        problem = transformers_path_problem(s.fsdp)
        if problem:
            raise ValueError(problem)
    if on_gpu is False and s.fsdp.attn_implementation not in (None, "sdpa", "eager"):
        raise ValueError(
            f"--fsdp.attn_implementation {s.fsdp.attn_implementation} needs GPUs; on CPU use sdpa (or leave it unset)"
        )
    if s.actor.gradient_checkpoint == "selective":
        raise ValueError(
            "--actor.gradient_checkpoint selective (per-op activation checkpointing) is not offered; use full "
            "(every decoder layer) or none"
        )
    for name, opt in (("actor", s.actor), ("critic", s.critic)):
        if len(opt.adam.betas) != 2:
            raise ValueError(f"--{name}.adam.betas takes two values B1 B2, got {opt.adam.betas}")
        if opt.optim == "muon" and s.fsdp.offload != "none":
            raise ValueError(
                f"--{name}.optim muon with --fsdp.offload {s.fsdp.offload}: offloaded optimizer steps are AdamW only"
            )
    check_actor_lora(s.actor)
    if s.algo.advantage.estimator == "on_policy_distill" and not s.ref.model_name_or_path:
        raise ValueError("--algo.advantage.estimator on_policy_distill needs a teacher: set --ref.model_name_or_path")
    if s.eval.eval_only and not s.eval.dataset:
        raise ValueError("--eval.eval_only evaluates --eval.dataset: set it (same formats as --data.prompt_dataset)")
    if t.dispatch:
        if not s.data.prompt_dataset and not s.eval.eval_only:
            raise ValueError(
                "--train.dispatch needs --data.prompt_dataset (a dataset directory or file); or pass "
                "--train.dispatch false to train only on what others put on the stream"
            )
        if not s.envs.urls:
            raise ValueError("--train.dispatch needs --envs.urls (env worker base URLs); or --train.dispatch false")
    if s.eval.dataset and not t.dispatch:
        raise ValueError("--eval.dataset runs episodes on --envs.urls, which needs --train.dispatch")
    if s.data.prompt_dataset:
        mix_weights(s.data.prompt_dataset, s.data.prompt_probs, "--data.prompt_dataset")
    if s.eval.dataset and s.eval.steps <= 0 and not (s.eval.eval_at_start or s.eval.eval_only):
        notes.append("--eval.dataset is never evaluated: --eval.steps is off (add --eval.steps N to evaluate)")
    if s.actor.freezing_steps and s.algo.advantage.estimator != "gae":
        notes.append(
            "--actor.freezing_steps is a critic warmup: without the gae estimator there is none, it is ignored"
        )
    get_advantage_estimator(s.algo.advantage.estimator)
    problems = LengthShaping.of(s.reward, s.data.max_len).problems()
    if problems:
        raise ValueError("; ".join(problems))
    return notes + validate_algo(
        s.algo,
        s.actor,
        s.rollout.n_samples_per_prompt,
        t.async_queue_size,
        t.partial_rollout_enable,
        s.rollout.top_p,
        eval_only=s.eval.eval_only,
    )


def check_datasets(s: TrainerSettings) -> None:
    """The datasets this run reads (--data.prompt_dataset with --train.dispatch, --eval.dataset), checked cheaply
    with ``molt.data.check_dataset``: a ``ValueError`` naming the flag. Kept out of ``validate_settings``, which
    also checks Helm values away from the files they name; the service runs it at parse time, so a bad dataset
    ends in one line with status 2 (``--dry-run`` too) instead of after the model has loaded."""
    d = s.data
    keys = {"--data.input_key": d.input_key, "--data.label_key": d.label_key}
    if d.prompt_dataset and s.train.dispatch:
        check_dataset(d.prompt_dataset, d.prompt_split, keys, "--data.prompt_dataset")
    if s.eval.dataset:
        check_dataset(s.eval.dataset, s.eval.split, keys, "--eval.dataset")


def check_actor_lora(a: ActorConfig) -> None:
    """``--actor.lora.*`` combinations the RL learner does not offer (``ValueError`` naming the flags)."""
    if a.lora.rank == 0:
        return
    if a.optim == "muon":
        # Muon orthogonalises a weight's whole update; on the factors A (rank x in) and B (out x rank) it does
        # neither that for B @ A nor keep the step size independent of the rank (its sqrt(rows/cols) scale).
        raise ValueError(
            f"--actor.optim muon with --actor.lora.rank {a.lora.rank}: Muon's update is defined on whole weight "
            "matrices, not on LoRA's low-rank factors; use --actor.optim adam"
        )
    if a.lora.dropout > 0:
        # The policy's log-probs (old, rollout, training forward) must all be those of the weights the pods
        # serve: a dropped-out branch would move the importance ratios off 1 on-policy and clip at random.
        raise ValueError(
            f"--actor.lora.dropout {a.lora.dropout:g}: RL's importance ratios compare the training forward "
            "with the rollout's log-probs, which dropout would perturb; use --actor.lora.dropout 0"
        )
