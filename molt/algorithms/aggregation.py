"""``--actor.loss_agg_mode``: how the per-token losses of an optimizer-step window become one number.

With n_i action tokens in row i (one trajectory segment) of a window of rows::

    token-mean              sum_{i,t} l_it / sum_i n_i                     every token weighs the same (default)
    seq-mean-token-mean     mean_i ( sum_t l_it / n_i )                    every row weighs the same
    prompt-mean-token-mean  mean_g ( sum_{i in g, t} l_it / sum_{i in g} n_i )   every prompt group weighs the same

Each is a weighted sum with one weight per row, ``s_i`` (``row_scales``), taken over the whole window before
it is cut into micro-batches and ranks; ``tensor_ops.scaled_sum`` then gives each micro-batch its share.
Rows without action tokens get weight 0 and are not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "prompt-mean-token-mean")
LOSS_AGG_FLAG = "--actor.loss_agg_mode"


def row_scales(mode: str, num_actions: Sequence[int], group_ids: Sequence[str]) -> list[float]:
    """Per-row weights ``s_i`` of ``mode`` for a window whose rows have ``num_actions`` action tokens and
    belong to the prompt groups ``group_ids``; ``sum_i s_i * n_i == 1`` unless the window has no tokens."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"{LOSS_AGG_FLAG} {mode!r} is unknown; choose one of {', '.join(LOSS_AGG_MODES)}")
    if len(num_actions) != len(group_ids):
        raise ValueError(f"need one group id per row, got {len(group_ids)} for {len(num_actions)} rows")
    if mode == "token-mean":
        total = sum(num_actions)
        return [1.0 / total if n > 0 else 0.0 for n in num_actions]
    if mode == "seq-mean-token-mean":
        rows = sum(1 for n in num_actions if n > 0)
        return [1.0 / (n * rows) if n > 0 else 0.0 for n in num_actions]
    group_tokens: Counter[str] = Counter()
    for n, g in zip(num_actions, group_ids, strict=True):
        group_tokens[g] += n
    groups = sum(1 for t in group_tokens.values() if t > 0)
    return [1.0 / (group_tokens[g] * groups) if n > 0 else 0.0 for n, g in zip(num_actions, group_ids, strict=True)]


__all__ = ["LOSS_AGG_FLAG", "LOSS_AGG_MODES", "row_scales"]
