"""Rollout pod flags and request validation (pure: no vLLM)."""

from __future__ import annotations

import pytest

from molt.config import expand_short_flags
from services.rollout.config import parse
from services.rollout.params import Limits, RolloutInputError, check_prompt, check_sampling

LIMITS = Limits(vocab_size=1024, max_model_len=256, max_n=8)


def test_short_flags_of_the_issue_map_to_dotted_ones():
    assert expand_short_flags(["--model", "/m", "--port=7", "--vllm.seed", "3"]) == [
        "--model.path",
        "/m",
        "--server.port=7",
        "--vllm.seed",
        "3",
    ]
    s = parse(
        [
            "--model",
            "/m",
            "--port",
            "7",
            "--vllm.tensor_parallel_size",
            "2",
            "--rollout.inflight_on_update",
            "abort",
            "--grpc.port",
            "9",
        ]
    )
    assert (s.model.path, s.server.port, s.vllm.tensor_parallel_size) == ("/m", 7, 2)
    assert s.rollout.inflight_on_update == "abort" and s.grpc.port == 9
    assert s.vllm.logprobs_mode == "processed_logprobs" and s.vllm.enable_prefix_caching is False


def test_unknown_flags_and_bad_values_are_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["--model", "/m", "--vllm.tensor_paralel_size", "2"])
    assert exc.value.code == 2
    assert "did you mean --vllm.tensor_parallel_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--model", "/m", "--rollout.inflight_on_update", "keep"])
    with pytest.raises(SystemExit) as exc:
        parse([])
    assert exc.value.code == 2 and "--model.path (or --model) DIR is required" in capsys.readouterr().err


def test_sampling_defaults_and_limits():
    p = check_sampling({"n": 2, "max_tokens": 10}, prompt_len=5, limits=LIMITS)
    assert p["n"] == 2 and p["temperature"] == 1.0 and p["top_k"] == -1 and p["logprobs"] is True
    assert check_sampling(None, 5, LIMITS)["max_tokens"] == 16
    # seed -1 is vLLM's "unseeded" for every sample; a seed s seeds sample i with s + i
    from services.rollout.params import vllm_params

    assert [sp.seed for sp in vllm_params(check_sampling({"n": 3, "seed": -1}, 5, LIMITS))] == [None] * 3
    assert [sp.seed for sp in vllm_params(check_sampling({"n": 3, "seed": 7}, 5, LIMITS))] == [7, 8, 9]
    p = check_sampling(
        {"top_logprobs": 3, "logit_bias": {"7": -5}, "structured_outputs": {"json_object": True}}, 5, LIMITS
    )
    assert (p["top_logprobs"], p["logit_bias"], p["structured_outputs"]) == (3, {7: -5.0}, {"json_object": True})
    cases = [
        ({"n": 9}, "[1, 8]"),
        ({"n": 0}, "'n' must be in [1,"),
        ({"max_tokens": 252}, "context length 256"),
        ({"max_tokens": 0}, "'max_tokens' must be in [1, inf)"),
        ({"n": True}, "'n' must be an integer"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -2}, "top_k"),  # -1 and 0 both turn top-k off, as in vLLM
        ({"stop_token_ids": [2000]}, "[0, 1024)"),
        ({"beam_width": 2}, "unknown sampling param"),
        ({"min_tokens": 20}, "min_tokens"),
        ({"top_logprobs": 21}, "top_logprobs = 21 is above this pod's bound 20 (its --vllm.max_logprobs)"),
        ({"top_logprobs": -1}, "'top_logprobs' must be in [0, inf)"),
        ({"top_logprobs": 2, "logprobs": False}, "needs 'logprobs'"),
        ({"logit_bias": {"1024": 1}}, "[0, 1024)"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "exactly one of"),
    ]
    for params, needle in cases:
        with pytest.raises(RolloutInputError) as exc:
            check_sampling(params, prompt_len=5, limits=LIMITS)
        assert needle in str(exc.value), (params, str(exc.value))
        assert exc.value.param and exc.value.code


