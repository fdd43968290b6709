"""Weight sync into a real vLLM RolloutEngine over loopback gRPC (dense, tied embeddings).

One engine for the module (vLLM keeps one distributed state per process). Covers: a sync with the
probe check, failures that must leave the pod on its old version (stream cut mid-way, bad
checksum, shape mismatch) followed by a good sync, and the gloo collective path driven by
``python -m services.trainer.push --transport gloo`` in a second process, which must give exactly
the gRPC result.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import pytest_asyncio
import torch
from rollout_testlib import PROMPT, hf_token_logprobs, max_abs_diff, tiny_settings

from molt.serve import cpu_env
from molt.weightsync.check import probe_check
from molt.weightsync.client import GrpcPodClient, PodError
from molt.weightsync.layout import plan_layout
from molt.weightsync.pusher import WeightPusher, WeightPushError, make_chunks
from molt.weightsync.server import start_weightsync_server
from molt.weightsync.wire import decode_chunk, encode_chunk, layout_to_begin
from services.rollout.engine import RolloutEngine

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300), pytest.mark.vllm]
TOL = 1e-4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hf_state(path) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return dict(model.state_dict()), model  # a tied model lists lm_head.weight too: the pusher drops it


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pod(tiny_qwen3):
    engine = RolloutEngine(tiny_settings(tiny_qwen3))
    await engine.start()
    server, port = await start_weightsync_server(engine, "127.0.0.1", 0)
    client = GrpcPodClient(f"127.0.0.1:{port}")
    try:
        yield engine, f"127.0.0.1:{port}", client
    finally:
        await client.close()
        await server.stop(0)
        await engine.close()


async def _parity(engine, model_dir) -> list[float]:
    got = await engine.prompt_logprobs(PROMPT)
    assert max_abs_diff(got, hf_token_logprobs(model_dir, PROMPT[:1], PROMPT[1:])) < TOL
    return got


async def test_sync_with_check_matches_transformers(pod, tiny_qwen3, tiny_qwen3_b):
    engine, target, client = pod
    await _parity(engine, tiny_qwen3)
    state, model = _hf_state(tiny_qwen3_b)
    pusher = WeightPusher([target], bucket_bytes=256 << 10)  # several buckets for a 1.7 MB model
    report = await pusher.push_async(state, version=1, check=probe_check(model, max_abs_diff=TOL))
    assert report.pods[target]["promoted"] and report.pods[target]["untouched"] == []
    assert 0 <= report.pods[target]["check_max_abs_diff"] < TOL
    assert engine.policy_version == 1 and (await client.status()).version == 1
    await _parity(engine, tiny_qwen3_b)
    await pusher._pods()[0].close()


async def _until_error(client, needle: str):
    for _ in range(100):
        status = await client.status()
        if needle in status.last_error:
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"pod never reported {needle!r}: {status}")


async def test_failures_keep_old_version_then_next_sync_succeeds(pod, tiny_qwen3, tiny_qwen3_b):
    engine, target, client = pod
    before = engine.policy_version
    state, _ = _hf_state(tiny_qwen3)
    tensors = {n: t for n, t in state.items() if n != "lm_head.weight"}
    layout = plan_layout(tensors.items(), 256 << 10)
    chunks = list(make_chunks(layout, tensors, "cut", 64 << 10))

    # 1. the stream is cut mid-way
    await client.begin(layout_to_begin(layout, sync_id="cut", version=before + 1, checksum="xxh3_64"))
    stream = client.open_push()
    for raw in chunks[: len(chunks) // 2]:
        await stream.write(raw)
    # Cut it once the pod has staged some of it: a write returns when gRPC has queued the bytes, so on a busy
    # machine a cancel right away can reach the pod before any chunk, which names no sync to fail.
    for _ in range(200):
        if (await client.status()).buckets_staged > 0:
            break
        await asyncio.sleep(0.01)
    stream.cancel()
    status = await _until_error(client, "interrupted")
    assert status.version == before and status.state == "idle"
    with pytest.raises(PodError, match="FAILED_PRECONDITION.*no pending sync"):
        from molt._proto import weightsync_pb2 as pb

        await client.commit(pb.CommitRequest(sync_id="cut", version=before + 1))

    # 2. one flipped byte: the bucket checksum catches it
    await client.begin(layout_to_begin(layout, sync_id="flip", version=before + 1, checksum="xxh3_64"))
    stream = client.open_push()
    with pytest.raises(PodError, match="DATA_LOSS.*checksum mismatch"):
        for i, raw in enumerate(make_chunks(layout, tensors, "flip", 64 << 10)):
            if i == 2:
                sid, b, off, digest, data = decode_chunk(raw)
                raw = encode_chunk(sid, b, off, digest, [bytes([data[0] ^ 0xFF]), data[1:]])
            await stream.write(raw)
        await stream.done()
    assert (await client.status()).version == before

    # 3. a shape the engine does not have
    bad = dict(state)
    bad["model.norm.weight"] = torch.ones(bad["model.norm.weight"].shape[0] + 1)
    pusher = WeightPusher([target])
    with pytest.raises(WeightPushError, match="shape mismatch for model.norm.weight"):
        await pusher.push_async(bad, version=before + 1)
    status = await client.status()
    assert status.version == engine.policy_version == before and "shape mismatch" in status.last_error
    await _parity(engine, tiny_qwen3_b)  # still the weights of the last good sync

    # 4. the next sync goes through
    report = await pusher.push_async(state, version=before + 1)
    assert report.pods[target]["version"] == before + 1 == engine.policy_version
    await _parity(engine, tiny_qwen3)
    await pusher._pods()[0].close()


async def test_gloo_collective_from_a_second_process_equals_grpc(pod, tiny_qwen3, tiny_qwen3_b):
    engine, target, client = pod
    state, _ = _hf_state(tiny_qwen3_b)
    pusher = WeightPusher([target])
    await pusher.push_async(state, version=engine.policy_version + 1)
    via_grpc = await engine.prompt_logprobs(PROMPT)
    await pusher.push_async(_hf_state(tiny_qwen3)[0], version=engine.policy_version + 1)  # away from b again
    await pusher._pods()[0].close()
    version = engine.policy_version + 1
    env = cpu_env()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.trainer.push",
        "--model",
        str(tiny_qwen3_b),
        "--pods",
        target,
        "--transport",
        "gloo",
        "--version",
        str(version),
        "--bucket_bytes",
        str(256 << 10),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, out.decode()[-3000:]
    assert engine.policy_version == version
    status = await client.status()
    assert status.collective.startswith("gloo rank 1/2")
    via_gloo = await engine.prompt_logprobs(PROMPT)
    assert via_gloo == via_grpc
    await _parity(engine, tiny_qwen3_b)


async def test_partial_lora_sync_keeps_the_rest_and_passes_the_check(pod, tiny_qwen3):
    """The RL trainer under --actor.lora: after a full push it sends only the merged adapted weights, with
    keep_unsent; the pod keeps every other parameter (named by its own listing, so the tied head is not) and its
    probe matches the adapted model. Without keep_unsent the same partial push is refused."""
    from services.trainer import lora

    engine, target, client = pod
    state, model = _hf_state(tiny_qwen3)
    pusher = WeightPusher([target], keep_unsent=True)
    await pusher.push_async(state, version=engine.policy_version + 1)  # the base, in full (nothing kept)
    modules = lora.apply(model, rank=4, alpha=8.0, patterns=["*_proj"], seed=0)
    with torch.no_grad():
        for name in modules:
            model.get_submodule(name).lora_B.weight.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    partial = lora.merged_targets(model.state_dict(), lora.scale_of(model))
    assert set(partial) == {f"{m}.weight" for m in modules}
    with pytest.raises(WeightPushError, match="neither sent nor kept"):
        await WeightPusher([target]).push_async(partial, version=engine.policy_version + 1)
    version = engine.policy_version + 1
    report = await pusher.push_async(partial, version=version, check=probe_check(model, max_abs_diff=TOL))
    assert report.pods[target]["promoted"] and engine.policy_version == version
    assert 0 <= report.pods[target]["check_max_abs_diff"] < TOL
    kept = set(report.kept)
    assert "model.embed_tokens.weight" in kept and "lm_head.weight" not in kept and not kept & set(partial)
    got = await engine.prompt_logprobs(PROMPT)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, :-1], -1)
    assert max_abs_diff(got, want.gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0].tolist()) < TOL
    await pusher._pods()[0].close()


async def test_a_second_server_on_a_taken_port_is_refused(pod):
    """gRPC binds with SO_REUSEPORT by default: a second pod on the same machine and port would bind too and
    take a share of the trainer's connections. The weight-sync server turns it off, so that bind fails."""
    engine, target, _ = pod
    port = int(target.rsplit(":", 1)[1])
    with pytest.raises(OSError, match="could not bind"):
        await start_weightsync_server(engine, "127.0.0.1", port)


async def test_a_forced_push_replaces_the_weights_behind_the_current_version(pod, tiny_qwen3, tiny_qwen3_b):
    """A new trainer's first push is forced and numbered 0, as the previous trainer's was: the pod must serve the
    new weights, not keep the old ones under the same number. An unforced push of the same number is refused."""
    engine, target, _ = pod
    state, _ = _hf_state(tiny_qwen3)
    other, other_model = _hf_state(tiny_qwen3_b)
    pusher = WeightPusher([target])
    version = engine.policy_version + 1
    await pusher.push_async(state, version=version)
    await _parity(engine, tiny_qwen3)
    with pytest.raises(WeightPushError, match="not newer"):
        await pusher.push_async(other, version=version)
    report = await pusher.push_async(other, version=version, force=True, check=probe_check(other_model))
    assert report.pods[target]["promoted"] and engine.policy_version == version
    await _parity(engine, tiny_qwen3_b)
    await pusher._pods()[0].close()
