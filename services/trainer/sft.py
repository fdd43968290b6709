"""Supervised fine-tuning on the trainer's FSDP2 stack: ``torchrun --nproc_per_node N -m services.trainer.sft``.

Same pieces as the RL learner: ``model.load_causal_lm`` (NeMo AutoModel on GPU, FSDP2 over gloo on
CPU), ``learner.build_optimizer`` / ``optimizer_step`` (AdamW, HF scheduler, clipping),
``checkpoint.save/load`` (DCP shards, atomic tags, resharding resume) and ``export.save_hf``.

Every rank tokenises the whole dataset (``sft_data``) and derives the same order: a permutation per
epoch seeded by ``--train.seed`` + epoch. Step k of an epoch takes the next ``--train.batch_size``
samples; rank r takes every dp-th of them, in micro-batches of ``--train.micro_batch_size``
(padded, or packed into one row under ``--fsdp.packing_samples``, where their common token prefix runs once:
``--train.pack_shared_prefix``). The loss is the token mean of the
cross-entropy over the window's response tokens on all ranks: each micro-batch backpropagates
``sum(CE) * dp / N_window`` and FSDP averages gradients over dp, so 1 and N processes take the same
step. Gradient sync waits for the window's last micro-batch. Epoch tails shorter than a batch are
dropped, as in Molt.

A vision-language model trains on the rows' images (``--data.image_key``): each micro-batch's images go
through the model's own image processor next to their expanded tokens, as in the RL learner
(``vision.VisionInputs``); such micro-batches keep the padded layout, and ``--model.freeze_visual_encoder``
keeps the vision tower out of the optimizer.

``--model.lora.rank N`` trains low-rank adapters on the ``--model.lora.target_modules`` linears and
nothing else (services/trainer/lora.py); exports fold them into the base weights.

A checkpoint's client state is the number of optimizer steps taken and of samples consumed: the order is a
pure function of seed and epoch, so a resumed run continues with exactly the samples the killed run had not
trained, also under another ``--train.batch_size`` (its step count is then samples // batch size, as in Molt).

SIGTERM/SIGINT (a preemption, Ctrl-C) on any rank: every rank finishes the step in progress, a checkpoint of
it is saved (with ``--ckpt.save_steps`` set) and the process exits 0 without the final export, which the
resumed run writes. An evaluation under way is abandoned (no eval_loss for that step); the step is still saved.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from molt import strict_json
from molt.data import read_mixed_rows
from molt.serve import configure_logging, freeze_before_exit
from services.trainer import checkpoint
from services.trainer.errors import CheckpointWriteError
from services.trainer.export import note_final_export, save_hf
from services.trainer.learner import build_optimizer, optimizer_step, set_grad_sync
from services.trainer.model import (
    DistInfo,
    eval_mode,
    freeze_visual_encoder,
    init_distributed,
    is_vision_language,
    load_causal_lm,
)
from services.trainer.packing import no_4d_mask, select_hidden
from services.trainer.sft_checks import check, same_rows
from services.trainer.sft_config import SftSettings, check_batch
from services.trainer.sft_data import Example, Tokenized, collate
from services.trainer.steplog import open_jsonl

log = logging.getLogger("molt.trainer")
PROG = "python -m services.trainer.sft"


def load_tokenizer(s: SftSettings):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(s.model.model_name_or_path, use_fast=not s.data.disable_fast_tokenizer)
    override = s.data.tokenizer_chat_template
    if override:
        tok.chat_template = Path(override).read_text() if os.path.exists(override) else override
    return tok


def load_vision(s: SftSettings):
    """The model's ``VisionInputs`` when it is vision-language, else None."""
    path = s.model.model_name_or_path
    assert path is not None  # check() refuses a run without it
    if not is_vision_language(path):
        return None
    from services.trainer.vision import VisionInputs

    return VisionInputs(path)