def test_max_logprobs_raises_the_pods_bound_on_top_logprobs():
    """--vllm.max_logprobs (vLLM's engine bound) is the pod's: a gateway recording a head of K > 20 for score
    centering needs pods started with K, and the default stays OpenAI's 20."""
    assert parse(["--model", "/m"]).vllm.max_logprobs == 20
    assert parse(["--model", "/m", "--vllm.max_logprobs", "64"]).vllm.max_logprobs == 64
    wide = Limits(vocab_size=1024, max_model_len=256, max_n=8, max_logprobs=64)
    assert check_sampling({"top_logprobs": 64}, 5, wide)["top_logprobs"] == 64
    with pytest.raises(RolloutInputError, match="bound 64"):
        check_sampling({"top_logprobs": 65}, 5, wide)


def test_prompt_checks():
    assert check_prompt([0, 1023], LIMITS) == [0, 1023]
    for prompt, needle in [
        ([], "non-empty"),
        ([1, -1], "outside the vocabulary"),
        ([1, 1024], "[0, 1024)"),
        ([1, 2.5], "not an integer"),
        ("abc", "list"),
        ([True], "not an integer"),
    ]:
        with pytest.raises(RolloutInputError, match=None) as exc:
            check_prompt(prompt, LIMITS)
        assert needle in str(exc.value)
    with pytest.raises(RolloutInputError, match="at most 3"):
        check_prompt([1, 2, 3, 4], Limits(1024, 256, 8, max_prompt_tokens=3))


def test_idle_poll_takes_what_comes_during_it_then_waits_for_the_next(tiny_qwen3):
    """The engine thread's wait for work (``--rollout.idle_poll_ms``): a command posted while it polls is
    taken by the poll; once the poll is over it still gets the next one, however late."""
    import threading
    import time

    from services.rollout.engine import RolloutEngine

    assert parse(["--model", "/m"]).rollout.idle_poll_ms == 5.0
    assert parse(["--model", "/m", "--rollout.idle_poll_ms", "0"]).rollout.idle_poll_ms == 0
    with pytest.raises(SystemExit):
        parse(["--model", "/m", "--rollout.idle_poll_ms", "-1"])
    engine = RolloutEngine(parse(["--model", str(tiny_qwen3)]))  # not started: only its command queue is used
    timer = threading.Timer(0.01, engine._cmds.put, args=("during",))
    timer.start()
    assert engine._next_command(time.perf_counter() + 10.0) == "during"
    engine._cmds.put("queued")
    assert engine._next_command(0.0) == "queued"  # poll already over: a plain wait
    timer = threading.Timer(0.05, engine._cmds.put, args=("late",))
    timer.start()
    assert engine._next_command(time.perf_counter() + 0.001) == "late"
    timer.join()


def test_await_push_keeps_a_pod_unready_until_its_first_weights(tiny_qwen3):
    from services.rollout.engine import RolloutEngine

    assert not RolloutEngine(parse(["--model", str(tiny_qwen3)])).awaiting_weights
    engine = RolloutEngine(parse(["--model", str(tiny_qwen3), "--weights.await_push"]))  # not started
    assert engine.awaiting_weights and not engine.ready


def test_a_pod_that_never_loaded_weights_takes_version_0_once(tiny_qwen3):
    """A trainer that has not stepped pushes version 0, the label of the pod's base weights: a fresh pod (awaiting
    that push) takes it; once it loaded weights, the same version again is refused."""
    from services.rollout.engine import RolloutEngine

    engine = RolloutEngine(parse(["--model", str(tiny_qwen3), "--weights.await_push"]))  # not started
    engine._check_version(0)
    engine.weight_apply_s.append(0.01)  # what an applied update leaves
    with pytest.raises(ValueError, match="already serves version 0"):
        engine._check_version(0)
    engine._check_version(0, replace=True)  # a forced push: a new trainer's version 0


def test_the_engine_is_built_with_vllms_older_compile_cache_on_cpu():
    """vLLM's AOT-compiled model does not load back on CPU: without this every compiled pod start compiles again.
    A user's own VLLM_USE_AOT_COMPILE wins, and a GPU keeps vLLM's default."""
    from services.rollout.engine_thread import engine_env

    assert engine_env(False, True, True, {}) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": None,
        "VLLM_USE_AOT_COMPILE": "0",
    }
    assert "VLLM_USE_AOT_COMPILE" not in engine_env(True, False, True, {"VLLM_USE_AOT_COMPILE": "1"})
    assert engine_env(True, False, False, {}) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
