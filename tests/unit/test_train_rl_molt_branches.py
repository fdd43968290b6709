"""Flags of Molt's other branches and earlier releases that `molt train-rl` takes: the advantage's mean-only
whitening (--algo.advantage.no_std_norm) and the earlier IS-correction switch (--algo.advantage.is_correction_enable
with --algo.advantage.is_correction_type), which becomes the level and mode that compute the same weights."""

from __future__ import annotations

import pytest

from molt.algorithms import PolicyLoss, build_policy_loss, validate_algo
from molt.config import parse_settings
from molt.stack import train_rl as tr
from molt.stack import train_rl_helm as trh
from services.gateway.config import GatewaySettings
from services.trainer.config import TrainerSettings

BASE = ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a.py"]


def _trainer(r: tr.Routed) -> TrainerSettings:
    return parse_settings(TrainerSettings, r.trainer, prog="trainer")


def test_no_std_norm_reaches_the_trainer():
    r = tr.route(BASE + ["--algo.advantage.no_std_norm"], "helm")
    assert _trainer(r).algo.advantage.no_std_norm


@pytest.mark.parametrize(
    ("kind", "level", "mode"), [("tis", "token", "clip"), ("icepop", "token", "mask"), ("seq-mask-tis", "geo", "mask")]
)
def test_the_earlier_is_switch_becomes_level_and_mode(kind, level, mode):
    flags = ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", kind]
    flags += ["--algo.advantage.is_correction_threshold", "0.5", "2.0"]
    r = tr.route(BASE + flags, "helm")
    adv = _trainer(r).algo.advantage
    assert (adv.is_correction_level, adv.is_correction_mode, adv.is_correction_threshold) == (level, mode, [0.5, 2])
    assert any(f"--algo.advantage.is_correction_level {level}" in n for n in r.notes)
    s = _trainer(r)
    validate_algo(s.algo, s.actor, 8)
    assert isinstance(build_policy_loss(s.actor, s.algo), PolicyLoss)


def test_the_switch_alone_is_tis_and_the_type_alone_does_nothing():
    adv = _trainer(tr.route(BASE + ["--algo.advantage.is_correction_enable"], "helm")).algo.advantage
    assert (adv.is_correction_level, adv.is_correction_mode) == ("token", "clip")
    r = tr.route(BASE + ["--algo.advantage.is_correction_type", "icepop"], "helm")
    assert _trainer(r).algo.advantage.is_correction_level == "off"
    assert any("no effect without --algo.advantage.is_correction_enable" in n for n in r.notes)


def test_both_spellings_or_an_unknown_type_are_refused():
    both = ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_level", "geo"]
    with pytest.raises(ValueError, match="both set the IS correction"):
        tr.route(BASE + both, "helm")
    bad = ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "reinforce_pro"]
    with pytest.raises(ValueError, match="choose one of tis, icepop, seq-mask-tis"):
        tr.route(BASE + bad, "helm")


@pytest.mark.parametrize(
    ("flag", "on"), [("--rollout.rescore_logprobs", True), ("--no-rollout.rescore_logprobs", False)]
)
def test_rescore_logprobs_is_the_gateways(flag, on):
    """Molt's --rollout.rescore_logprobs (a BooleanOptionalAction) re-reads the action logprobs through a prefill
    pass: here the gateway does it at finish (docs/gateway.md)."""
    r = tr.route(BASE + [flag], "helm")
    assert "--rollout.rescore_logprobs" in r.gateway and not any("rescore" in a for a in r.trainer)
    assert (
        parse_settings(GatewaySettings, ["--model", "/m", *r.gateway], prog="gateway").rollout.rescore_logprobs is on
    )


def test_rescoring_gives_the_pods_one_position_more_than_the_sessions():
    """vLLM takes no prompt as long as its whole context, and a rescoring prefill's prompt is a whole segment: under
    --rollout.rescore_logprobs the pods run --data.max_len + 1 and the sessions keep --data.max_len, on Helm and on
    the local stack alike."""
    from molt.stack.recipes import gateway_context_args

    for order in (
        ["--data.max_len", "512", "--rollout.rescore_logprobs"],
        ["--rollout.rescore_logprobs", "--data.max_len", "512"],
    ):
        r = tr.route(BASE + order, "helm")
        assert r.rollout[-2:] == ["--vllm.max_model_len", "513"]
        assert trh.helm_values(r, {})["gateway"]["extraArgs"][-2:] == ["--session.max_length", "512"]
        assert gateway_context_args(r.rollout, r.gateway) == ["--session.max_length", "512"]
    r = tr.route(BASE + ["--data.max_len", "512", "--no-rollout.rescore_logprobs"], "helm")
    assert r.rollout[-2:] == ["--vllm.max_model_len", "512"]
    assert gateway_context_args(r.rollout, r.gateway) == ["--session.max_length", "512"]
    assert gateway_context_args(["--vllm.max_model_len", "256"], ["--rollout.rescore_logprobs"]) == [
        "--session.max_length",
        "255",
    ]
