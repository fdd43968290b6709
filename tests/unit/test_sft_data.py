"""SFT rows -> conversations, the response mask over token ids, and micro-batch collation."""

import numpy as np
import pytest
import torch

from molt.data import read_mixed_rows
from services.trainer.sft_data import Example, ReplyMarkers, collate, response_mask, to_messages

# Opener [5, 6] (say "<|im_start|>assistant\n"), closer 2 ("<|im_end|>").
MARKERS = ReplyMarkers(opener=(5, 6), closer=2, supervise_closer=True)


def test_prompt_and_response_columns_make_a_user_then_assistant_turn():
    msgs, why = to_messages({"q": "hi", "a": "yo"}, "q", "a")
    assert why == "" and msgs == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_chat_messages_column_is_used_as_is():
    chat = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
    ]
    assert to_messages({"messages": chat}, "messages", None) == (chat, "")


def test_response_may_be_a_message_dict_or_a_list():
    one = {"role": "assistant", "content": "x"}
    assert to_messages({"q": "u", "a": one}, "q", "a")[0][-1] == one
    assert to_messages({"q": "u", "a": [one, {"role": "user", "content": "more"}, one]}, "q", "a")[0][-1] == one


def test_content_parts_text_joined_images_kept_as_parts():
    """TRL-style rows: text parts become one string (any template renders it); with an image part the parts stay,
    cleaned of the None keys a datasets column adds."""
    text = [{"type": "text", "text": "a", "image": None}, {"type": "text", "text": "b", "image": None}]
    with_image = [{"type": "image", "text": None}, {"type": "text", "text": "c?", "image": None}]
    msgs, _ = to_messages({"q": [{"role": "user", "content": text}], "a": "yo"}, "q", "a")
    assert msgs[0]["content"] == "ab"
    msgs, _ = to_messages({"q": [{"role": "user", "content": with_image}], "a": "yo"}, "q", "a")
    assert msgs[0]["content"] == [{"type": "image"}, {"type": "text", "text": "c?"}]


@pytest.mark.parametrize(
    "row, why",
    [
        ({"a": "yo"}, "missing 'q'"),
        ({"q": "hi"}, "missing 'a'"),
        ({"q": "hi", "a": None}, "missing 'a'"),
        ({"q": "hi", "a": "   "}, "empty response"),
        ({"q": [{"role": "user", "content": "hi"}], "a": [{"role": "user", "content": "again"}]}, "no assistant turn"),
        ({"q": [{"content": "no role"}], "a": "yo"}, "malformed messages"),
        ({"q": "hi", "a": 7}, "malformed messages"),
        ({"q": [{"role": "user", "content": [{"type": "audio"}]}], "a": "yo"}, "malformed messages"),
        ({"q": "hi", "a": [{"role": "assistant", "content": [{"type": "text", "text": " "}]}]}, "empty response"),
    ],
)
def test_bad_rows_name_their_reason(row, why):
    assert to_messages(row, "q", "a") == (None, why)


def test_mask_covers_each_reply_and_its_closer():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    ids = [1, 9, 9, 2, 3, 5, 6, 7, 7, 2, 3, 1, 9, 2, 5, 6]
    ids += [8, 2, 3]  # 16 17 18: a second reply
    mask = response_mask(ids, MARKERS)
    assert np.flatnonzero(mask).tolist() == [7, 8, 9, 16, 17]
    assert np.flatnonzero(response_mask(ids, MARKERS, last_turn_only=True)).tolist() == [16, 17]


def test_mask_of_a_reply_without_a_closer_runs_to_the_end_and_a_bare_opener_supervises_nothing():
    assert np.flatnonzero(response_mask([5, 6, 7, 7], MARKERS)).tolist() == [2, 3]
    assert not response_mask([1, 5, 6], MARKERS).any()


def test_closer_that_only_opens_the_next_turn_is_not_supervised():
    m = ReplyMarkers(opener=(5, 6), closer=1, supervise_closer=False)
    assert np.flatnonzero(response_mask([5, 6, 7, 7, 1, 9], m)).tolist() == [2, 3]


