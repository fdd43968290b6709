"""The learner: experience pass and optimizer steps on every rank.

``Learner.train_step(samples)`` is called on every rank with the same full rollout batch (rank 0
broadcasts it). Work is split by ``batch.partition``; every rank runs the same number of forwards
(short ranks run a padding sample) because FSDP2 all-gathers parameters in each one.

1. Experience (no grad): old log-probs (skipped under ``--train.force_on_policy`` with beta 0),
   reference log-probs when beta > 0, critic values for ``gae``. Results are all-gathered so that
   every rank computes the advantages of the *whole* batch (group baselines, whitening) identically.
2. Windows of ``--train.batch_size`` samples (the whole batch under force-on-policy), for
   ``--train.max_epochs`` passes: micro-batches of ``--train.micro_batch_size`` per rank (or of
   ``--train.max_tokens_per_gpu`` tokens with ``--train.dynamic_batch_enable``); the loss is
   molt.algorithms' global token-mean over the window's action tokens on all ranks; gradient sync is
   deferred to the window's last micro-batch; grad clip ``--actor.max_norm``; AdamW (or Muon + AdamW).
3. Metrics are token-weighted over micro-batches and ranks (one all-reduce per step).

Log-probs are taken on logits / ``--rollout.temperature`` (the rollout's processed log-probs).

A vision-language policy gets each micro-batch's image files through its own image processor next to
the recorded tokens (services/trainer/vision.py); ``--actor.freeze_visual_encoder`` keeps its vision
tower out of the optimizer and of weight sync. Packing is off for it (images need the plain layout).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from molt.algorithms import (
    SamplerHead,
    approx_kl,
    build_kl_controller,
    build_policy_loss,
    compute_advantages,
    get_advantage_estimator,
    row_scales,
    scaled_sum,
    token_mean,
    value_loss,
)
from molt.algorithms.length_shaping import PARTS, LengthShaping, shape_rewards, shaping_metrics
from services.trainer import lora
from services.trainer.batch import MicroBatch, Sample, collate, micro_batches, padding_sample, partition, plan_windows
from services.trainer.config import TrainerSettings, actor_schedule_steps, needs_critic, needs_reference
from services.trainer.model import (
    DistInfo,
    eval_mode,
    freeze_router,
    freeze_visual_encoder,
    is_vision_language,
    load_causal_lm,
    load_critic,
)
from services.trainer.muon import MuonAdamW
from services.trainer.packing import (
    budget_chunks,
    logprobs_and_entropy,
    logprobs_entropy_and_head,
    no_4d_mask,
    pack,
    packed_token_logprobs,
    plan_group_chunks,
)

log = logging.getLogger("molt.trainer")


def build_optimizer(model: nn.Module, cfg, total_steps: int):
    """The optimizer of ``model``'s trainable parameters (AdamW, or Muon + AdamW with ``--optim muon``) and the HF
    scheduler, from an optimizer block (``--actor.*``, ``--critic.*``, SFT's un-prefixed one)."""
    from transformers import get_scheduler

    opt: torch.optim.Optimizer
    if cfg.optim == "muon":
        opt = MuonAdamW(model, cfg)
    else:
        opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.adam.lr,
            betas=tuple(cfg.adam.betas),
            eps=cfg.adam.eps,
            weight_decay=cfg.adam.weight_decay,
            # One kernel over all parameters (CPU and CUDA, DTensor shards included): the per-tensor loop costs
            # several times more per step on a model with hundreds of tensors.
            fused=True,
        )
    kwargs = {}
    if cfg.lr_scheduler == "cosine_with_min_lr":
        kwargs["scheduler_specific_kwargs"] = {"min_lr_rate": cfg.min_lr_ratio}
    sched = get_scheduler(
        cfg.lr_scheduler,
        opt,
        num_warmup_steps=int(cfg.lr_warmup_ratio * total_steps),
        num_training_steps=total_steps,
        **kwargs,
    )
    return opt, sched


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float):
    """(log-prob of each next token [B, T-1], entropy [B, T-1]) on logits / temperature."""
    return logprobs_and_entropy(logits[:, :-1], input_ids[:, 1:], temperature)


