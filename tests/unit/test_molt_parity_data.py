"""Parity with Molt's own rules for the data the trainer reads: prompt rows (chat or raw, labels) and the SFT
loss mask (reply markers found from the chat template alone, every reply supervised and no prompt token).

Each expected value follows from the rule as Molt states it; the trainer-side rules (advantages, losses,
checkpoints) are in test_molt_parity_trainer.py.
"""

from __future__ import annotations

import pytest

# ---------------------------------------------------------------- prompt dataset


def _prompts(tmp_path, rows, **kw):
    import json

    from services.trainer.dispatch import PromptDataset

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw.setdefault("max_samples", 100)
    return PromptDataset(str(path), "prompt", kw.pop("label_key", "answer"), seed=0, **kw)


def test_chat_rows_pass_through_whole_and_strings_become_one_user_turn(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>\nWhat is x?"}]
    ds = _prompts(tmp_path, [{"prompt": chat, "answer": "42"}, {"prompt": "hi", "answer": ""}], chat=True)
    by_index = {ds.row(p): ds.get(p) for p in range(2)}
    assert by_index[0].prompt == chat and by_index[0].label == "42"  # the system turn is kept
    assert by_index[1].prompt == [{"role": "user", "content": "hi"}]


def test_raw_rows_are_fed_verbatim_and_no_label_key_means_an_empty_label(tmp_path):
    ds = _prompts(tmp_path, [{"prompt": "pre-rendered", "answer": "7"}], chat=False, label_key=None)
    assert ds.get(0).prompt == "pre-rendered" and ds.get(0).label == ""
    assert ds.get(0).datasource == "default"


# ---------------------------------------------------------------- SFT reply markers and loss mask


class _CharTok:
    """Splits text into the listed special tokens and single characters, one id each (assigned on first sight),
    so a template's markers become stable token-id runs."""

    SPECIAL = (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<bos>",
        "[gMASK]",
        "<sop>",
        "<|user|>",
        "<|assistant|>",
        "<BOS>",
        "<EOS>",
        "<User>",
        "<Assistant>",
        "<think>",
        "</think>",
    )

    def __init__(self, render) -> None:
        self.render, self.ids, self.names = render, {}, {}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize
        return self.render(messages, add_generation_prompt)

    def _pieces(self, text):
        i = 0
        while i < len(text):
            special = next((s for s in self.SPECIAL if text.startswith(s, i)), None)
            piece = special or text[i]
            yield piece
            i += len(piece)

    def __call__(self, text, add_special_tokens=False):
        out = []
        for piece in self._pieces(text):
            if piece not in self.ids:
                self.ids[piece] = len(self.ids) + 1
                self.names[self.ids[piece]] = piece
            out.append(self.ids[piece])
        return {"input_ids": out}

    def decode(self, ids):
        return "".join(self.names[i] for i in ids)


def _chatml(think: str):
    """ChatML; ``think``: 'none', 'last' (empty think block on the final reply only) or 'every' reply."""

    def render(messages, gen):
        out = ""
        for k, m in enumerate(messages):
            body = m["content"]
            if m["role"] == "assistant" and (think == "every" or (think == "last" and k == len(messages) - 1)):
                body = "<think></think>" + body
            out += f"<|im_start|>{m['role']}\n{body}<|im_end|>\n"
        if gen:
            out += "<|im_start|>assistant\n" + ("<think>" if think != "none" else "")
        return out

    return render


def _role_openers(messages, gen):
    out = ""
    for m in messages:
        body = ("<think></think>" if m["role"] == "assistant" else "") + m["content"]
        out += f"<|im_{m['role']}|>{m['role']}<|im_middle|>{body}<|im_end|>"
    return out + ("<|im_assistant|>assistant<|im_middle|><think>" if gen else "")


def _alternating(messages, gen):
    out = "<bos>"
    for k, m in enumerate(messages):
        if (m["role"] == "user") != (k % 2 == 0):
            raise ValueError("roles must alternate")
        out += f"<start_of_turn>{'model' if m['role'] == 'assistant' else m['role']}\n{m['content']}<end_of_turn>\n"
    return out + ("<start_of_turn>model\n" if gen else "")


def _no_terminator(messages, gen):
    out = "[gMASK]<sop>" + "".join(f"<|{m['role']}|>\n{m['content']}" for m in messages)
    return out + ("<|assistant|>\n" if gen else "")


def _eos_closed(messages, gen):
    out = "<BOS>"
    for m in messages:
        out += f"<User>{m['content']}" if m["role"] == "user" else f"<Assistant>{m['content']}<EOS>"
    return out + ("<Assistant>" if gen else "")


TEMPLATES = [
    ("chatml-think-last", _chatml("last"), "<|im_start|>assistant\n", "<|im_end|>", True),
    ("chatml-think-every", _chatml("every"), "<|im_start|>assistant\n<think>", "<|im_end|>", True),
    ("chatml", _chatml("none"), "<|im_start|>assistant\n", "<|im_end|>", True),
    ("role-openers", _role_openers, "<|im_assistant|>assistant<|im_middle|><think>", "<|im_end|>", True),
    ("alternating", _alternating, "<start_of_turn>model\n", "<end_of_turn>", True),
    ("no-terminator", _no_terminator, "<|assistant|>\n", "<|user|>", False),
    ("eos-closed", _eos_closed, "<Assistant>", "<EOS>", True),
]
CONVERSATION = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "six"},
]


@pytest.mark.parametrize(
    ("name", "render", "opener", "closer", "supervised"), TEMPLATES, ids=[t[0] for t in TEMPLATES]
)
def test_reply_markers_are_found_from_the_template_alone(name, render, opener, closer, supervised):
    from services.trainer.sft_data import reply_markers

    tok = _CharTok(render)
    markers = reply_markers(tok)
    assert tok.decode(markers.opener) == opener
    assert tok.decode([markers.closer]) == closer
    assert markers.supervise_closer is supervised


@pytest.mark.parametrize(
    ("name", "render", "opener", "closer", "supervised"), TEMPLATES, ids=[t[0] for t in TEMPLATES]
)
def test_loss_mask_covers_every_reply_and_no_prompt(name, render, opener, closer, supervised):
    from services.trainer.sft_data import reply_markers, response_mask

    tok = _CharTok(render)
    markers = reply_markers(tok)
    ids = tok(tok.apply_chat_template(CONVERSATION))["input_ids"]
    taught = tok.decode([t for t, m in zip(ids, response_mask(ids, markers)) if m])
    assert "four" in taught and "six" in taught
    assert (closer in taught) is supervised  # the stop token is taught only when it is the model's own
    assert "2+2?" not in taught and "3+3?" not in taught
    last = tok.decode([t for t, m in zip(ids, response_mask(ids, markers, last_turn_only=True)) if m])
    assert "six" in last and "four" not in last