def _ex(ids, sup):
    ids = np.array(ids, dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    mask[sup] = True
    return Example(ids, mask)


def test_padded_batch_labels_only_supervised_tokens():
    b = collate([_ex([1, 2, 3], [2]), _ex([4, 5, 6, 7, 8], [3, 4])], pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b["labels"].tolist() == [[-100, -100, 3, -100, -100], [-100, -100, -100, 7, 8]]
    assert collate([_ex([1, 2, 3], [2])], pad_id=0, pad_to=6)["input_ids"].shape == (1, 6)


def test_packed_batch_restarts_positions_and_never_predicts_across_samples():
    b = collate([_ex([1, 2, 3], [0, 2]), _ex([4, 5], [0, 1])], pad_id=0, packed=True, pad_to=7)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    # token 0 of each sample is no target: nothing before it in its own sample predicts it
    assert b["labels"].tolist() == [[-100, -100, 3, -100, 5, -100, -100]]
    assert "attention_mask" not in b and b["labels"].dtype == torch.int64


def test_shared_prefix_row_lays_the_common_prefix_out_once():
    b = collate([_ex([1, 2, 3, 4, 5], [3, 4]), _ex([1, 2, 3, 6, 7, 8], [4, 5])], 0, packed=True, share_prefix=True)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]
    # position k predicts token k + 1: sample 1's token 4 from the shared position 2, sample 2's 7 from its 6
    assert b["flat_index"].tolist() == [2, 3, 5, 6] and b["targets"].tolist() == [4, 5, 7, 8]
    mask = b["attention_mask"][0, 0].int().tolist()
    assert mask[5] == [1, 1, 1, 0, 0, 1, 0, 0]  # sample 2's first own token: the prefix and itself
    assert mask[4] == [1, 1, 1, 1, 1, 0, 0, 0]
    # No common prefix, or a single sample: the plain packed row.
    assert "labels" in collate([_ex([1, 2], [1]), _ex([3, 4], [1])], 0, packed=True, share_prefix=True)
    # A sample that is all prefix keeps one token of its own.
    b = collate([_ex([1, 2, 3], [2]), _ex([1, 2, 3, 4], [3])], 0, packed=True, share_prefix=True, pad_to=7)
    assert b["input_ids"].tolist() == [[1, 2, 3, 3, 4, 0, 0]] and b["targets"].tolist() == [3, 4]
    assert b["flat_index"].tolist() == [1, 3]


def test_several_datasets_are_concatenated_or_mixed_by_weight(tmp_path):
    import json

    for name, n in (("a", 30), ("b", 30)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"src": name, "i": i}) + "\n" for i in range(n)))
    spec = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"
    both = read_mixed_rows(spec, None, "train", 1000, 0, "--data.dataset")
    assert [r["src"] for r in both] == ["a"] * 30 + ["b"] * 30
    mixed = read_mixed_rows(spec, "0.75,0.25", "train", 40, 0, "--data.dataset")
    # 40 rows at 3:1 -> 30 from a (all of it), 10 from b
    assert len(mixed) == 40 and sum(r["src"] == "a" for r in mixed) == 30


def test_resume_position_follows_the_consumed_samples():
    from services.trainer.sft import position

    assert position(12, 48, 4) == (0, 12)
    assert position(12, 48, 8) == (0, 12)  # another batch size: the same next sample
    assert position(44, 48, 8) == (1, 0)  # a window past the epoch's whole batches starts the next epoch
    assert position(48, 50, 8) == (1, 0)  # the tail beyond whole batches is dropped
    assert position(3 * 8, 48, 8) == (0, 24)


def test_every_row_cut_before_its_response_names_max_len(tiny_qwen3):
    from transformers import AutoTokenizer

    from services.trainer.sft_data import Tokenized

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    rows = [{"input": "a long prompt " * 20, "output": "yes"}] * 2
    with pytest.raises(ValueError) as exc:
        Tokenized(tok, 8, "input", "output", False).build(rows, "--data.dataset")
    msg = str(exc.value)
    assert "2 response past --data.max_len" in msg and "no usable row (raise --data.max_len (8)" in msg
    assert "--data.input_key" not in msg
    with pytest.raises(ValueError, match=r"no usable row \(check --data.input_key/--data.output_key"):
        Tokenized(tok, 8, "input", "answer", False).build(rows, "--data.dataset")
