"""Shared-prefix packing: a group's samples compute their common prompt once (``--train.pack_shared_prefix``).

GRPO-style groups are n samples of one prompt, so a plain batch runs the prompt's forward and backward
n times. Here each micro-batch is laid out as rows of ``[prefix, rest_1, rest_2, ...]``: the longest
common token prefix of a group's samples, then each sample's own remainder. A 4-D boolean attention
mask lets every remainder see the prefix and itself (causally) and nothing else, and position ids
restart after the prefix for each remainder, so every token sees exactly the context it had in its own
sequence: the log-probs equal the unpacked forward's (tested), for fewer tokens.

Only the log-probs of action steps are needed (step k predicts token k+1, see ``batch``), so the hidden
states of just those positions go through the LM head and the log-softmax (``select_hidden``): with a
49k vocabulary that is most of the head's cost on prompt-heavy batches.

Rows never exceed ``max_row_tokens`` and never cost more attention than their members unpacked (the 4-D mask
is dense: a row's attention grows with its length squared); a group that does not fit is split over rows
that each repeat the prefix. The mask is ``rows x L x L`` booleans, so keep the cap in the low thousands.
Needs an attention implementation that takes a 4-D mask (sdpa, eager); the learner falls back to the
plain layout otherwise (flash attention on GPU), and for routing replay (routing is per token of the
plain layout).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from services.trainer.batch import Sample, partition, round_up


@dataclass
class PackedRows:
    input_ids: Tensor
    """[R, L] int64, padded with 0."""
    position_ids: Tensor
    """[R, L] int64."""
    attention_mask: Tensor
    """[R, 1, L, L] bool, True = may attend."""
    flat_index: Tensor
    """[N] positions (into the flattened [R * L] layout) whose output predicts an action token."""
    targets: Tensor
    """[N] the token each selected position predicts."""
    sample_row: Tensor
    """[N] index of the sample (in micro-batch order) each selected log-prob belongs to."""
    step: Tensor
    """[N] its step (step k predicts token k+1)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def common_prefix_len(seqs: list[np.ndarray]) -> int:
    """Length of the longest common prefix of token arrays."""
    n = min(len(s) for s in seqs)
    first = seqs[0][:n]
    same = np.ones(n, dtype=bool)
    for s in seqs[1:]:
        same &= s[:n] == first
    bad = np.flatnonzero(~same)
    return int(bad[0]) if bad.size else n


def fill_row(ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, seqs: list[np.ndarray], prefix: int) -> list:
    """Write ``seqs`` into one row as ``[prefix, rest_1, rest_2, ...]`` (``ids``/``pos`` [L], ``mask`` [L, L],
    zeroed). Returns, per sequence, where each of its tokens sits in the row (its first ``prefix`` tokens are
    the shared ones)."""
    if prefix:
        ids[:prefix] = seqs[0][:prefix]
        pos[:prefix] = np.arange(prefix)
        mask[:prefix, :prefix] = np.tri(prefix, dtype=bool)
    off, wheres = prefix, []
    for t in seqs:
        rest = len(t) - prefix
        ids[off : off + rest] = t[prefix:]
        pos[off : off + rest] = np.arange(prefix, len(t))
        mask[off : off + rest, :prefix] = True
        mask[off : off + rest, off : off + rest] = np.tri(rest, dtype=bool)
        wheres.append(np.concatenate([np.arange(prefix), np.arange(off, off + rest)]))
        off += rest
    # Padding attends to itself only: no all-False mask row (sdpa would turn it into NaN).
    tail = np.arange(off, len(ids))
    mask[tail, tail] = True
    return wheres


