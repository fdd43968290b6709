"""`python -m services.trainer.push`: flags, model-dir loading, and a push to a fake pod over loopback gRPC."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import save_file

from molt.weightsync.server import start_weightsync_server
from services.trainer import push


class _Engine:
    def __init__(self, tensors):
        self.spec = {n: (tuple(t.shape), "float32") for n, t in tensors.items()}
        self.serving_dtype = ""
        self.policy_version = 4
        self.loaded = None

    def expected_parameters(self):
        return dict(self.spec)

    async def apply_weights(self, tensors, version, keep, replace=False):
        self.loaded, self.policy_version = {n: t.clone() for n, t in tensors.items()}, version
        return {"untouched": []}

    async def prompt_logprobs(self, token_ids):
        return []


def _model_dir(tmp_path, tie: bool):
    tensors = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    if not tie:
        tensors["lm_head.weight"] = torch.randn(8, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tie}))
    return tensors


def test_flags_and_missing_model(tmp_path, capsys):
    s = push.parse_settings(
        push.PushSettings,
        ["--model", str(tmp_path), "--pods", "a:1,b:2", "c:3", "--version", "7", "--transport", "gloo"],
        prog=push.PROG,
    )
    assert s.pods == ["a:1,b:2", "c:3"] and s.version == 7 and s.transport == "gloo"
    with pytest.raises(SystemExit):
        push.parse_settings(push.PushSettings, ["--modle", "x"], prog=push.PROG)
    assert "did you mean --model" in capsys.readouterr().err
    assert push.main(["--model", str(tmp_path), "--pods", "127.0.0.1:1"]) == 2
    assert "no *.safetensors" in capsys.readouterr().err


async def test_push_model_dir_to_pod(tmp_path, capsys):
    tensors = _model_dir(tmp_path, tie=False)
    engine = _Engine(tensors)
    server, port = await start_weightsync_server(engine, "127.0.0.1", 0)
    try:
        code = await asyncio.to_thread(push.main, ["--model", str(tmp_path), "--pods", f"127.0.0.1:{port}"])
    finally:
        await server.stop(0)
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] and out["version"] == 5 == engine.policy_version  # max(pod versions) + 1
    assert all(torch.equal(engine.loaded[n], t) for n, t in tensors.items())


async def test_frozen_tensors_are_not_sent_and_the_pod_keeps_its_own(tmp_path, capsys):
    """--frozen NAME (docs/weightsync.md): e.g. a frozen MoE router; the pod is told to keep its copy."""
    tensors = _model_dir(tmp_path, tie=False)
    engine = _Engine(tensors)
    server, port = await start_weightsync_server(engine, "127.0.0.1", 0)
    argv = ["--model", str(tmp_path), "--pods", f"127.0.0.1:{port}", "--frozen", "model.norm.weight"]
    try:
        code = await asyncio.to_thread(push.main, argv)
    finally:
        await server.stop(0)
    assert code == 0 and json.loads(capsys.readouterr().out)["ok"]
    assert sorted(engine.loaded) == ["lm_head.weight", "model.embed_tokens.weight"]


def test_tied_config_drops_lm_head(tmp_path):
    _model_dir(tmp_path, tie=True)
    tensors, tie = push.load_model_dir(tmp_path)
    assert tie and "lm_head.weight" not in tensors