def head_inputs(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The micro-batch's top-k ids, sampler logprobs and pi_old's head log-probs, [B, T-1, K] each (score centering).
    A micro-batch without top-k can only be one without action tokens (a rank's padding sample; ``train_step``
    refuses the others): it gets one masked entry per step, so it runs the same forward and loss as the rest."""
    if mb.top_ids is not None and mb.top_logprobs is not None:
        return mb.top_ids, mb.top_logprobs, mb.old_head_logp
    shape, device = (*mb.action_mask.shape, 1), mb.action_mask.device
    old = None if mb.old_logp is None else torch.zeros(shape, device=device)
    return torch.full(shape, -1, dtype=torch.long, device=device), torch.full(shape, -torch.inf, device=device), old


# Key of the staleness-free mismatch accumulator inside the per-pod sums (never a pod name).
FRESH = "__fresh__"


def moe_aux_term(aux: torch.Tensor, coef: float, num_micro: int) -> torch.Tensor:
    """Molt's MoE load-balancing term of one micro-batch: ``coef * aux / micro-batches in the window`` (this
    rank's gradient-accumulation steps), so a window's gradient is ``coef`` times the mean of its aux losses."""
    return coef * aux / max(1, num_micro)


class Learner:
    def __init__(self, settings: TrainerSettings, info: DistInfo, total_steps: int = 1000) -> None:
        self.s, self.info = settings, info
        # Data parallel = world / TP (TP peers see the same samples; TP is innermost in NeMo's mesh).
        tp = settings.fsdp.tp_size
        if info.world_size % tp:
            raise ValueError(f"world size {info.world_size} is not a multiple of --fsdp.tp_size {tp}")
        self.dp_size, self.dp_rank = info.world_size // tp, info.rank // tp
        self.temperature = settings.rollout.temperature
        a = settings.actor
        assert a.model_name_or_path is not None  # TrainerSettings falls back to --model.path or refuses
        self.hf_source: str = a.model_name_or_path  # checkpoints carry its config and tokenizer (molt export)
        # --actor.lora: adapters on the policy only; the reference and the critic stay full models. Checkpoints
        # read ``self.lora`` (lora.json, so `molt export` merges offline); the export merges through scale_of.
        self.lora = a.lora if a.lora.rank > 0 else None
        self.actor = load_causal_lm(
            a.model_name_or_path,
            settings.fsdp,
            info,
            gradient_checkpoint=a.gradient_checkpoint,
            lora=self.lora,
            seed=settings.train.seed,
            lora_flag="--actor.lora",
        )
        self.lora_scale = lora.scale_of(self.actor) if self.lora is not None else None
        self.frozen_names = freeze_router(self.actor) if a.freeze_moe_router else []
        self.vision = None
        if is_vision_language(a.model_name_or_path):
            from services.trainer.vision import VisionInputs

            self.vision = VisionInputs(a.model_name_or_path)
            if a.freeze_visual_encoder:
                self.frozen_names += freeze_visual_encoder(self.actor)
        elif a.freeze_visual_encoder:
            log.warning("--actor.freeze_visual_encoder: %s has no vision tower; nothing frozen", self.hf_source)
        # Frozen names go to the pods as "keep": base names only (the pods never see adapters).
        self.frozen_names = [n for n in self.frozen_names if not lora.is_adapter(n)]
        if info.is_main:
            trainable = sum(p.numel() for p in self.actor.parameters() if p.requires_grad)
            total = sum(p.numel() for p in self.actor.parameters())
            how = f" (--actor.lora.rank {self.lora.rank} adapters)" if self.lora is not None else ""
            log.info("actor: %d of %d parameters train%s", trainable, total, how)
        self.replay = None
        if settings.train.routing_replay:
            from services.trainer.routing_replay import RoutingReplay

            self.replay = RoutingReplay(self.actor)
        self.optim, self.sched = build_optimizer(self.actor, a, actor_schedule_steps(settings, total_steps))
        self.ref = None
        if needs_reference(settings):
            self.ref = load_causal_lm(
                settings.ref.model_name_or_path or a.model_name_or_path, settings.fsdp, info, trainable=False
            )
        self.critic = self.critic_optim = self.critic_sched = None
        if needs_critic(settings) and self.vision is not None:
            raise ValueError(
                "--algo.advantage.estimator gae: the critic takes no images; train a vision-language policy "
                "with a critic-free estimator (grpo, rloo, reinforce, ...)"
            )
        if needs_critic(settings):
            self.critic = load_critic(
                settings.critic.model_name_or_path or a.model_name_or_path,
                settings.fsdp,
                info,
                gradient_checkpoint=a.gradient_checkpoint,
            )
            if settings.critic.freeze_moe_router or a.freeze_moe_router:  # Molt: the critic inherits the actor flag
                freeze_router(self.critic)
            # total_steps counts --train.max_epochs passes; the critic's schedule spans its own number of passes
            critic_steps = total_steps * (settings.critic.max_epochs or settings.train.max_epochs)
            self.critic_optim, self.critic_sched = build_optimizer(
                self.critic,
                settings.critic,
                max(1, critic_steps // settings.train.max_epochs),
            )
        self.packing = self._packing_usable()
        t = settings.train
        # padded token-budget micro-batches round their length up (shape buckets); packed rows are left as they are
        self.pad_to = t.dynamic_batch_pad_to_multiple if t.dynamic_batch_enable and not self.packing else 1
        self.policy_loss = build_policy_loss(a, settings.algo)
        self.kl_ctl = build_kl_controller(settings.algo)
        self.global_step = 0
        self._warned_no_routing = False

    def weights_to_publish(self, state: dict[str, torch.Tensor], *, full: bool) -> dict[str, torch.Tensor]:
        """What the pods load from a full actor state dict. Under LoRA they serve the base architecture: the
        adapters merged into their weights, and (unless ``full``) only those weights, the rest never changing."""
        if self.lora_scale is None:
            return state
        return lora.merge(state, self.lora_scale) if full else lora.merged_targets(state, self.lora_scale)

    # ---- forwards

    def _packing_usable(self) -> bool:
        """``--train.pack_shared_prefix``, where the model and the flags allow a 4-D mask (module docstring)."""
        if not self.s.train.pack_shared_prefix:
            return False
        why = no_4d_mask(self.actor)
        if self.vision is not None:
            why = "a vision-language model: images need the plain token layout"
        elif self.replay is not None:
            why = "routing replay needs the plain token layout"
        elif self.s.actor.aux_loss_coef > 0:
            why = "the MoE aux loss needs the plain token layout"
        elif self.s.actor.score_centering:
            why = "--actor.score_centering reads the sampler's top-k columns of the full logits (plain token layout)"
        if why:
            log.info("--train.pack_shared_prefix: off (%s)", why)
        return why is None

    def _replaying(self, mb: MicroBatch):
        """``--train.routing_replay``: the routers take the rollout's experts for ``mb`` inside this block."""
        return self.replay.active(mb.routed_experts) if self.replay is not None else contextlib.nullcontext()

    def _logp(self, model, mb: MicroBatch, replay: bool, chunk: list[Sample]):
        if self.packing and chunk:
            rows = pack(chunk, self.s.train.pack_max_tokens)
            logp, entropy = packed_token_logprobs(model, rows, len(chunk), mb.action_mask.shape[1], self.temperature)
            return logp, entropy, None
        out = self._forward(model, mb, replay)
        logp, entropy = token_logprobs(out.logits, mb.input_ids, self.temperature)
        return logp, entropy, getattr(out, "aux_loss", None)

    def _logp_and_head(self, model, mb: MicroBatch, replay: bool, head_ids: torch.Tensor):
        """``_logp`` (plain layout: packing is off under score centering) plus the log-probs of ``head_ids``."""
        out = self._forward(model, mb, replay)
        logits, targets = out.logits[:, :-1], mb.input_ids[:, 1:]
        logp, entropy, head = logprobs_entropy_and_head(logits, targets, head_ids, self.temperature)
        return logp, entropy, getattr(out, "aux_loss", None), head

    def _forward(self, model, mb: MicroBatch, replay: bool):
        ctx = self._replaying(mb) if replay else contextlib.nullcontext()
        kwargs: dict[str, object] = dict(self._pixel_inputs(mb))
        if model is self.actor and self.s.actor.aux_loss_coef > 0:
            kwargs["output_router_logits"] = True
        with ctx:
            return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, **kwargs)

    def _pixel_inputs(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """The micro-batch's images as the model's pixel arguments; a blank image on an image-less micro-batch
        when other ranks may run the vision tower (vision.py's module docstring)."""
        if self.vision is None:
            return {}
        if mb.images:
            pixels = self.vision.pixel_inputs(mb.images)
        elif self.info.world_size > 1:
            pixels = self.vision.blank_inputs()
        else:
            return {}
        return {k: v.to(self.info.device) for k, v in pixels.items()}

    def _my_chunks(self, samples: list[Sample], indices: list[int], *, grad: bool = True) -> list[list[int]]:
        """This rank's micro-batches of ``indices``, padded to the count of the busiest rank; by token budget
        with --train.dynamic_batch_enable (``grad`` False: the no-grad forwards' --rollout.max_tokens_per_gpu)."""
        t = self.s.train
        mbs = t.micro_batch_size
        budget = None
        if t.dynamic_batch_enable:
            budget = t.max_tokens_per_gpu if grad else (self.s.rollout.max_tokens_per_gpu or t.max_tokens_per_gpu)
        if self.packing:  # keep each group's samples in one micro-batch, so they share a prefix row
            mine, count = plan_group_chunks(samples, indices, self.dp_size, self.dp_rank, mbs, budget)
            return mine + [[] for _ in range(count - len(mine))]
        if budget is not None:
            tokens = [samples[i].num_tokens for i in indices]
            per_rank = [
                budget_chunks(
                    [[indices[j]] for j in r], [tokens[j] for j in r], budget, padded=True, pad_to_multiple=self.pad_to
                )
                for r in partition(tokens, self.dp_size)
            ]
            count = max(len(c) for c in per_rank)
            return per_rank[self.dp_rank] + [[] for _ in range(count - len(per_rank[self.dp_rank]))]
        ranks = partition([samples[i].num_tokens for i in indices], self.dp_size)
        count = max(math.ceil(len(r) / mbs) for r in ranks)
        return micro_batches([indices[j] for j in ranks[self.dp_rank]], mbs, count)

    @torch.no_grad()
    def make_experience(self, samples: list[Sample]) -> None:
        s = self.s
        beta = self.kl_ctl.value
        want_old = not (s.train.force_on_policy and beta == 0)
        # Score centering's head IS weights compare pi_old with the sampler, as the sampled token's do.
        want_old_head = want_old and self.policy_loss.score_centering and s.algo.advantage.is_correction_level != "off"
        mine: dict[int, dict] = {}
        # Dropout off for the recorded log-probs and values (Molt's eval()); training passes run in train mode.
        with eval_mode(self.actor, self.critic):
            for chunk in self._my_chunks(samples, list(range(len(samples))), grad=False):
                batch = [samples[i] for i in chunk] or [padding_sample()]
                mb = collate(batch, self.pad_to).to(self.info.device)
                res = {}
                if want_old_head:
                    old = self._logp_and_head(self.actor, mb, replay=True, head_ids=head_inputs(mb)[0])
                    res["old_logp"], res["old_head_logp"] = old[0], old[3]
                elif want_old:
                    res["old_logp"] = self._logp(self.actor, mb, replay=True, chunk=batch)[0]
                if self.ref is not None:
                    res["ref_logp"] = self._logp(self.ref, mb, replay=False, chunk=batch)[0]
                if self.critic is not None:
                    res["values"] = self.critic(mb.input_ids, mb.attention_mask)
                for row, i in enumerate(chunk):
                    n = samples[i].num_tokens - 1
                    mine[i] = {k: v[row, :n].detach().float().cpu() for k, v in res.items()}
                    # The micro-batch's K is its largest: each sample keeps the columns of its own K.
                    old_head, top = mine[i].pop("old_head_logp", None), samples[i].top_ids
                    if old_head is not None and top is not None:
                        mine[i]["old_head_logp"] = old_head[:, : top.shape[1]]
        gathered: list[dict[int, dict[str, torch.Tensor]]] = [{}] * self.info.world_size
        dist.all_gather_object(gathered, mine)
        for part in gathered:
            for i, res in part.items():
                for k, v in res.items():
                    setattr(samples[i], k, v)
        full = collate(samples)
        kl = None
        if self.ref is not None and (not s.algo.kl.use_loss) and full.old_logp is not None:
            assert full.ref_logp is not None  # computed above for every sample when there is a reference
            kl = approx_kl(full.old_logp, full.ref_logp, s.algo.kl.estimator) * full.action_mask
        rewards = self._shaped_rewards(samples)
        adv, ret = compute_advantages(
            s.algo.advantage.estimator,
            rewards,
            full.action_mask,
            group_ids=[x.group_id for x in samples],
            rollout_ids=[x.trajectory_id for x in samples],
            kl=kl,
            values=full.values,
            gamma=s.algo.advantage.gamma,
            lam=s.algo.advantage.lam,
            kl_coef=beta,
            whiten=not s.algo.advantage.no_whiten,
            std_norm=not s.algo.advantage.no_std_norm,
            reward_clip=(s.reward.clip_range[0], s.reward.clip_range[1]),
        )
        for i, x in enumerate(samples):
            n = x.num_tokens - 1
            x.advantages, x.returns = adv[i, :n].clone(), ret[i, :n].clone()
            x.extra["kl"] = float((kl[i, :n] * x.action_mask).sum() / max(x.num_actions, 1)) if kl is not None else 0.0

    def _shaped_rewards(self, samples: list[Sample]) -> torch.Tensor:
        """Rewards after the ``--reward.*`` length penalties (molt.algorithms.length_shaping), each sample's
        parts kept in ``extra`` for the step's metrics. Estimators that merge a rollout's segments shape it
        once; the others shape each segment alone."""
        spec = get_advantage_estimator(self.s.algo.advantage.estimator)
        merged = spec.grouped or spec.per_rollout
        rewards, parts = shape_rewards(
            torch.tensor([x.reward for x in samples]),
            [x.num_tokens for x in samples],
            [x.truncated for x in samples],
            [x.trajectory_id if merged else str(i) for i, x in enumerate(samples)],
            LengthShaping.of(self.s.reward, self.s.data.max_len),
        )
        for name, values in parts.items():
            for x, v in zip(samples, values.tolist(), strict=True):
                x.extra[name] = v
        return rewards

    # ---- optimisation

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """Experience + optimizer steps over one rollout batch; returns step metrics (same on every rank)."""
        s = self.s
        if self.replay is not None and not self._warned_no_routing and all(x.routed_experts is None for x in samples):
            self._warned_no_routing = True
            log.warning(
                "--train.routing_replay is on but the trajectories carry no routed_experts: live routing is "
                "used (enable routing capture on the rollout pods)"
            )
        if self.policy_loss.score_centering:
            bare = sum(1 for x in samples if x.num_actions > 0 and not x.has_top_k)
            if bare:  # the trainer acks these untrained; reaching here, they would train without the correction
                raise ValueError(
                    f"--actor.score_centering: {bare} sample(s) without the sampler's top-k (the gateway's "
                    "--rollout.top_logprobs K)"
                )
        self.make_experience(samples)
        sums: dict[str, float] = defaultdict(float)
        pods: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        train_actor = not (self.critic is not None and self.global_step < s.actor.freezing_steps)
        grad_norms, critic_norms = [], []
        windows = plan_windows(
            len(samples), s.train.batch_size, one_window=s.train.force_on_policy, seed=s.train.seed + self.global_step
        )
        critic_epochs = s.critic.max_epochs or s.train.max_epochs
        for epoch in range(max(s.train.max_epochs, critic_epochs if self.critic is not None else 0)):
            actor_epoch = train_actor and epoch < s.train.max_epochs
            critic_epoch = self.critic is not None and epoch < critic_epochs
            for window in windows:
                n_window = sum(samples[i].num_actions for i in window)
                scales = self._row_scales(samples, window)
                chunks = self._my_chunks(samples, window)
                for j, chunk in enumerate(chunks):
                    last = j == len(chunks) - 1
                    batch = [samples[i] for i in chunk] or [padding_sample()]
                    mb = collate(batch, self.pad_to).to(self.info.device)
                    if actor_epoch:
                        row_scale = None
                        if scales is not None:
                            row_scale = torch.tensor([scales.get(i, 0.0) for i in chunk] or [0.0])
                            row_scale = row_scale.to(self.info.device)
                        self._actor_micro(
                            mb,
                            batch,
                            (n_window, row_scale),
                            last,
                            sums,
                            pods if epoch == 0 else None,
                            samples,
                            chunk,
                            num_micro=len(chunks),
                        )
                    if critic_epoch:
                        self._critic_micro(mb, n_window, last, sums)
                if actor_epoch:
                    grad_norms.append(self._opt_step(self.actor, self.optim, self.sched, s.actor.max_norm))
                if critic_epoch:
                    critic_norms.append(
                        self._opt_step(self.critic, self.critic_optim, self.critic_sched, s.critic.max_norm)
                    )
        self.global_step += 1
        metrics = self._reduce(sums, pods)
        metrics["actor_grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        metrics["actor_lr"] = self.sched.get_last_lr()[0]
        metrics["actor_frozen"] = float(not train_actor)
        if critic_norms:
            metrics["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
        metrics["kl_coef"] = self.kl_ctl.value
        # KL to the reference: per-sample mean as reward (Molt's `kl`), or the loss term's token mean.
        metrics["kl"] = (
            metrics.get("kl_loss", 0.0)
            if s.algo.kl.use_loss
            else sum(x.extra.get("kl", 0.0) for x in samples) / max(len(samples), 1)
        )
        # The horizon counts rollouts, as Molt's (batch size x samples per prompt): a rollout's segments count once.
        self.kl_ctl.update(metrics["kl"], num_samples=len({x.trajectory_id for x in samples}))
        parts = {name: [x.extra[name] for x in samples] for name in PARTS if samples and name in samples[0].extra}
        metrics.update(shaping_metrics([x.trajectory_id for x in samples], parts))
        return metrics

    def _row_scales(self, samples: list[Sample], window: list[int]) -> dict[int, float] | None:
        """Per-sample weights of the window for ``--actor.loss_agg_mode`` (None: the global token mean)."""
        mode = self.s.actor.loss_agg_mode
        if mode == "token-mean":
            return None
        weights = row_scales(mode, [samples[i].num_actions for i in window], [samples[i].group_id for i in window])
        return dict(zip(window, weights, strict=True))

    def _actor_micro(self, mb, batch, window, last, sums, pods, samples, chunk, num_micro: int = 1) -> None:
        s, world = self.s, self.dp_size
        n_window, row_scale = window
        set_grad_sync(self.actor, last)
        head = None
        if self.policy_loss.score_centering:
            ids, sampler, old_head = head_inputs(mb)
            logp, entropy, aux, head_logp = self._logp_and_head(self.actor, mb, replay=True, head_ids=ids)
            head = SamplerHead(head_logp, sampler, ids >= 0, old_head)
        else:
            logp, entropy, aux = self._logp(self.actor, mb, replay=True, chunk=batch)
        mask = mb.action_mask

        def aggregate(tok: torch.Tensor) -> torch.Tensor:  # every actor loss term, by --actor.loss_agg_mode
            if row_scale is None:
                return token_mean(tok, mask, num_window_tokens=n_window, dp_size=world)
            return scaled_sum(tok, mask, row_scale, dp_size=world)

        out = self.policy_loss(
            logp,
            mb.old_logp,
            mb.advantages,
            mask,
            num_window_tokens=n_window,
            dp_size=world,
            rollout_logp=mb.rollout_logp,
            entropy=entropy.detach(),
            row_scale=row_scale,
            head=head,
        )
        loss = out.loss
        if self.ref is not None and s.algo.kl.use_loss:
            kl_tok = approx_kl(logp, mb.ref_logp, s.algo.kl.estimator)
            loss = loss + self.kl_ctl.value * aggregate(kl_tok)
            sums["kl_loss"] += float((kl_tok.detach() * mask).sum())
        if s.actor.entropy_coef:
            loss = loss - s.actor.entropy_coef * aggregate(entropy)
        if aux is not None and s.actor.aux_loss_coef > 1e-8:
            loss = loss + moe_aux_term(aux, s.actor.aux_loss_coef, num_micro)
        with self._replaying(mb):  # activation checkpointing runs the routers again in backward: same routes
            loss.backward()
        tokens = float(mask.sum())
        sums["tokens"] += tokens
        for k, v in out.metrics.items():
            sums[k] += float(v) * tokens
        sums["entropy"] += float((entropy.detach() * mask).sum())
        sums["advantage_mean"] += float((mb.advantages * mask).sum())
        if pods is not None:  # mismatch KL per pod, against pi_old (or this forward under force-on-policy)
            base = mb.old_logp if mb.old_logp is not None else logp.detach()
            tok_diff = (mb.rollout_logp - base) * mask
            diff = tok_diff.sum(-1)
            for row, i in enumerate(chunk):
                pods[samples[i].pod][0] += float(diff[row])
                pods[samples[i].pod][1] += float(mask[row].sum())
                # Tokens generated by exactly these weights: engine-vs-trainer numerics, free of staleness.
                fresh = samples[i].versions == self.global_step
                pods[FRESH][0] += float(tok_diff[row, : fresh.shape[0]][fresh].sum())
                pods[FRESH][1] += float(fresh.sum())

    def _critic_micro(self, mb, n_window, last, sums) -> None:
        assert self.critic is not None  # only called with a critic
        set_grad_sync(self.critic, last)
        values = self.critic(mb.input_ids, mb.attention_mask).float()
        out = value_loss(
            values,
            mb.values,
            mb.returns,
            mb.action_mask,
            value_clip=self.s.critic.value_clip,
            num_window_tokens=n_window,
            dp_size=self.dp_size,
        )
        out.loss.backward()
        tokens = float(mb.action_mask.sum())
        sums["critic_tokens"] += tokens
        for k, v in out.metrics.items():
            sums[k] += float(v) * tokens

    def _opt_step(self, model, optim, sched, max_norm: float) -> float:
        return optimizer_step(model, optim, sched, max_norm)

    def _reduce(self, sums: dict[str, float], pods: dict[str, list[float]]) -> dict[str, float]:
        keys = sorted(sums)
        pod_names: list[dict[str, list[float]]] = [{}] * self.info.world_size
        dist.all_gather_object(pod_names, dict(pods))
        vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(vec)
        total = dict(zip(keys, vec.tolist()))
        tokens, ctokens = max(total.pop("tokens", 0.0), 1.0), max(total.pop("critic_tokens", 0.0), 1.0)
        out = {k: v / (ctokens if k.startswith("value_") else tokens) for k, v in total.items()}
        merged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for part in pod_names:
            for pod, (d, n) in part.items():
                merged[pod][0] += d
                merged[pod][1] += n
        fresh_d, fresh_n = merged.pop(FRESH, (0.0, 0.0))
        out["mismatch_kl_fresh"] = fresh_d / fresh_n if fresh_n else float("nan")
        out["mismatch_kl"] = {pod: d / max(n, 1.0) for pod, (d, n) in merged.items()}
        out["vllm_kl_all_pods"] = sum(d for d, _ in merged.values()) / max(sum(n for _, n in merged.values()), 1.0)
        return out


def set_grad_sync(model, last: bool) -> None:
    """FSDP2: reduce-scatter gradients only on a window's last micro-batch (earlier ones accumulate locally)."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)


def optimizer_step(model, optim, sched, max_norm: float) -> float:
    """Clip to ``max_norm``, step the optimizer and scheduler, zero the grads; returns the pre-clip norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    optim.step()
    sched.step()
    optim.zero_grad(set_to_none=True)
    return float(norm)