def no_4d_mask(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the rows' 4-D mask (its attention implementation), or None when it can."""
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return None if attn in ("sdpa", "eager") else f"attention implementation {attn!r} takes no 4-D mask"


def _rows_of_group(lengths: list[int], prefix: int, max_row_tokens: int) -> list[list[int]]:
    """Greedy rows of a group's members. A member joins the current row while the row stays within
    ``max_row_tokens`` and its attention work (row length squared: the 4-D mask is dense) stays within what
    its members cost unpacked (the sum of their lengths squared). So packing only removes work: short rests
    after a long shared prompt pack; long rests after a short prompt stay one per row (the plain layout)."""
    rows: list[list[int]] = []
    row_len = plain = 0
    for j, n in enumerate(lengths):
        grown = row_len + n - prefix
        if rows and grown <= max_row_tokens and grown * grown <= plain + n * n:
            rows[-1].append(j)
            row_len, plain = grown, plain + n * n
        else:
            rows.append([j])
            row_len, plain = n, n * n
    return rows


def pack(samples: list[Sample], max_row_tokens: int) -> PackedRows:
    """Lay ``samples`` (one micro-batch) out as shared-prefix rows; samples of a group share a prefix."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_id, []).append(i)
    tokens = [s.tokens.numpy() for s in samples]
    rows: list[tuple[int, list[int]]] = []  # (prefix length, sample indices)
    for members in groups.values():
        prefix = common_prefix_len([tokens[i] for i in members]) if len(members) > 1 else 0
        # Nothing shared: every sample gets a row of its own (the plain layout).
        if prefix == 0:
            rows.extend((0, [i]) for i in members)
            continue
        for part in _rows_of_group([len(tokens[i]) for i in members], prefix, max_row_tokens):
            rows.append((prefix, [members[j] for j in part]))
    lengths = [p + sum(len(tokens[i]) - p for i in m) for p, m in rows]
    width = max(lengths)
    n_rows = len(rows)
    ids = np.zeros((n_rows, width), dtype=np.int64)
    pos = np.zeros((n_rows, width), dtype=np.int64)
    mask = np.zeros((n_rows, width, width), dtype=bool)
    flat, targets, sample_row, steps = [], [], [], []
    for r, (prefix, members) in enumerate(rows):
        base = r * width
        wheres = fill_row(ids[r], pos[r], mask[r], [tokens[i] for i in members], prefix)
        for i, where in zip(members, wheres, strict=True):
            t = tokens[i]
            k = np.flatnonzero(samples[i].action_mask.numpy())
            flat.append(base + where[k])
            targets.append(t[k + 1])
            sample_row.append(np.full(k.size, i))
            steps.append(k)

    def cat(xs: list[np.ndarray]) -> Tensor:
        return torch.from_numpy(np.concatenate(xs).astype(np.int64)) if xs else torch.zeros(0, dtype=torch.long)

    return PackedRows(
        torch.from_numpy(ids),
        torch.from_numpy(pos),
        torch.from_numpy(mask).unsqueeze(1),
        cat(flat),
        cat(targets),
        cat(sample_row),
        cat(steps),
    )


def logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(log-prob of ``targets``, entropy), both shaped like ``targets``, on fp32 logits / temperature."""
    return _picked_and_entropy(torch.log_softmax(logits.float() / temperature, dim=-1), targets)


def logprobs_entropy_and_head(
    logits: Tensor, targets: Tensor, head_ids: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``logprobs_and_entropy`` plus the log-probs of ``head_ids`` [..., K] (-1: padding, read as id 0), for
    --actor.score_centering. One log-softmax for all three: a second would keep another fp32 [..., vocab]
    tensor alive for the backward."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    return (*_picked_and_entropy(logp_all, targets), logp_all.gather(-1, head_ids.clamp(min=0)))


def _picked_and_entropy(logp_all: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    picked = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked, -(logp_all.exp() * logp_all).sum(-1)


@contextlib.contextmanager
def select_hidden(head: nn.Module, flat_index: Tensor):
    """While active, ``head`` (the LM head) sees only the hidden states at ``flat_index`` ([1, N, D])."""

    def hook(module, args):
        hidden = args[0]
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_index).unsqueeze(0)
        return (picked, *args[1:])

    handle = head.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def packed_token_logprobs(
    model: nn.Module, rows: PackedRows, num_samples: int, num_steps: int, temperature: float
) -> tuple[Tensor, Tensor]:
    """(log-prob, entropy), each [num_samples, num_steps] on the step axis, 0 off the action steps."""
    # At least one position goes through the head, so every parameter takes part in the graph even for a
    # padding micro-batch (FSDP2 reduces every gradient).
    index = rows.flat_index if rows.flat_index.numel() else torch.zeros(1, dtype=torch.long)
    with select_hidden(model.get_output_embeddings(), index):  # type: ignore[operator]  # nn.Module.__getattr__ types the HF model's methods as Tensor | Module
        out = model(
            input_ids=rows.input_ids,
            attention_mask=rows.attention_mask,
            position_ids=rows.position_ids,
            use_cache=False,
        )
    picked, entropy = logprobs_and_entropy(out.logits[0, : rows.flat_index.numel()], rows.targets, temperature)
    logp = torch.zeros(num_samples, num_steps, dtype=picked.dtype)
    ent = torch.zeros(num_samples, num_steps, dtype=entropy.dtype)
    logp = logp.index_put((rows.sample_row, rows.step), picked)
    ent = ent.index_put((rows.sample_row, rows.step), entropy)
    if not rows.flat_index.numel():
        logp = logp + 0.0 * out.logits.sum()  # keep the graph (and FSDP2's backward hooks) alive
    return logp, ent


def plan_group_chunks(
    samples: list[Sample],
    indices: list[int],
    dp_size: int,
    dp_rank: int,
    micro_batch_size: int,
    max_tokens: int | None = None,
) -> tuple[list[list[int]], int]:
    """This rank's micro-batches of ``indices`` with each group's samples kept together (so they share a
    row), groups dealt over ranks by token count; returns (chunks, the busiest rank's chunk count). With
    ``max_tokens`` whole groups are cut by tokens (``budget_chunks``) instead of samples by count."""
    groups: dict[str, list[int]] = {}
    for i in indices:
        groups.setdefault(samples[i].group_id, []).append(i)
    units = list(groups.values())
    sizes = [sum(samples[i].num_tokens for i in u) for u in units]
    ranks = partition(sizes, dp_size)
    per_rank = []
    for r in ranks:
        if max_tokens is not None:
            per_rank.append(budget_chunks([units[u] for u in r], [sizes[u] for u in r], max_tokens))
            continue
        flat = [i for u in r for i in units[u]]
        per_rank.append([flat[j : j + micro_batch_size] for j in range(0, len(flat), micro_batch_size)])
    return per_rank[dp_rank], max(len(c) for c in per_rank)


def budget_chunks(
    units: list[list[int]], sizes: list[int], max_tokens: int, *, padded: bool = False, pad_to_multiple: int = 1
) -> list[list[int]]:
    """``units`` (lists of sample indices, kept whole) cut in order into micro-batches of at most ``max_tokens``:
    the sum of ``sizes`` (packed rows), or with ``padded`` the rows times the longest unit rounded up to
    ``pad_to_multiple`` (the padded batch's shape). A unit over the budget is a micro-batch of its own."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    rows = used = longest = 0
    for unit, size in zip(units, sizes, strict=True):
        cost = (rows + len(unit)) * round_up(max(longest, size), pad_to_multiple) if padded else used + size
        if cur and cost > max_tokens:
            chunks.append(cur)
            cur, rows, used, longest = [], 0, 0, 0
        cur += unit
        rows, used, longest = rows + len(unit), used + size, max(longest, size)
    if cur:
        chunks.append(cur)
    return chunks
