"""`molt train-rl --emit helm-values`: the routed run (``molt.stack.train_rl.Routed``) as values of the
deploy/k8s/molt chart, and the notes on what the file leaves out on purpose (paths only the cluster's mounts
make real, secrets, the shell variables the agent reads).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from molt.stack.agent_env import engine_imports, forwarded_env
from molt.stack.train_rl import Routed, flag_on, flag_seconds, split_flags

# Trainer flags the chart sets itself from values (storage and model live in the cluster, not at the paths of
# the machine that ran `molt train-rl`); their values go to the chart's keys instead.
CHART_OWNED = {
    "actor.model_name_or_path",
    "data.prompt_dataset",
    "ckpt.path",
    "ckpt.output_dir",
    "ckpt.save_steps",
    "ckpt.max_num",
    "ckpt.load_enable",
    "ckpt.save_hf",
}


# Molt hands these to every worker from the launching shell; the local stack's processes inherit them. The
# W&B key (flag or variable) is a secret and stays out of a values file: write_helm_values says how to pass it.
# The chart's rollout image (torch, transformers and vLLM), for env workers whose agent imports them.
ENGINE_IMAGE = "molt-rollout"
WANDB_ENV = ("WANDB_ENTITY", "WANDB_MODE")
SECRET_FLAGS = {"logger.wandb.key"}


@dataclass(frozen=True)
class AgentFacts:
    """What the agent's code needs from where it runs: the shell variables it reads (given, and withheld as
    secrets) and the engine packages it imports. Read once from its files (``agent_facts``)."""

    forwarded: list[dict] = field(default_factory=list)
    withheld: list[str] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)


def agent_facts(r: Routed, env: Mapping[str, str]) -> AgentFacts:
    if not r.agent_path:
        return AgentFacts()
    forwarded, withheld = forwarded_env(r.agent_path, env)
    return AgentFacts(forwarded, withheld, sorted(engine_imports(r.agent_path)))


def helm_values(r: Routed, environ: Mapping[str, str] | None = None, agent: AgentFacts | None = None) -> dict:
    """The same run as values for deploy/k8s/molt (model and dataset paths as the cluster's pods will see them);
    the W&B settings of ``environ`` (default: this process's) go to the trainer's environment."""
    env = os.environ if environ is None else environ
    agent = agent_facts(r, env) if agent is None else agent
    trainer_nodes = int(r.raw.get("actor.num_nodes", ["1"])[0])
    gpus = int(r.raw.get("actor.num_gpus_per_node", ["8"])[0])
    tp = int(r.raw.get("vllm.tensor_parallel_size", ["1"])[0])
    extra = [
        a
        for name, values in split_flags(r.trainer)
        if name not in CHART_OWNED and name not in SECRET_FLAGS
        for a in ("--" + name, *values)
    ]
    checkpoints: dict = {}
    if "ckpt.save_steps" in r.raw:
        checkpoints["saveSteps"] = int(r.raw["ckpt.save_steps"][0])
    if "ckpt.max_num" in r.raw:
        checkpoints["maxNum"] = int(r.raw["ckpt.max_num"][0])
    if "ckpt.save_hf" in r.raw:
        checkpoints["saveHF"] = flag_on(r.raw["ckpt.save_hf"])
    values: dict = {
        "model": {"path": r.model},
        "rollout": {"replicas": r.num_pods, "gpusPerPod": tp, "extraArgs": r.rollout},
        "gateway": {
            "extraArgs": r.gateway
            + (["--session.max_length", r.raw["data.max_len"][0]] if "data.max_len" in r.raw else [])
        },
        "envs": {
            "replicas": r.num_envs,
            "agents": {"agent": r.agent_path},
            # Molt's agents read MODEL_PATH (tokenizers, tool parsers): the chart mounts the model there too.
            "mountModel": True,
        },
        "trainer": {
            "nodes": trainer_nodes,
            "gpusPerNode": gpus,
            "agent": "agent",
            "promptDataset": (r.raw.get("data.prompt_dataset") or [""])[0],
            "extraArgs": extra,
        },
    }
    if checkpoints:
        values["trainer"]["checkpoints"] = checkpoints
    if "envs.episode_timeout_s" in r.raw:  # the chart takes whole seconds: rounded up, never shorter
        values["envs"]["episodeTimeoutSeconds"] = math.ceil(
            flag_seconds("envs.episode_timeout_s", r.raw["envs.episode_timeout_s"])
        )
    wandb = [{"name": n, "value": env[n]} for n in WANDB_ENV if env.get(n)]
    if wandb:
        values["trainer"]["extraEnv"] = wandb
    if agent.forwarded:  # Molt's Ray workers inherit the launching shell; the chart's env workers get them here
        values["envs"]["extraEnv"] = agent.forwarded
    if agent.imports:  # the slim image would fail the agent's import
        values["envs"]["image"] = {"repository": ENGINE_IMAGE}
    return values


def write_helm_values(r: Routed, path: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """Write the values file; returns notes for the user (what the file leaves out on purpose)."""
    env = os.environ if environ is None else environ
    agent = agent_facts(r, env)
    # JSON is YAML too, and quotes every string: a bare 1e-6 would reach Helm (YAML 1.2) as a number.
    path.write_text(
        "# molt train-rl --emit helm-values: the run's flags as values of deploy/k8s/molt\n"
        + json.dumps(helm_values(r, env, agent), indent=2)
        + "\n"
    )
    given = [
        x
        for x, on in (
            ("--logger.wandb.key", "logger.wandb.key" in r.raw),
            ("WANDB_API_KEY", env.get("WANDB_API_KEY")),
        )
        if on
    ]
    notes = [
        "model.path, trainer.promptDataset and envs.agents.agent are paths of this machine: pods see them only "
        "where mounted (model.existingClaim or model.hostPath under model.mountPath, or extraVolumes and "
        "extraVolumeMounts; docs/deploy.md); the chart refuses a model.path outside every mount"
    ]
    if agent.forwarded:
        notes.append(
            "envs.extraEnv: " + ", ".join(e["name"] for e in agent.forwarded) + " (set in this shell and read by "
            "the agent's code, as Molt's workers inherit them)"
        )
    if agent.imports:
        notes.append(
            f"envs.image.repository: {ENGINE_IMAGE}, as the agent imports {' and '.join(agent.imports)}, which the "
            "slim env-worker image (molt-service) lacks; the rollout image has them and imports them without a GPU"
        )
    if agent.withheld:
        notes.append(
            f"{', '.join(agent.withheld)}: read by the agent's code but not written to the values file (a secret); "
            "give them from a Secret: envs.extraEnv [{name: NAME, valueFrom: {secretKeyRef: {name: ..., key: ...}}}]"
        )
    if not given:
        return notes
    return notes + [
        f"{' and '.join(given)}: not written to the values file (a secret); give the trainer its W&B key from a "
        "Secret: trainer.extraEnv [{name: MOLT_LOGGER__WANDB__KEY, valueFrom: {secretKeyRef: {name: wandb, key: "
        "api-key}}}] (docs/deploy.md)"
    ]
