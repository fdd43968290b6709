"""`molt train-rl`: Molt's `python -m molt.cli.train_rl_ray` flag list, run on the local stack or emitted as
Helm values.

Each Molt flag is routed to the service that owns it: the trainer takes the learning flags (`--actor.*`,
`--algo.*`, `--data.*`, `--train.*`, `--ckpt.*`, `--logger.*`, ...), the rollout pods the engine flags
(`--vllm.enforce_eager`, ...), and a few flags wire the stack itself: `--actor.model_name_or_path` (every
service's model), `--train.agent_path` (the env workers' agent module, Molt's way of naming it),
`--vllm.num_engines` (rollout pods), `--rollout.num_runners` (env workers), `--data.max_len` (also the
pods' context, which the gateway's session budget follows); `--envs.episode_timeout_s` (not Molt's) goes to the
env workers, whose limit the trainer follows. Flags about Ray placement carry over where the
services have the same knob and are otherwise accepted with the reason printed. A flag that needs
hardware the target lacks (TP/CP/EP > 1, NCCL, flash-attention kernels, GPUs) is refused with a message
that says why; unknown flags get a did-you-mean. ``route`` is pure: tests check every flag of Molt's
launch scripts against it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from molt.config import suggest_flag
from molt.sampling import MAX_TOP_LOGPROBS
from molt.stack.gpus import FLAGS, GpuPlacement, place_stack

Target = Literal["local", "helm"]

# Env-worker flags. Molt has no episode limit, so long episodes (VLM agents, long tool runs) set one here; the
# trainer's dispatcher follows the workers' limit (read from their /readyz), so it is set once.
ENV_WORKER_FLAGS = {"envs.episode_timeout_s"}  # not Molt's: the env workers' wall-clock limit of one episode

# Rollout-pod engine flags with the same name and meaning on services.rollout.
POD_FLAGS = {
    "vllm.enforce_eager",
    "vllm.enable_prefix_caching",
    "vllm.gpu_memory_utilization",
    "vllm.tensor_parallel_size",
    "vllm.enable_expert_parallel",
    "vllm.mtp_num_speculative_tokens",
    "vllm.distributed_executor_backend",
    "vllm.dtype",
    "vllm.max_num_batched_tokens",
    "vllm.disable_custom_all_reduce",
    "vllm.block_size",
    "vllm.enable_chunked_prefill",
    "vllm.async_scheduling",
    "vllm.decode_context_parallel_size",
    "vllm.attention_backend",
    "vllm.mm_encoder_attn_backend",
    "vllm.gdn_prefill_backend",
    "vllm.mamba_ssm_cache_dtype",
    "vllm.compilation_config",
    "vllm.kv_cache_memory_bytes",  # not Molt's: the KV-cache size CPU pods need (see route)
    "vllm.max_logprobs",  # not Molt's: the pods' bound on --rollout.top_logprobs (see route)
}

# Flags Molt declares with argparse's BooleanOptionalAction: --no-<flag> turns them off.
NEGATABLE = {
    "vllm.enable_prefix_caching",
    "vllm.enable_chunked_prefill",
    "vllm.async_scheduling",
    "rollout.rescore_logprobs",
}

# Molt flags about Ray placement, and what each means for the services.
PLACEMENT = {
    "train.colocate_fsdp_models": "actor, reference and critic always share the trainer's ranks here",
    "ref.num_nodes": "the reference model runs inside the trainer's ranks",
    "ref.num_gpus_per_node": "the reference model runs inside the trainer's ranks",
    "rollout.micro_batch_size": "Molt only checks it at start-up; rollout batching is the pods' own",
    "vllm.sync_backend": "weights travel to the pods over gRPC (molt.weightsync), whatever the backend",
    "ckpt.warm_resume_rollouts": "finished but untrained rollouts are kept in the Redis stream and trained after "
    "a resume anyway",
    "data.dataloader_num_workers": "the trainer reads the prompt dataset once at start; there are no loader workers",
    "vllm.router_policy": "the gateway routes every session to one pod (least loaded, then sticky), whatever the "
    "policy",
}

# Molt flags the services do not offer (yet), with the reason; docs/trainer.md lists them too.
MISSING = {
    "vllm.data_parallel_size": "scale rollout with more pods (--vllm.num_engines) instead",
    "vllm.pipeline_parallel_size": "pipeline-parallel rollout pods are not supported",
    "data.disable_fast_tokenizer": "the gateway tokenizes with the model's fast tokenizer (transformers' default)",
}
# Values these flags take when they ask for nothing (accepted even where the feature is missing).
NEUTRAL = {
    "vllm.data_parallel_size": "1",
    "vllm.pipeline_parallel_size": "1",
    "data.disable_fast_tokenizer": "false",
}

# Molt flags that are the gateway's here: it renders every prompt and turn with the model's chat template.
GATEWAY_FLAGS = {
    "data.chat_template_kwargs": "gateway.default_chat_template_kwargs",
    "rollout.top_logprobs": "rollout.top_logprobs",  # the gateway asks the pods and records them
    "rollout.rescore_logprobs": "rollout.rescore_logprobs",  # the gateway re-reads them at finish
}

# Molt's other spelling of the LoRA flags (train_rl_ray.py's own, beside common_args' --actor.lora.*).
ALIASES = {
    "actor.lora_dim": "actor.lora.rank",
    "actor.lora_alpha": "actor.lora.alpha",
    "actor.lora_target_modules": "actor.lora.target_modules",
}

# Molt's earlier IS-correction switch: --algo.advantage.is_correction_enable with a type, where later releases
# name the level and the bound treatment; each type is the level and mode that compute the same weights.
LEGACY_IS_TYPES = {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("geo", "mask")}
LEGACY_IS_ENABLE, LEGACY_IS_TYPE = "algo.advantage.is_correction_enable", "algo.advantage.is_correction_type"
IS_LEVEL, IS_MODE = "algo.advantage.is_correction_level", "algo.advantage.is_correction_mode"


def legacy_is_flags(
    flags: list[tuple[str, list[str]]], notes: list[str]
) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """``flags`` with the earlier enable/type pair as ``is_correction_level`` / ``mode``, and the errors;
    what the pair became is added to ``notes``."""
    given = {name: values for name, values in flags}
    if LEGACY_IS_ENABLE not in given and LEGACY_IS_TYPE not in given:
        return flags, []
    kind = (given.get(LEGACY_IS_TYPE) or ["tis"])[0]
    if kind not in LEGACY_IS_TYPES:
        return flags, [f"--{LEGACY_IS_TYPE} {kind}: choose one of {', '.join(LEGACY_IS_TYPES)}"]
    if LEGACY_IS_ENABLE in given and {IS_LEVEL, IS_MODE} & given.keys():
        return flags, [
            f"--{LEGACY_IS_ENABLE} and --{IS_LEVEL} / --{IS_MODE} both set the IS correction: pass one spelling "
            f"(--{LEGACY_IS_TYPE} {kind} is --{IS_LEVEL} {LEGACY_IS_TYPES[kind][0]} --{IS_MODE} "
            f"{LEGACY_IS_TYPES[kind][1]})"
        ]
    out = [(n, v) for n, v in flags if n not in (LEGACY_IS_ENABLE, LEGACY_IS_TYPE)]
    if flag_on(given.get(LEGACY_IS_ENABLE, ["false"])):
        level, mode = LEGACY_IS_TYPES[kind]
        out += [(IS_LEVEL, [level]), (IS_MODE, [mode])]
        notes.append(f"--{LEGACY_IS_ENABLE} (type {kind}): --{IS_LEVEL} {level} --{IS_MODE} {mode}")
    else:  # as in Molt: the type alone turns nothing on
        notes.append(f"--{LEGACY_IS_TYPE} {kind}: no effect without --{LEGACY_IS_ENABLE}")
    return out, []


# The trainer's nodes and GPUs: its ranks on a local GPU machine (molt.stack.gpus), Helm's trainer placement.
TRAINER_PLACEMENT = {"actor.num_nodes", "actor.num_gpus_per_node"}
WIRING = {"actor.model_name_or_path", "train.agent_path", "vllm.num_engines", "rollout.num_runners"}
GPU_ATTENTION = {"flash_attention_2", "flash_attention_3", "te", "tilelang"}


@dataclass
class Routed:
    model: str | None = None
    agent_path: str | None = None
    num_pods: int = 1
    num_envs: int = 1
    trainer_gpus: int | None = None
    """--actor.num_gpus_per_node on a local GPU machine: the trainer's ranks (None: the GPUs the pods leave)."""
    trainer: list[str] = field(default_factory=list)
    rollout: list[str] = field(default_factory=list)
    gateway: list[str] = field(default_factory=list)
    envs: list[str] = field(default_factory=list)
    """The env workers' own flags (``ENV_WORKER_FLAGS``)."""
    notes: list[str] = field(default_factory=list)
    """What placement flags mean here (printed before the run)."""
    raw: dict[str, list[str]] = field(default_factory=dict)


