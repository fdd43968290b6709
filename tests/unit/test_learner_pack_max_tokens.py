"""``--train.pack_max_tokens`` reaches the learner's packing: with shared-prefix packing on, the learner's
forward (``Learner._logp``) lays a group out in rows of at most that many tokens, splitting a group that would
pack into one row under the default 2048 (docs/trainer.md, "A row is capped at --train.pack_max_tokens"). The
learner is reduced to what ``_logp`` reads, with the real tiny model and the real ``pack``."""

from __future__ import annotations

import pytest
import torch

import services.trainer.learner as learner_mod
from molt.config import parse_settings
from services.trainer.batch import Sample
from services.trainer.config import TrainerSettings
from services.trainer.learner import Learner

PREFIX, REST, MEMBERS = 40, 6, 4  # a long shared prompt and short answers: the layout packing is for


@pytest.fixture(scope="module")
def actor(tiny_qwen3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3).eval()


def _group() -> list[Sample]:
    prompt = list(range(10, 10 + PREFIX))
    out = []
    for k in range(MEMBERS):
        tokens = torch.tensor(prompt + list(range(100 + 10 * k, 100 + 10 * k + REST)))
        mask = torch.zeros(len(tokens) - 1, dtype=torch.bool)
        mask[PREFIX - 1 :] = True
        out.append(Sample(f"t{k}", "g", 0, 0.0, None, "pod", tokens, mask, torch.zeros(len(mask)), mask.long() - 1))
    return out


def _rows_built_by_the_learner(actor, monkeypatch, *flags: str):
    learner = object.__new__(Learner)
    learner.s = parse_settings(TrainerSettings, ["--actor.model_name_or_path", "m", *flags], environ={})
    learner.packing, learner.temperature = True, 1.0
    seen = []
    real = learner_mod.packed_token_logprobs

    def spy(model, rows, *args):
        seen.append(rows)
        return real(model, rows, *args)

    # Spy on the rows the learner hands to the packed forward: what the cap decides.
    monkeypatch.setattr(learner_mod, "packed_token_logprobs", spy)
    chunk = _group()
    mb = type("MB", (), {"action_mask": torch.stack([s.action_mask for s in chunk])})()
    with torch.no_grad():
        logp, _, _ = learner._logp(actor, mb, False, chunk)
    assert logp.shape == (MEMBERS, PREFIX + REST - 1)
    (rows,) = seen
    return learner.s.train.pack_max_tokens, rows


def test_the_default_cap_packs_the_whole_group_into_one_row(actor, monkeypatch):
    cap, rows = _rows_built_by_the_learner(actor, monkeypatch)
    assert cap == 2048
    assert tuple(rows.input_ids.shape) == (1, PREFIX + MEMBERS * REST)


def test_a_small_pack_max_tokens_splits_the_group_into_rows_within_the_cap(actor, monkeypatch):
    # 52 = the prefix and two answers: the group must take two rows, each repeating the prefix.
    cap, rows = _rows_built_by_the_learner(actor, monkeypatch, "--train.pack_max_tokens", "52")
    assert cap == 52
    assert tuple(rows.input_ids.shape) == (2, 52)
    assert sorted(rows.sample_row.unique().tolist()) == list(range(MEMBERS))  # every sample still in a row
    # A cap below prefix + two answers leaves one sample per row (the plain layout).
    _, rows = _rows_built_by_the_learner(actor, monkeypatch, "--train.pack_max_tokens", "51")
    assert tuple(rows.input_ids.shape) == (MEMBERS, PREFIX + REST)