def load_examples(
    s: SftSettings,
    tok,
    spec: str,
    split: str,
    flag: str,
    probs: str | None = None,
    max_samples: int | None = None,
    vision=None,
) -> list[Example]:
    d = s.data
    rows = read_mixed_rows(spec, probs, split, max_samples or d.max_samples, s.train.seed, flag)
    tokenized = Tokenized(
        tok,
        d.max_len,
        d.input_key,
        d.output_key,
        d.train_on_last_turn_only,
        vision=vision,
        image_key=d.image_key,
        max_images=d.max_images_per_prompt,
        tools_key=d.tools_key,
    )
    examples, report = tokenized.build(rows, flag)
    log.info("%s", report.summary(flag))
    return examples


class SftLearner:
    """The policy, its optimizer and scheduler; ``checkpoint.save/load`` read these attributes."""

    def __init__(self, s: SftSettings, info: DistInfo, total_steps: int, vision=None) -> None:
        self.s, self.info, self.vision = s, info, vision
        self.dp = info.world_size // s.fsdp.tp_size
        assert s.model.model_name_or_path is not None  # SftSettings refuses a run without it
        self.hf_source: str = s.model.model_name_or_path
        self.lora = s.model.lora if s.model.lora.rank > 0 else None
        self.actor = load_causal_lm(
            self.hf_source,
            s.fsdp,
            info,
            gradient_checkpoint=s.model.gradient_checkpoint,
            lora=self.lora,
            seed=s.train.seed,
        )
        if vision is not None and s.model.freeze_visual_encoder:
            freeze_visual_encoder(self.actor)
        if self.lora is not None and info.is_main:
            n = sum(p.numel() for p in self.actor.parameters() if p.requires_grad)
            total = sum(p.numel() for p in self.actor.parameters())
            log.info("--model.lora.rank %d: %d of %d parameters train (the adapters)", self.lora.rank, n, total)
        self.optim, self.sched = build_optimizer(self.actor, s, total_steps)
        self.global_step = 0

    def packs(self) -> bool:
        """``--fsdp.packing_samples`` unless the model takes images (their inputs need the padded layout)."""
        if self.s.fsdp.packing_samples and self.vision is not None and self.info.is_main:
            log.info("--fsdp.packing_samples: off (a vision-language model: images need the padded layout)")
        return self.s.fsdp.packing_samples and self.vision is None

    def batch(self, examples: list[Example] | None, pad_id: int, **layout) -> dict:
        """``collate``d micro-batch with the pixel inputs of its images; None is a padding forward's batch. With
        several ranks an image-less micro-batch of a VL model feeds a blank image (services/trainer/vision.py)."""
        batch = collate(examples, pad_id, **layout) if examples else _dummy_batch()
        if self.vision is None:
            return batch
        images = [b for e in examples or [] for b in e.images]
        if images:
            batch.update(self.vision.pixel_inputs(images))
        elif self.info.world_size > 1:
            batch.update(self.vision.blank_inputs())
        return batch

    def shares_prefix(self) -> bool:
        """``--train.pack_shared_prefix`` where the model and flags allow its 4-D mask; logged when they do not."""
        if not self.s.train.pack_shared_prefix:
            return False
        why = no_4d_mask(self.actor)
        if self.s.model.aux_loss_coef > 0:
            why = "the MoE aux loss counts every token of the plain layout"
        if why and self.info.is_main:
            log.info("--train.pack_shared_prefix: off (%s)", why)
        return why is None

    def _forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(sum of CE over supervised tokens, their count, MoE aux loss or None).

        Only the positions that predict a supervised token go through the LM head (``select_hidden``):
        prompt and padding positions never pay for the vocabulary projection and its softmax."""
        batch = {k: v.to(self.info.device) for k, v in batch.items()}
        if "targets" in batch:  # a shared-prefix row names its supervised positions itself
            flat, targets = batch.pop("flat_index"), batch.pop("targets")
        else:
            labels = batch.pop("labels")
            rows, cols = (labels[:, 1:] != -100).nonzero(as_tuple=True)
            flat = rows * labels.shape[1] + cols  # position t predicts token t + 1
            targets = labels[rows, cols + 1]
        # At least one position goes through the head, so every parameter is in the graph (FSDP2 reduces all).
        index = flat if flat.numel() else torch.zeros(1, dtype=torch.long, device=flat.device)
        kwargs = {"output_router_logits": True} if self.s.model.aux_loss_coef > 0 else {}
        with select_hidden(self.actor.get_output_embeddings(), index):  # type: ignore[operator]  # nn.Module.__getattr__ types the HF model's methods as Tensor | Module
            out = self.actor(**batch, use_cache=False, **kwargs)
        logits = out.logits[0, : flat.numel()].float()
        ce = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
        if not flat.numel():
            ce = 0.0 * out.logits.sum()
        return ce, torch.tensor(flat.numel()), getattr(out, "aux_loss", None)

    def train_step(self, micro: list[dict], n_window: int, n_micro_global: int, tokens: int) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (holding ``tokens`` tokens of samples) of a window
        of ``n_window`` supervised tokens."""
        ce_sum, aux_sum = 0.0, 0.0
        for j, batch in enumerate(micro):
            set_grad_sync(self.actor, j == len(micro) - 1)
            ce, _, aux = self._forward(batch)
            loss = ce * self.dp / max(n_window, 1)
            if aux is not None:
                loss = loss + self.s.model.aux_loss_coef * aux * self.dp / n_micro_global
                aux_sum += float(aux.detach())
            loss.backward()
            ce_sum += float(ce.detach())
        grad_norm = optimizer_step(self.actor, self.optim, self.sched, self.s.max_norm)
        self.global_step += 1
        vec = torch.tensor([ce_sum, float(tokens), aux_sum], dtype=torch.float64)
        dist.all_reduce(vec)
        out = {
            "loss": vec[0].item() / max(n_window, 1),
            "grad_norm": grad_norm,
            "lr": self.sched.get_last_lr()[0],
            "tokens": vec[1].item(),
            "response_tokens": float(n_window),
        }
        if self.s.model.aux_loss_coef > 0:
            out["aux_loss"] = vec[2].item() / n_micro_global  # mean over the window's micro-batches
        return out

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[dict, bool]], stop: Callable[[], bool] | None = None) -> float | None:
        """Token-mean CE over every rank's batches (``(batch, False)``: a padding forward, so all ranks run as
        many); None when ``stop`` (a collective every rank calls before each batch) says to abandon it."""
        ce_sum, tokens = 0.0, 0
        with eval_mode(self.actor):
            for i, (batch, real) in enumerate(batches):
                # A whole eval set can outlast a preemption's grace period. Every rank asks before the same batch,
                # so all leave together; the tiny all-reduce is cheap next to the forward (float(ce) syncs anyway).
                if stop is not None and stop():
                    if self.info.is_main:
                        log.warning(
                            "step %d evaluation abandoned after %d of %d batches: stop requested, no eval_loss",
                            self.global_step,
                            i,
                            len(batches),
                        )
                    return None
                ce, n, _ = self._forward(batch)
                if real:
                    ce_sum, tokens = ce_sum + float(ce), tokens + int(n)
        vec = torch.tensor([ce_sum, float(tokens)], dtype=torch.float64)
        dist.all_reduce(vec)
        return vec[0].item() / max(vec[1].item(), 1.0)


