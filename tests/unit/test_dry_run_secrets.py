"""`--dry-run` of every service prints its resolved config with the secrets masked; `molt up` gives the gateway
the context length its pods run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from molt.config import MASK, mask_secrets
from molt.stack.recipes import RECIPES, flag_value, gateway_context_args

SECRET = "hunter2-s3cret"


def test_keys_passwords_tokens_and_url_passwords_are_masked_counts_are_not():
    cfg = {
        "auth": {"api_keys": ["a", "b"], "max_open_sessions_per_key": 5},
        "redis": {"url": f"redis://:{SECRET}@h:6379/0", "stream": "s"},
        "gateway": {"api_key": "k", "url": f"http://user:{SECRET}@gw:1"},
        "weightsync": {"token": "t", "secret": None},
        "rollout": {"max_tokens": 4, "skip_special_tokens": True},
    }
    out = mask_secrets(cfg)
    assert out["auth"] == {"api_keys": [MASK, MASK], "max_open_sessions_per_key": 5}
    assert out["redis"]["url"] == f"redis://:{MASK}@h:6379/0" and out["gateway"]["url"] == f"http://user:{MASK}@gw:1"
    assert out["gateway"]["api_key"] == MASK and out["weightsync"] == {"token": MASK, "secret": None}
    assert out["rollout"] == cfg["rollout"]


@pytest.mark.parametrize(
    "module,args",
    [
        (
            "services.gateway",
            ["--model.path", "m", "--auth.api_keys", SECRET, "--redis.url", f"redis://:{SECRET}@h:1/0"],
        ),
        (
            "services.envs",
            ["--agent", "a=examples/recipes/digits.py", "--gateway.url", "http://g:1", "--gateway.api_key", SECRET],
        ),
        (
            "services.trainer",
            ["--model.path", "m", "--train.dispatch", "false", "--redis.url", f"redis://u:{SECRET}@h:1/0"],
        ),
        ("services.rollout", ["--model.path", "m"]),
    ],
)
def test_dry_run_of_every_service_prints_no_secret(module, args):
    out = subprocess.run(
        [sys.executable, "-m", module, *args, "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert SECRET not in out.stdout and SECRET not in out.stderr


def test_molt_up_gives_the_gateway_the_context_its_pods_run():
    tiny = RECIPES["tiny"]
    assert gateway_context_args(tiny.rollout) == [
        "--session.max_length",
        flag_value(tiny.rollout, "--vllm.max_model_len"),
    ]
    assert flag_value(tiny.rollout, "--vllm.max_model_len") == "256"
    # an extra rollout flag (molt up --rollout.* passthrough) wins, as it does on the pods
    assert gateway_context_args([*tiny.rollout, "--vllm.max_model_len=128"]) == ["--session.max_length", "128"]
    assert gateway_context_args([]) == []
