"""Shared-prefix packing layout (services/trainer/packing.py): hand-checked rows, masks and positions."""

from __future__ import annotations

import numpy as np
import torch

from services.trainer.batch import Sample, padding_sample
from services.trainer.packing import budget_chunks, common_prefix_len, no_4d_mask, pack, plan_group_chunks


def _sample(tokens, group, actions_from):
    t = torch.tensor(tokens)
    mask = torch.zeros(len(tokens) - 1, dtype=torch.bool)
    mask[actions_from - 1 :] = True  # steps that predict tokens actions_from..
    return Sample(
        f"t{tokens}",
        group,
        0,
        0.0,
        None,
        "p",
        t,
        mask,
        torch.zeros(len(tokens) - 1),
        torch.zeros(len(tokens) - 1, dtype=torch.long),
    )


def test_common_prefix_len():
    a, b = np.array([1, 2, 3, 4]), np.array([1, 2, 9])
    assert common_prefix_len([a, b]) == 2
    assert common_prefix_len([a, a[:3]]) == 3
    assert common_prefix_len([a, np.array([7])]) == 0


def test_group_shares_one_row():
    s = [_sample([5, 6, 7, 10, 11], "g", 3), _sample([5, 6, 7, 20], "g", 3)]
    rows = pack(s, 2048)
    assert rows.input_ids.tolist() == [[5, 6, 7, 10, 11, 20]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]
    m = rows.attention_mask[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ]
    # Sample 0 predicts tokens 3, 4 from row positions 2 (shared prefix end) and 3; sample 1 token 3 from 2.
    assert rows.flat_index.tolist() == [2, 3, 2]
    assert rows.targets.tolist() == [10, 11, 20]
    assert rows.sample_row.tolist() == [0, 0, 1]
    assert rows.step.tolist() == [2, 3, 2]


def test_groups_without_a_common_prefix_get_plain_rows_and_padding_attends_to_itself():
    s = [_sample([1, 2, 3], "a", 1), _sample([4, 5], "b", 1)]
    rows = pack(s, 2048)
    assert rows.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert rows.attention_mask[1, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    assert rows.flat_index.tolist() == [0, 1, 3]  # row 1 starts at flat position 3


def test_a_long_group_splits_over_rows_that_repeat_the_prefix():
    s = [_sample([9] * 6 + [k, k], "g", 6) for k in (1, 2, 3)]
    rows = pack(s, 10)  # prefix 6 + rests of 2: two rests per row
    assert rows.input_ids.tolist() == [[9] * 6 + [1, 1, 2, 2], [9] * 6 + [3, 3, 0, 0]]
    assert sorted(set(rows.sample_row.tolist())) == [0, 1, 2]


def test_long_rests_after_a_short_prefix_stay_unpacked():
    # Packing two would make one row of 2 + 6 + 6 = 14 tokens: 196 attention pairs against 64 + 64 unpacked.
    s = [_sample([9, 9] + [k] * 6, "g", 2) for k in (1, 2)]
    rows = pack(s, 2048)
    assert rows.input_ids.tolist() == [[9, 9] + [1] * 6, [9, 9] + [2] * 6]


def test_padding_sample_packs_to_an_empty_selection():
    rows = pack([padding_sample()], 2048)
    assert rows.flat_index.numel() == 0 and rows.input_ids.shape == (1, 2)


def test_group_chunks_keep_groups_together_over_ranks():
    s = [_sample([1, 2, 3], f"g{i // 4}", 1) for i in range(16)]
    plans = [plan_group_chunks(s, list(range(16)), 2, r, 8) for r in range(2)]
    for chunks, count in plans:
        assert count == 1 and len(chunks) == 1
        groups = [s[i].group_id for i in chunks[0]]
        assert len(set(groups)) == 2 and all(groups.count(g) == 4 for g in set(groups))
    assert sorted(i for chunks, _ in plans for c in chunks for i in c) == list(range(16))


def test_only_sdpa_and_eager_take_the_4d_mask():
    def model(attn):
        net = torch.nn.Linear(1, 1)
        net.config = type("Config", (), {"_attn_implementation": attn})()
        return net

    assert no_4d_mask(model("sdpa")) is None and no_4d_mask(model("eager")) is None
    assert "'flash_attention_2' takes no 4-D mask" in no_4d_mask(model("flash_attention_2"))


def test_padded_budget_prices_the_length_rounded_to_the_pad_multiple():
    # two samples of 1001 and 700 tokens padded together are 2 x 1001 <= 2047; rounded to 1024 they are 2 x 1024
    assert budget_chunks([[0], [1]], [1001, 700], 2047, padded=True) == [[0, 1]]
    assert budget_chunks([[0], [1]], [1001, 700], 2047, padded=True, pad_to_multiple=1024) == [[0], [1]]
    # packed rows are priced by their tokens whatever the multiple
    assert budget_chunks([[0], [1]], [1001, 700], 2047, pad_to_multiple=1024) == [[0, 1]]