def _dummy_batch() -> dict:
    return {
        "input_ids": torch.zeros((1, 2), dtype=torch.long),
        "labels": torch.full((1, 2), -100),
        "attention_mask": torch.ones((1, 2), dtype=torch.long),
    }


def epoch_order(num: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng(seed + epoch).permutation(num)


def position(consumed: int, num: int, batch_size: int) -> tuple[int, int]:
    """(epoch, offset in its order) of the next window after ``consumed`` samples, as Molt resumes: an epoch is
    its whole batches, so a window that would run past them starts the next epoch (the tail is dropped)."""
    epoch_len = num // batch_size * batch_size
    epoch, pos = divmod(consumed, epoch_len)
    if pos + batch_size > epoch_len:
        epoch, pos = epoch + 1, 0
    return epoch, pos


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# W&B / TensorBoard names of the losses, as Molt's SFT trainer logs them (the JSONL keeps loss / eval_loss).
MOLT_NAMES = {"loss": "sft_loss", "eval_loss": "eval sft_loss"}


class Sinks:
    """--logger.steps_jsonl, W&B (--logger.wandb.key) or TensorBoard (--logger.tensorboard_dir); rank 0 only."""

    def __init__(self, s: SftSettings, on: bool) -> None:
        lg = s.logger
        # Open for the whole run (one line per step); close() ends it. A path that cannot be opened (a folder, no
        # permission) is a flag error, reported as main() reports the other start-up ones.
        try:
            self.jsonl = open_jsonl(lg.steps_jsonl) if (on and lg.steps_jsonl) else None
        except OSError as exc:
            raise ValueError(
                f"--logger.steps_jsonl {lg.steps_jsonl}: cannot open it ({exc.strerror or exc})"
            ) from None
        self.wandb = self.tb = None
        if not on:
            return
        if lg.wandb.key:
            try:
                import wandb
            except ImportError as exc:
                raise ValueError(
                    "--logger.wandb.key: the wandb package is not installed (pip install wandb), or drop the flag"
                ) from exc
            try:
                if not wandb.api.api_key:
                    wandb.login(key=lg.wandb.key)
                wandb.init(
                    entity=lg.wandb.org,
                    project=lg.wandb.project,
                    group=lg.wandb.group,
                    name=lg.wandb.run_name,
                    config=s.model_dump(mode="json"),
                    reinit=True,
                )
            except Exception as exc:  # noqa: BLE001  # wandb's errors (AuthenticationError, CommError, ...) share no base
                why = (str(exc).strip().splitlines() or [""])[0][:200]
                raise ValueError(
                    f"--logger.wandb.key: W&B refused the run ({type(exc).__name__}: {why}); check the key, "
                    "--logger.wandb.org/project, or drop the flag"
                ) from None
            # Molt's step axes: train/* against train/global_step, eval/* against eval/global_step.
            for kind in ("train", "eval"):
                wandb.define_metric(f"{kind}/global_step")
                wandb.define_metric(f"{kind}/*", step_metric=f"{kind}/global_step", step_sync=True)
            self.wandb = wandb
        elif lg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ValueError(
                    "--logger.tensorboard_dir: the tensorboard package is not installed (pip install "
                    "tensorboard), or drop the flag"
                ) from exc
            assert lg.wandb.run_name is not None  # main() names the run before the sinks open
            self.tb = SummaryWriter(log_dir=os.path.join(lg.tensorboard_dir, lg.wandb.run_name))

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        if self.jsonl:
            self.jsonl.write(strict_json.dumps({"step": step, **values}) + "\n")
            self.jsonl.flush()
        named = {MOLT_NAMES.get(k, k): v for k, v in values.items()}  # dashboards built on Molt's runs keep working
        if self.wandb:
            self.wandb.log({f"{kind}/{k}": v for k, v in {**named, "global_step": step}.items()})
        if self.tb:
            for k, v in named.items():
                self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        """Idempotent: main() closes the sinks it opened, after train() has closed them on its way out."""
        if self.jsonl:
            self.jsonl.close()
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()
        self.jsonl = self.wandb = self.tb = None


class StopFlag:
    """Set by SIGTERM/SIGINT; the ranks agree on it once per step (any rank's signal stops them all), so none
    leaves a collective the others are in."""

    def __init__(self) -> None:
        self.requested = False

    def request(self, *_) -> None:
        self.requested = True

    def agreed(self, info: DistInfo) -> bool:
        flag = torch.tensor([float(self.requested)], device=info.device)
        if info.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _save(s: SftSettings, learner, tok, info: DistInfo, step: int, consumed: int) -> None:
    state = {"global_step": step, "consumed_samples": consumed}
    checkpoint.save(s.ckpt.path, learner, state, max_num=s.ckpt.resumable_max(), max_mem=s.ckpt.max_mem)
    if s.ckpt.save_hf:
        hf_root = Path(s.ckpt.path) / "_hf"
        save_hf(learner.actor, learner.hf_source, hf_root / f"global_step{step}", tok)
        if info.is_main:
            checkpoint.prune(hf_root, s.ckpt.max_num, keep=f"global_step{step}")


def train(s: SftSettings, info: DistInfo, stop: StopFlag | None = None, sinks: Sinks | None = None) -> dict:
    if s.train.full_determinism_enable:
        torch.use_deterministic_algorithms(True, warn_only=True)
    tok = load_tokenizer(s)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    assert s.data.dataset is not None  # SftSettings refuses a run without it
    vision = load_vision(s)
    data = load_examples(
        s, tok, s.data.dataset, s.data.dataset_split, "--data.dataset", s.data.dataset_probs, vision=vision
    )
    evals = (  # the whole eval set: --data.max_samples caps the training rows only, as in Molt
        load_examples(s, tok, s.eval.dataset, s.eval.split, "--eval.dataset", max_samples=1 << 62, vision=vision)
        if s.eval.dataset
        else None
    )
    if s.eval.dataset and info.is_main and same_rows(s):
        # --eval.split defaults to train, as in Molt: a folder named for both reads its train split twice, and the
        # eval loss then measures memorisation, not generalisation.
        log.warning(
            "--eval.dataset %s split %r is the training data (--data.dataset, --data.dataset_split): eval_loss is a "
            "training loss; pick the held-out split with --eval.split",
            s.eval.dataset,
            s.eval.split,
        )
    t = s.train
    dp = info.world_size // s.fsdp.tp_size
    check_batch(s, dp)  # check() did with WORLD_SIZE; this is the process group's real size
    per_epoch = len(data) // t.batch_size
    if per_epoch == 0:
        raise ValueError(
            f"{len(data)} usable samples are fewer than --train.batch_size {t.batch_size}: lower it or add data"
        )
    total = t.max_epochs * per_epoch
    if t.num_steps:
        total = min(total, t.num_steps)
    pad_to = s.data.max_len if s.data.pad_to_max_len else None
    learner = SftLearner(s, info, total, vision)
    packed = learner.packs()
    layout = {"packed": packed, "pad_to": pad_to, "share_prefix": packed and learner.shares_prefix()}
    consumed = 0
    if s.ckpt.load_enable:
        state = checkpoint.load(s.ckpt.path, learner) or {}
        # The samples consumed, not the step, place the data: a resume under another --train.batch_size
        # continues where the saved run stopped (Molt's consumed_samples). Older checkpoints lack it.
        consumed = int(state.get("consumed_samples", learner.global_step * t.batch_size))
        if consumed != learner.global_step * t.batch_size:
            learner.global_step = consumed // t.batch_size
        if state and info.is_main:
            epoch, pos = position(consumed, len(data), t.batch_size)
            log.info(
                "resuming after %d samples: epoch %d, sample %d of its order, step %d at --train.batch_size %d",
                consumed,
                epoch,
                pos,
                learner.global_step,
                t.batch_size,
            )
        elif not state and info.is_main:  # a mistyped --ckpt.path would otherwise restart a run without a word
            log.warning("--ckpt.load_enable: no checkpoint under --ckpt.path %s; starting from step 0", s.ckpt.path)
    eval_every = s.eval.steps if s.eval.steps > 0 else per_epoch
    eval_batches: list[tuple[dict, bool]] | None = None
    if evals:
        mine = evals[info.rank // s.fsdp.tp_size :: dp]
        count = math.ceil(math.ceil(len(evals) / dp) / t.micro_batch_size)
        eval_batches = [(learner.batch(c, pad_id, **layout), True) for c in chunks(mine, t.micro_batch_size)]
        eval_batches += [(learner.batch(None, pad_id), False)] * (count - len(eval_batches))
    sinks = sinks or Sinks(s, info.is_main)
    rank_dp = info.rank // s.fsdp.tp_size
    last: dict = {}
    first_step = learner.global_step
    try:
        while learner.global_step < total:
            epoch, pos = position(consumed, len(data), t.batch_size)
            if epoch >= t.max_epochs:
                break
            window = epoch_order(len(data), t.seed, epoch)[pos : pos + t.batch_size]
            consumed = epoch * per_epoch * t.batch_size + pos + t.batch_size
            n_window = sum(int(data[i].loss_mask[1:].sum()) for i in window)
            start = time.monotonic()
            # Length order inside the window: micro-batches of like lengths pad less, ranks stay balanced by the
            # stride, and the step's gradient is the same (a sum over the window's tokens, whatever the grouping).
            by_len = sorted(window, key=lambda i: data[i].num_tokens)
            mine = [data[i] for i in by_len[rank_dp::dp]]
            micro = [learner.batch(c, pad_id, **layout) for c in chunks(mine, t.micro_batch_size)]
            tokens = sum(e.num_tokens for e in mine)
            metrics = learner.train_step(micro, n_window, t.batch_size // t.micro_batch_size, tokens)
            metrics["seconds"] = time.monotonic() - start
            metrics["tokens_per_s"] = metrics["tokens"] / max(metrics["seconds"], 1e-9)
            metrics["epoch"] = epoch
            step = learner.global_step
            last = metrics
            if step % s.logger.logging_steps == 0:
                sinks.write("train", step, metrics)
                if info.is_main:
                    log.info(
                        "step %d/%d loss %.4f grad_norm %.3f lr %.3g %.0f tok/s",
                        step,
                        total,
                        metrics["loss"],
                        metrics["grad_norm"],
                        metrics["lr"],
                        metrics["tokens_per_s"],
                    )
            if eval_batches is not None and step % eval_every == 0:
                if info.is_main:
                    log.info("step %d evaluating %d batches", step, len(eval_batches))
                # A stop request abandons the evaluation (nothing recorded); the save and stop below still run.
                eval_loss = learner.eval_loss(eval_batches, None if stop is None else lambda: stop.agreed(info))
                if eval_loss is not None:
                    last["eval_loss"] = eval_loss
                    sinks.write("eval", step, {"eval_loss": eval_loss})
                    if info.is_main:
                        log.info("step %d eval_loss %.4f", step, eval_loss)
            saved = s.ckpt.save_steps > 0 and step % s.ckpt.save_steps == 0
            if saved:
                _save(s, learner, tok, info, step, consumed)
            if stop is not None and step < total and stop.agreed(info):
                if s.ckpt.save_steps > 0 and not saved:
                    _save(s, learner, tok, info, step, consumed)
                if info.is_main:
                    log.warning(
                        "stopped by a signal after step %d of %d: %s",
                        step,
                        total,
                        f"checkpoint saved, resume with --ckpt.load_enable (path {s.ckpt.path})"
                        if s.ckpt.save_steps > 0
                        else "no checkpoint (--ckpt.save_steps is -1), this progress is lost",
                    )
                return {"steps": step, "stopped": True}
        if not s.ckpt.disable_final_save:
            if info.is_main:
                why = f"the resumed checkpoint already reached the run's last step, {total}"
                note_final_export(s.ckpt.output_dir, learner.global_step, first_step, learner.hf_source, why)
            save_hf(learner.actor, learner.hf_source, s.ckpt.output_dir, tok)
    finally:
        sinks.close()
    return {"steps": learner.global_step, **{k: v for k, v in last.items() if k in ("loss", "eval_loss")}}


def main(argv: list[str] | None = None, prog: str = PROG) -> None:
    from molt.config import parse_settings
    from services.trainer.device import trainer_on_gpu

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    on_gpu = trainer_on_gpu()
    s = parse_settings(
        SftSettings, sys.argv[1:] if argv is None else argv, prog=prog, validate=lambda x: check(x, on_gpu)
    )
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(s.log_level, rank=rank)
    if not s.logger.wandb.run_name:
        s.logger.wandb.run_name = time.strftime("sft_%m%dT%H:%M")
    # The loggers open before the data and the model load: a refused W&B key is a start-up error, not a
    # traceback after minutes of loading. RANK decides, as init_distributed's rank will.
    try:
        sinks = Sinks(s, rank == 0)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    info = init_distributed()
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop.request)
    signal.signal(signal.SIGINT, stop.request)
    try:
        summary = train(s, info, stop, sinks)
    except ValueError as exc:
        # What train() refuses is the flags or the data they name (a batch larger than the usable rows, rows no
        # key fits): status 2, as the start-up checks and every service report a flag error.
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except CheckpointWriteError as exc:  # a failure of the run (disk full), not of its flags
        sys.exit(f"{prog}: error: {exc}")
    finally:
        sinks.close()
    if info.is_main:
        log.info("done: %s", summary)
    dist.barrier()
    dist.destroy_process_group()
    freeze_before_exit()


if __name__ == "__main__":
    main()