def split_flags(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``--a.b 1 2 --c`` -> [("a.b", ["1", "2"]), ("c", [])]; ``--x=v`` works too."""
    out: list[tuple[str, list[str]]] = []
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name, eq, value = tok[2:].partition("=")
            out.append((name, [value] if eq else []))
        elif not out:
            raise ValueError(
                f"molt train-rl: {tok!r} is not a --flag; flags look like --actor.model_name_or_path PATH"
            )
        else:
            out[-1][1].append(tok)
    return out


def trainer_flag_names() -> set[str]:
    from pydantic import BaseModel

    from services.trainer.config import TrainerSettings

    def walk(model, prefix: str) -> set[str]:
        names = set()
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                names |= walk(ann, f"{prefix}{name}.")
            else:
                names.add(prefix + name)
        return names

    return walk(TrainerSettings, "")


def _int(name: str, values: list[str]) -> int:
    try:
        return int(values[0])
    except (IndexError, ValueError):
        raise ValueError(f"--{name} takes one integer, got {' '.join(values) or 'nothing'}") from None


def flag_seconds(name: str, values: list[str]) -> float:
    """A positive, finite number of seconds (ValueError naming the flag otherwise)."""
    try:
        value = float(values[0]) if len(values) == 1 else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"--{name} takes one number of seconds > 0 (e.g. 3600), got {' '.join(values) or 'nothing'}")
    return value


def flag_on(values: list[str]) -> bool:
    return not values or values[0].lower() in ("1", "true", "yes", "on")


def _refuse(name: str, values: list[str], target: Target, gpus: int) -> str | None:
    """Why this flag's value cannot run on ``target`` (None: it can)."""
    v = values[0] if values else ""
    if name in ("fsdp.tp_size", "fsdp.cp_size", "fsdp.ep_size") and v not in ("", "1"):
        if name == "fsdp.cp_size":
            return "context parallelism needs sequence-sharded inputs, which the trainer does not do yet"
        if target == "local" and gpus == 0:
            return f"{name.split('.')[1][:2].upper()} > 1 shards the model over GPUs; this machine has none"
    if name == "vllm.tensor_parallel_size" and target == "local" and v not in ("", "1") and gpus < int(v):
        return f"tensor-parallel rollout needs {v} GPUs per pod; this machine has {gpus}"
    if name == "vllm.decode_context_parallel_size" and target == "local" and v not in ("", "1") and gpus == 0:
        return "decode context parallelism shards the KV cache over GPUs; this machine has none"
    if name == "vllm.enable_expert_parallel" and target == "local" and flag_on(values) and gpus == 0:
        return "expert-parallel rollout shards experts over GPUs; this machine has none"
    if name == "vllm.sync_backend" and v == "nccl" and target == "local" and gpus == 0:
        return "NCCL needs GPUs (this machine has none); weights travel over gRPC here: drop the flag"
    if name == "fsdp.attn_implementation" and v in GPU_ATTENTION and target == "local" and gpus == 0:
        return f"{v} kernels need a GPU; use sdpa (the CPU default) or drop the flag"
    if name == "fsdp.bf16_master_weights" and flag_on(values) and target == "local" and gpus == 0:
        return "bf16 master weights are for NeMo AutoModel on GPUs; this machine has none (weights stay fp32)"
    if name == "fsdp.use_liger_kernel" and flag_on(values) and target == "local" and gpus == 0:
        return "Liger's kernels are Triton (GPU only); drop the flag on CPU"
    if name == "fsdp.offload" and v not in ("", "none") and target == "local" and gpus == 0:
        return "CPU offload is NeMo AutoModel's, for GPU runs; this machine has none (drop the flag)"
    gpu_count = name in ("actor.num_gpus_per_node", "ref.num_gpus_per_node")
    if gpu_count and target == "local" and _int(name, values) > gpus:
        if gpus == 0:
            return f"asks for {v} GPUs per node; this machine has none (the local trainer then runs on CPU: drop it)"
        return f"asks for {v} GPUs per node; this machine has {gpus}: lower it"
    if name in ("actor.num_nodes", "ref.num_nodes") and target == "local" and _int(name, values) > 1:
        return "the local stack runs on one machine; use --emit helm-values for a multi-node run"
    if name in MISSING and not (name in NEUTRAL and v == NEUTRAL[name]):
        return MISSING[name]
    return None


def _combination_errors(raw: dict[str, list[str]]) -> list[str]:
    """Molt's start-up refusals that span services (each service alone cannot see the other's flag)."""
    errors: list[str] = []
    for name, what in (("vllm.num_engines", "rollout pods"), ("rollout.num_runners", "env workers")):
        # Rollouts need both: with none of either the trainer would wait for episodes forever.
        if name in raw and raw[name][:1] and raw[name][0].lstrip("-").isdigit() and int(raw[name][0]) < 1:
            errors.append(f"--{name} {raw[name][0]}: RL rollouts need at least one ({what}); set it to 1 or more")
    mtp_values = raw.get("vllm.mtp_num_speculative_tokens", ["0"])[:1] or ["0"]
    mtp = mtp_values[0].isdigit() and int(mtp_values[0]) > 0
    # The pods' routed-experts capture and their cached-block reuse both misalign under speculative decoding,
    # so these runs train on corrupted rollout log-probs or routing: refused, as Molt refuses them.
    if mtp and "train.routing_replay" in raw and flag_on(raw["train.routing_replay"]):
        errors.append(
            "--vllm.mtp_num_speculative_tokens is incompatible with --train.routing_replay: the pods' "
            "routed-experts capture misaligns under speculative decoding; disable MTP or routing replay"
        )
    if mtp and "vllm.enable_prefix_caching" in raw and flag_on(raw["vllm.enable_prefix_caching"]):
        errors.append(
            "--vllm.mtp_num_speculative_tokens is incompatible with --vllm.enable_prefix_caching: speculative "
            "decoding corrupts rollout log-probs when prefix-cached blocks are reused; enable at most one"
        )
    head = _top_logprobs(raw)
    if "actor.score_centering" in raw and flag_on(raw["actor.score_centering"]) and head < 1:
        errors.append(
            "--actor.score_centering needs the sampler's top-k log-probs in every trajectory: pass "
            "--rollout.top_logprobs K >= 1 (e.g. 8)"
        )
    bound = (raw.get("vllm.max_logprobs") or [""])[0]
    if bound.isdigit() and int(bound) < head:
        errors.append(
            f"--vllm.max_logprobs {bound} is below --rollout.top_logprobs {head}: the pods would refuse every "
            f"turn; raise it to {head} or drop it (molt train-rl then sets it)"
        )
    return errors


def _context(max_len: list[str], raw: dict[str, list[str]]) -> list[str]:
    """The pods' --vllm.max_model_len for --data.max_len: one more under --rollout.rescore_logprobs, whose prefill
    prompt is a whole segment, which vLLM refuses at its full context (the sessions keep --data.max_len)."""
    rescore = raw.get("rollout.rescore_logprobs")
    if rescore is None or not flag_on(rescore) or not max_len or not max_len[0].isdigit():
        return max_len
    return [str(int(max_len[0]) + 1)]


def _top_logprobs(raw: dict[str, list[str]]) -> int:
    """--rollout.top_logprobs K (0 when absent or not a count; the gateway's own parse names a bad value)."""
    k = (raw.get("rollout.top_logprobs") or ["0"])[0]
    return int(k) if k.isdigit() else 0


def route(argv: list[str], target: Target = "local", gpus: int = 0) -> Routed:
    """Route Molt's flags to the services; ValueError naming every refused or unknown flag."""
    known = trainer_flag_names()
    every = known | POD_FLAGS | set(PLACEMENT) | set(MISSING) | WIRING | ENV_WORKER_FLAGS
    every |= TRAINER_PLACEMENT | set(GATEWAY_FLAGS) | set(ALIASES) | {LEGACY_IS_ENABLE, LEGACY_IS_TYPE}
    r = Routed()
    flags = [
        (name[3:], ["false"]) if name.startswith("no-") and name[3:] in NEGATABLE and not values else (name, values)
        for name, values in split_flags(argv)
    ]
    flags = [(ALIASES.get(name, name), values) for name, values in flags]
    flags, errors = legacy_is_flags(flags, r.notes)
    muon = any(n == "actor.optim" and v[:1] == ["muon"] for n, v in flags)
    for name, values in flags:
        r.raw[name] = values
        if name.startswith("actor.muon.") and not muon:  # Molt's scripts pass them with --actor.optim adam too
            r.notes.append(f"--{name}: only read with --actor.optim muon; AdamW runs")
            continue
        why = _refuse(name, values, target, gpus)
        if why:
            errors.append(f"{' '.join(['--' + name, *values])}: {why}")
            continue
        if name == "actor.model_name_or_path":
            r.model = values[0] if values else None
            r.trainer += ["--" + name, *values]
        elif name == "train.agent_path":
            if len(values) != 1 or not values[0].endswith(".py"):
                errors.append(f"--train.agent_path takes one .py file, got {' '.join(values) or 'nothing'}")
                continue
            r.agent_path = values[0]
        elif name == "vllm.num_engines":
            r.num_pods = _int(name, values)
        elif name == "rollout.num_runners":
            r.num_envs = _int(name, values)
        elif name in POD_FLAGS:
            r.rollout += ["--" + name, *values]
        elif name in ENV_WORKER_FLAGS:
            flag_seconds(name, values)  # one line naming the flag, as a bad count is
            r.envs += ["--" + name, *values]
        elif name in PLACEMENT:
            r.notes.append(f"--{name}: {PLACEMENT[name]}")
        elif name in GATEWAY_FLAGS:
            r.gateway += ["--" + GATEWAY_FLAGS[name], *values]
        elif name == "actor.num_gpus_per_node" and target == "local" and gpus > 0:
            r.trainer_gpus = _int(name, values)
        elif name in ("actor.num_nodes", "actor.num_gpus_per_node", "ref.num_nodes", "ref.num_gpus_per_node"):
            r.notes.append(f"--{name}: {'trainer placement (Helm: trainer.nodes / gpusPerNode)'}")
        elif name in MISSING:  # a neutral value of a missing feature
            r.notes.append(f"--{name} {' '.join(values)}: nothing to do ({MISSING[name]})")
        elif name in known:
            r.trainer += ["--" + name, *values]
            if name == "data.max_len":  # the gateway's session budget follows the pods' context (molt.stack.up)
                r.rollout += ["--vllm.max_model_len", *_context(values, dict(flags))]
            if name == "data.max_images_per_prompt" and _int(name, values) > 0:  # the pods must take as many
                r.rollout += ["--rollout.max_images_per_prompt", *values]
            if name == "train.routing_replay" and flag_on(values):  # the trajectories must carry the pods' routing
                r.gateway += ["--rollout.return_routed_experts"]
            if name == "train.full_determinism_enable" and flag_on(values):  # as Molt: vLLM's engine in-process
                r.rollout += ["--vllm.multiprocessing", "false"]
        else:
            match = suggest_flag(name, every)
            errors.append(f"--{name}: unknown flag" + (f"; did you mean --{match}?" if match else ""))
    errors += _combination_errors(r.raw)
    head = _top_logprobs(r.raw)
    if head > MAX_TOP_LOGPROBS and "vllm.max_logprobs" not in r.raw:  # the pods must return a head that wide
        r.rollout += ["--vllm.max_logprobs", str(head)]
    if not r.model:
        errors.append("--actor.model_name_or_path is required: a local HF model directory")
    estimator = r.raw.get("algo.advantage.estimator", [""])[:1]
    if not r.agent_path and estimator == ["on_policy_distill"]:
        # As Molt: pure distillation needs no task agent, only one sampled completion per prompt.
        from molt.agents import distill_agent

        # (the env-worker image holds molt/agents under /app, its working directory)
        r.agent_path = "molt/agents/distill_agent.py" if target == "helm" else distill_agent.__file__
        r.notes.append("--train.agent_path unset with on_policy_distill: the built-in molt.agents.distill_agent")
    if not r.agent_path:
        errors.append("--train.agent_path is required: the agent module (.py exporting AgentRunner)")
    if errors:
        raise ValueError("molt train-rl:\n  " + "\n  ".join(errors))
    return r


def cpu_pod_defaults(r: Routed) -> Routed:
    """``r`` for pods on a machine without GPUs (a local run, and what its --dry-run prints): vLLM sizes the
    KV cache from GPU memory unless told, and downcasts "auto" to bf16, where fp32 keeps the pods' logprobs
    equal to the fp32 trainer's. Flags the user gave win."""
    if "vllm.kv_cache_memory_bytes" not in r.raw:
        r.rollout = ["--vllm.kv_cache_memory_bytes", str(256 << 20), *r.rollout]
    if "vllm.dtype" not in r.raw:
        r.rollout = ["--vllm.dtype", "float32", *r.rollout]
    return r


def local_plan(r: Routed, run_dir: Path | None, redis_url: str | None, progress: bool):
    from molt.stack.up import StackPlan

    assert r.model and r.agent_path  # route() refuses a run without them
    model = Path(r.model).expanduser().resolve()
    agent = Path(r.agent_path).expanduser().resolve()
    if not (model / "config.json").exists():
        raise ValueError(f"--actor.model_name_or_path {r.model}: no config.json there (a local HF model directory)")
    if not agent.is_file():
        raise ValueError(f"--train.agent_path {r.agent_path}: no such file")
    # Molt's launch scripts export MODEL_PATH and its example agents read it (tool parsers, tokenizers).
    env = {"MODEL_PATH": os.environ.get("MODEL_PATH", str(model))}
    for key in ("MAX_AGENT_TURNS", "VLLM_TOOL_PARSER_CLS"):
        if key in os.environ:
            env[key] = os.environ[key]
    rollout = list(r.rollout)
    return StackPlan(
        name="train-rl",
        model=model,
        agents={"agent": agent},
        agent="agent",
        trainer=r.trainer,
        rollout=rollout,
        gateway=r.gateway,
        envs=r.envs,
        num_pods=r.num_pods,
        num_envs=r.num_envs,
        trainer_gpus=r.trainer_gpus,
        env=env,
        run_dir=run_dir,
        redis_url=redis_url,
        progress=progress,
    )


def place_gpus(r: Routed, gpus: int) -> GpuPlacement | None:
    """Each local process's GPUs for ``r`` on a machine with ``gpus`` (None without): pods first, then the
    trainer, as ``molt.stack.gpus`` places them. ValueError when they do not fit, as Molt refuses at start-up."""
    try:
        return place_stack(gpus, r.num_pods, r.rollout, r.trainer_gpus, FLAGS["train-rl"])
    except ValueError as exc:
        raise ValueError(f"molt train-rl:\n  {exc}") from None


def describe(r: Routed, gpus: GpuPlacement | None = None) -> str:
    return json.dumps(
        {
            "model": r.model,
            "agent": r.agent_path,
            "pods": r.num_pods,
            "env_workers": r.num_envs,
            "trainer": r.trainer,
            "rollout": r.rollout,
            "gateway": r.gateway,
            "envs": r.envs,
            "gpus (CUDA_VISIBLE_DEVICES)": gpus.describe() if gpus else None,
            "notes": r.notes + (gpus.notes if gpus else []),
        },
        indent=2,
    )
