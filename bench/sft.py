"""SFT tokens/s against TRL's ``SFTTrainer``: same model, data, batch, sequence length, steps, in the same run.

    .venv/bin/python -m bench.sft [--model .cache/models/smollm2] [--steps 30] [--batch-size 16]
        [--micro-batch-size 4] [--max-len 256] [--threads 1] [--nproc 1] [--skip-trl] [--lora-rank 0]

Data: a synthetic reversal task with prompts of 3 to ``--max-letters`` (60) letters (so batches mix lengths, as
real SFT data does), chat-formatted; the loss is on the response tokens only in both trainers. TRL's rows
(``--trl-data rendered``, ``completion_only_loss``) are the chat-rendered prompt and the response with its stop
token, so both supervise the same tokens; ``--trl-data chat`` gives TRL conversational rows instead, where it also
supervises the newline its template writes after the stop token (one more, easy, token per row). Both use
AdamW (betas 0.9/0.95, no weight decay), a constant LR, clipping at 1.0, no gradient checkpointing, fp32 on
CPU, and take the same batches in the same order (TRL reads the rows pre-ordered as ours shuffles them, with
its sequential sampler).

Each side runs in its own process: ours is ``python -m services.trainer.sft`` (``torchrun`` under
``--nproc`` > 1, one thread per process), TRL gets ``--threads`` torch threads. tokens/s counts the
non-padding tokens of steps 2..N over their wall time (step 1 warms up); TRL's steps are timed by a
callback and its tokens counted by ``include_num_input_tokens_seen="non_padding"``. Each side is run
padded and packed: each micro-batch's samples concatenated into one row (ours ``--fsdp.packing_samples``,
which also lays the samples' common token prefix, here the template's system prompt and header, out once;
``packed-plain`` turns that off; TRL ``padding_free=True``, which leaves ``max_length`` unenforced: the rows
fit it anyway; TRL's ``packing=True`` would refill rows to max_len and so change the samples per step).
Held-out loss: the token-mean response loss on 64 unseen rows after the last step, by one definition for
both (``heldout_loss``).
``--rounds`` repeats each (ours, TRL) pair. ``--lora-rank R`` trains LoRA adapters (alpha 2R) on every ``*_proj``
linear in both: ours' ``--model.lora.*``, TRL with PEFT's ``LoraConfig`` on the same modules.
Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LETTERS = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p"]


def rows(n: int, seed: int, max_letters: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        w = [rng.choice(LETTERS) for _ in range(rng.randint(3, max_letters))]
        out.append({"prompt": "reverse: " + " ".join(w), "response": "reversed: " + " ".join(reversed(w))})
    return out


def ours(args, work: Path, layout: str) -> dict:
    tag = f"ours-{layout}"
    steps_file = work / f"{tag}.jsonl"
    flags = [
        "--model.model_name_or_path",
        str(args.model),
        "--data.dataset",
        str(work / "train.jsonl"),
        "--data.input_key",
        "prompt",
        "--data.output_key",
        "response",
        "--data.max_len",
        str(args.max_len),
        "--eval.dataset",
        str(work / "eval.jsonl"),
        "--eval.steps",
        str(args.steps),
        "--train.batch_size",
        str(args.batch_size),
        "--train.micro_batch_size",
        str(args.micro_batch_size),
        "--train.max_epochs",
        "1",
        "--train.num_steps",
        str(args.steps),
        "--adam.lr",
        str(args.lr),
        "--model.gradient_checkpoint",
        "none",
        "--ckpt.disable_final_save",
        "--ckpt.path",
        str(work / tag / "state"),
        "--logger.steps_jsonl",
        str(steps_file),
    ]
    if layout != "padded":
        flags.append("--fsdp.packing_samples")
    if layout == "packed-plain":
        flags += ["--train.pack_shared_prefix", "false"]
    if args.lora_rank:
        flags += ["--model.lora.rank", str(args.lora_rank), "--model.lora.alpha", str(2 * args.lora_rank)]
    if args.nproc > 1:
        cmd = [
            str(Path(sys.executable).with_name("torchrun")),
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            "-m",
            "services.trainer.sft",
        ]
    else:
        cmd = [sys.executable, "-m", "services.trainer.sft"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd + flags, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{tag} failed:\n{proc.stderr[-3000:]}")
    recs = [json.loads(x) for x in steps_file.read_text().splitlines()]
    train = [r for r in recs if "loss" in r][1:]
    eval_loss = [r["eval_loss"] for r in recs if "eval_loss" in r][-1]
    tokens, secs = sum(r["tokens"] for r in train), sum(r["seconds"] for r in train)
    return {
        "impl": f"ours ({args.nproc} proc{'s' if args.nproc > 1 else ''}, {layout}{lora_tag(args.lora_rank)})",
        "tokens_per_s": tokens / secs,
        "eval_loss": eval_loss,
    }


def trl_worker(
    model: str,
    work: str,
    packed: bool,
    steps: int,
    batch: int,
    micro: int,
    max_len: int,
    lr: float,
    threads: int,
    rendered: bool,
    lora_rank: int,
) -> None:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    if threads:
        torch.set_num_threads(threads)

    tok = AutoTokenizer.from_pretrained(model)

    def chat(path):
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        if rendered:  # ours' supervised tokens exactly: the rendered prompt, then the response and its stop token
            return datasets.Dataset.from_list(
                [
                    {
                        "prompt": tok.apply_chat_template(
                            [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
                        ),
                        "completion": r["response"] + tok.eos_token,
                    }
                    for r in rows
                ]
            )
        return datasets.Dataset.from_list(
            [
                {
                    "prompt": [{"role": "user", "content": r["prompt"]}],
                    "completion": [{"role": "assistant", "content": r["response"]}],
                }
                for r in rows
            ]
        )

    class Timer(TrainerCallback):
        def __init__(self):
            self.t0 = self.tokens0 = None

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:  # step 1 warms up, as in ours
                self.t0, self.tokens0 = time.monotonic(), state.num_input_tokens_seen

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
    cfg = SFTConfig(
        output_dir=str(Path(work) / "trl-out"),
        use_cpu=True,
        bf16=False,
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        per_device_eval_batch_size=64,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        max_length=None if packed else max_len,
        padding_free=packed,
        completion_only_loss=True,
        train_sampling_strategy="sequential",
        include_num_input_tokens_seen="non_padding",
        logging_steps=steps,
        save_strategy="no",
        report_to=[],
        seed=42,
        dataloader_num_workers=0,
        dataset_kwargs={"add_special_tokens": False} if rendered else None,  # the template wrote them
    )
    peft_config = None
    if lora_rank:  # the projections ours' default '*_proj' takes
        from peft import LoraConfig

        targets = sorted({n.rsplit(".", 1)[-1] for n, _ in net.named_modules() if n.endswith("_proj")})
        peft_config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets, lora_dropout=0.0)
    timer = Timer()
    trainer = SFTTrainer(
        model=net,
        peft_config=peft_config,
        args=cfg,
        train_dataset=chat(Path(work) / "train-ordered.jsonl"),
        eval_dataset=chat(Path(work) / "eval.jsonl"),
        processing_class=tok,
        callbacks=[timer],
    )
    trainer.train()
    secs = time.monotonic() - timer.t0
    tokens = trainer.state.num_input_tokens_seen - timer.tokens0
    print(
        json.dumps(
            {
                "tokens_per_s": tokens / secs,
                "eval_loss": heldout_loss(trainer.model.eval(), tok, work, max_len),
                "trl_eval_loss": trainer.evaluate()["eval_loss"],
                "threads": torch.get_num_threads(),
            }
        )
    )


def heldout_loss(net, tok, work: str, max_len: int) -> float:
    """The held-out loss as ours defines it (response tokens and their stop token), so both sides compare on
    one definition: TRL's own eval_loss also counts the newline the template puts after the stop token."""
    import torch

    from services.trainer.sft_data import Tokenized, collate

    eval_rows = [json.loads(x) for x in (Path(work) / "eval.jsonl").read_text().splitlines()]
    examples, _ = Tokenized(tok, max_len, "prompt", "response").build(eval_rows, "--eval.dataset")
    batch = collate(examples, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    labels = batch.pop("labels")[:, 1:]
    with torch.no_grad():
        logits = net(**batch, use_cache=False).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return float(ce) / int((labels != -100).sum())


def lora_tag(rank: int) -> str:
    return f", LoRA r{rank}" if rank else ""


def trl(args, work: Path, packed: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [
        sys.executable,
        __file__,
        "--trl-worker",
        str(args.model),
        str(work),
        str(int(packed)),
        str(args.steps),
        str(args.batch_size),
        str(args.micro_batch_size),
        str(args.max_len),
        str(args.lr),
        str(args.threads),
        args.trl_data,
        str(args.lora_rank),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"TRL failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "impl": f"TRL SFTTrainer ({res['threads']} thread{'s' if res['threads'] > 1 else ''}, "
        f"{'packed' if packed else 'padded'}{lora_tag(args.lora_rank)})",
        **res,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        m, w, p, steps, b, mb, ml, lr, th, data, rank = sys.argv[2:13]
        trl_worker(
            m, w, p == "1", int(steps), int(b), int(mb), int(ml), float(lr), int(th), data == "rendered", int(rank)
        )
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / ".cache" / "models" / "smollm2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1, help="TRL's torch threads (0: torch's default)")
    ap.add_argument("--nproc", type=int, default=1, help="our processes (one thread each)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument(
        "--trl-data",
        choices=("rendered", "chat"),
        default="rendered",
        help="TRL's rows: rendered prompt + response + stop token (the tokens ours supervises), or chat messages "
        "(TRL then also supervises the newline its template writes after the stop token)",
    )
    ap.add_argument(
        "--layouts",
        default="padded,packed",
        help="comma-separated: padded, packed (ours lays the samples' common prefix out once), packed-plain "
        "(ours without that: --train.pack_shared_prefix false); TRL runs padding-free for both packed ones",
    )
    ap.add_argument("--rounds", type=int, default=1, help="repeat the pairs (ours, TRL) this many times")
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="LoRA on every *_proj linear, alpha 2 x rank: ours' --model.lora.* against TRL with PEFT's LoRA",
    )
    ap.add_argument("--max-letters", type=int, default=60, help="longest prompt, in letters")
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model} missing: python -m molt.models smollm2 --out {args.model}")
    work = Path(tempfile.mkdtemp(prefix="bench-sft-"))
    from services.trainer.sft import epoch_order

    for name, n, seed in (("train", args.steps * args.batch_size, 1), ("eval", 64, 2)):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed, args.max_letters)))
    # TRL reads the rows in the order ours trains them (its sequential sampler), so both take the same batches.
    train = (work / "train.jsonl").read_text().splitlines()
    (work / "train-ordered.jsonl").write_text("".join(train[i] + "\n" for i in epoch_order(len(train), 42, 0)))
    results = []
    for layout in [x for x in args.layouts.split(",") for _ in range(args.rounds)]:
        results.append(ours(args, work, layout))
        print(json.dumps(results[-1]), flush=True)
        if not args.skip_trl:
            results.append(trl(args, work, layout != "padded"))
            print(json.dumps(results[-1]), flush=True)
    print(
        f"\nmodel {args.model.name}, {args.steps} steps of {args.batch_size} rows (micro {args.micro_batch_size}), "
        f"max_len {args.max_len}, lr {args.lr}\n"
    )
    print("| trainer | tokens/s | ratio to the TRL run right after it | held-out loss |")
    print("|---|---|---|---|")
    for i, r in enumerate(results):
        peer = results[i + 1] if r["impl"].startswith("ours") and i + 1 < len(results) else None
        ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer and peer["impl"].startswith("TRL") else "-"
        print(f"| {r['impl']} | {r['tokens_per_s']:.0f} | {ratio} | {r['eval_loss']:.4f} |")


if __name__ == "__main__":
    main()
