"""Pod-side core and trainer-side pusher against a small fake engine (in memory and over loopback gRPC)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from molt._proto import weightsync_pb2 as pb
from molt.weightsync.client import GrpcPodClient, LocalPodClient, PodError
from molt.weightsync.core import WeightSyncCore
from molt.weightsync.layout import plan_layout
from molt.weightsync.pusher import WeightPusher, WeightPushError, make_chunks
from molt.weightsync.server import start_weightsync_server
from molt.weightsync.wire import encode_chunk, layout_to_begin


class FakeEngine:
    """The RolloutEngine members weight sync uses; logprobs are a function of the weights."""

    def __init__(
        self, state: dict[str, torch.Tensor], tied: bool = True, allow_rollback: bool = False, serving_dtype: str = ""
    ) -> None:
        self.allow_rollback = allow_rollback
        self.params = {n: t.clone() for n, t in state.items() if not (tied and n == "lm_head.weight")}
        self.serving_dtype = serving_dtype
        self.policy_version = 0
        self.applied = 0
        self.corrupt = 0  # the next `corrupt` loads silently go wrong

    def expected_parameters(self):
        return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in self.params.items()}

    async def apply_weights(self, tensors, version, keep, replace=False):
        if version <= self.policy_version and not self.allow_rollback:
            raise ValueError(f"version {version} must be greater than the current version {self.policy_version}")
        assert set(tensors) | set(keep) == set(self.params)
        for n, t in tensors.items():
            self.params[n].copy_(t)
            if self.corrupt:
                self.params[n].add_(1.0)
        self.corrupt = max(0, self.corrupt - 1)
        self.policy_version = version
        self.applied += 1
        return {"untouched": sorted(keep)}

    async def prompt_logprobs(self, token_ids):
        return [float(self.params["model.embed_tokens.weight"][t].sum()) for t in token_ids[1:]]


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.mlp.gate.weight": torch.randn(4, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(32, generator=g),
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


def _equal(engine, state, skip=()):
    return all(
        torch.equal(engine.params[n], state[n].to(engine.params[n].dtype)) for n in engine.params if n not in skip
    )


def _check(engine_like_state, ids=(1, 5, 9)):
    lp = [float(engine_like_state["model.embed_tokens.weight"][t].sum()) for t in ids[1:]]
    return pb.ProbeCheck(token_ids=list(ids), expected_logprobs=lp, max_abs_diff=1e-4)


async def test_local_sync_tied_frozen_and_versions():
    engine = FakeEngine(_state(0))
    core = WeightSyncCore(engine)
    new = _state(1)
    pusher = WeightPusher(
        [LocalPodClient(core, "pod0")], frozen=["model.layers.0.mlp.gate.weight"], bucket_bytes=4096, chunk_bytes=1000
    )
    report = await pusher.push_async(new, version=1)
    assert engine.policy_version == 1 and report.pods["pod0"]["version"] == 1
    assert _equal(engine, new, skip={"model.layers.0.mlp.gate.weight"})
    assert not torch.equal(engine.params["model.layers.0.mlp.gate.weight"], new["model.layers.0.mlp.gate.weight"])
    assert report.kept == ["model.layers.0.mlp.gate.weight"] and report.tensors == 3  # tied lm_head dropped
    assert core.status()["syncs_ok"] == 1 and core.status()["state"] == "idle"
    sample = pusher.metrics.registry.get_sample_value("molt_weightsync_version", {"side": "trainer"})
    assert sample == 1


async def test_floating_tensors_travel_in_the_dtype_every_pod_serves():
    """Pods serving bf16 get an fp32 trainer's tensors as bf16: half the bytes, the values the engine's own cast on
    load would give. A tensor already narrower (the bf16 q_proj) and non-floating ones travel as held."""
    engines = [FakeEngine(_state(0), serving_dtype="bfloat16") for _ in range(2)]
    pods = [LocalPodClient(WeightSyncCore(e), f"pod{i}") for i, e in enumerate(engines)]
    new = _state(1)
    report = await WeightPusher(pods, bucket_bytes=4096).push_async(new, version=1)
    sent = {n: t for n, t in new.items() if n != "lm_head.weight"}
    assert report.bytes == plan_layout(sent.items(), 4096, torch.bfloat16).total_bytes
    assert report.bytes < 0.6 * plan_layout(sent.items(), 4096).total_bytes
    for e in engines:
        assert all(torch.equal(e.params[n], t.to(torch.bfloat16).to(e.params[n].dtype)) for n, t in sent.items())


@pytest.mark.parametrize("served", [("bfloat16", ""), ("bfloat16", "float16"), ("nf4", "nf4")])
async def test_pods_without_one_wire_dtype_get_tensors_as_held(served):
    engines = [FakeEngine(_state(0), serving_dtype=d) for d in served]
    pods = [LocalPodClient(WeightSyncCore(e), f"pod{i}") for i, e in enumerate(engines)]
    new = _state(1)
    report = await WeightPusher(pods, bucket_bytes=4096).push_async(new, version=1)
    sent = {n: t for n, t in new.items() if n != "lm_head.weight"}
    assert report.bytes == plan_layout(sent.items(), 4096).total_bytes
    assert all(_equal(e, new) for e in engines)


async def test_stale_version_refused_and_force():
    engine = FakeEngine(_state(0))
    core = WeightSyncCore(engine)
    pusher = WeightPusher([LocalPodClient(core, "p")], tie_word_embeddings=True)
    await pusher.push_async(_state(1), version=2)
    with pytest.raises(WeightPushError, match="not newer than the pod's version 2"):
        await pusher.push_async(_state(2), version=2)
    assert engine.policy_version == 2 and _equal(engine, _state(1))


async def _begin(core, state, version, bucket_bytes=1024, keep=()):
    layout = plan_layout([(n, t) for n, t in state.items() if n != "lm_head.weight"], bucket_bytes)
    req = layout_to_begin(layout, sync_id=f"s{version}", version=version, keep=list(keep), checksum="xxh3_64")
    await LocalPodClient(core).begin(req)
    return layout, {n: t for n, t in state.items() if n != "lm_head.weight"}


async def _chunks(items):
    for x in items:
        yield x


def _decoded(layout, tensors, sync_id, corrupt_at=None):
    from molt.weightsync.wire import decode_chunk

    out = []
    for i, raw in enumerate(make_chunks(layout, tensors, sync_id, 300)):
        sid, b, off, digest, data = decode_chunk(raw)
        if i == corrupt_at:
            data = memoryview(bytes([data[0] ^ 1]) + bytes(data[1:]))
        out.append((sid, b, off, digest, data))
    return out


async def test_interrupted_stream_keeps_old_weights_then_next_sync_succeeds():
    old, new = _state(0), _state(1)
    engine = FakeEngine(old)
    core = WeightSyncCore(engine)
    layout, tensors = await _begin(core, new, 1)
    chunks = _decoded(layout, tensors, "s1")
    with pytest.raises(Exception, match="ended after"):
        await core.push(_chunks(chunks[: len(chunks) // 2]))
    status = core.status()
    assert status["state"] == "idle" and "Push interrupted: the stream ended after" in status["last_error"]
    with pytest.raises(Exception, match="no pending sync"):
        await core.commit("s1", 1)
    assert engine.policy_version == 0 and engine.applied == 0 and _equal(engine, old)
    pusher = WeightPusher([LocalPodClient(core)], tie_word_embeddings=True)
    await pusher.push_async(new, version=1)
    assert engine.policy_version == 1 and _equal(engine, new)


async def test_bad_checksum_and_shape_mismatch():
    old = _state(0)
    engine = FakeEngine(old)
    core = WeightSyncCore(engine)
    layout, tensors = await _begin(core, _state(1), 1)
    with pytest.raises(Exception, match="bucket 0 checksum mismatch"):
        await core.push(_chunks(_decoded(layout, tensors, "s1", corrupt_at=1)))
    assert core.status()["last_error_version"] == 1 and engine.policy_version == 0
    bad = _state(1)
    bad["model.norm.weight"] = torch.ones(33)
    with pytest.raises(PodError, match="INVALID_ARGUMENT.*shape mismatch for model.norm.weight"):
        await _begin(core, bad, 1)
    assert engine.policy_version == 0 and _equal(engine, old)
    assert (
        core.metrics.registry.get_sample_value("molt_weightsync_failures_total", {"side": "pod", "reason": "checksum"})
        == 1
    )


@pytest.mark.parametrize("allow_rollback", [True, False])
async def test_check_refuses_and_rolls_back_to_previous_copy(allow_rollback):
    engine = FakeEngine(_state(0), allow_rollback=allow_rollback)
    core = WeightSyncCore(engine)
    pusher = WeightPusher([LocalPodClient(core, "p")], tie_word_embeddings=True)
    v1 = _state(1)
    report = await pusher.push_async(v1, version=1, check=_check(v1))
    assert report.pods["p"]["check_max_abs_diff"] < 1e-6 and core.status()["has_rollback_copy"]
    engine.corrupt = 1  # the next load goes wrong: the check catches it
    v2 = _state(2)
    with pytest.raises(WeightPushError, match="weight check failed for version 2") as info:
        await pusher.push_async(v2, version=2, check=_check(v2))
    assert "p" in info.value.report.failed
    if allow_rollback:
        assert "rolled back to version 1" in core.status()["last_error"]
        assert engine.policy_version == 1 and _equal(engine, v1)
    else:  # RolloutEngine's versions only move forward: said loudly, never silently
        assert "refused the rollback" in core.status()["last_error"] and engine.policy_version == 2
    assert pusher.metrics.registry.get_sample_value("molt_weightsync_check_failures_total", {"rollout_url": "p"}) == 1


async def test_grpc_loopback_two_pods_and_status():
    engines = [FakeEngine(_state(0)), FakeEngine(_state(0))]
    servers = [await start_weightsync_server(e, "127.0.0.1", 0) for e in engines]
    targets = [f"127.0.0.1:{port}" for _, port in servers]
    pusher = WeightPusher(targets, bucket_bytes=2048, chunk_bytes=512)
    try:
        new = _state(3)
        report = await pusher.push_async(new, version=5)
        assert sorted(report.pods) == sorted(targets)
        assert all(e.policy_version == 5 and _equal(e, new) for e in engines)
        status = await GrpcPodClient(targets[0]).status(include_parameters=True)
        assert status.version == 5 and status.syncs_ok == 1
        assert "lm_head.weight" not in {p.name for p in status.parameters}
        # a pod gone: the other one still commits
        await servers[1][0].stop(0)
        with pytest.raises(WeightPushError) as info:
            await pusher.push_async(_state(4), version=6)
        report2 = info.value.report
        assert list(report2.pods) == [targets[0]] and targets[1] in report2.failed
        assert engines[0].policy_version == 6 and engines[1].policy_version == 5
    finally:
        for c in pusher._clients or []:
            await c.close()
        for s, _ in servers:
            await s.stop(0)


async def test_grpc_checksum_error_reaches_the_trainer():
    engine = FakeEngine(_state(0))
    server, port = await start_weightsync_server(engine, "127.0.0.1", 0)
    client = GrpcPodClient(f"127.0.0.1:{port}")
    try:
        tensors = {n: t for n, t in _state(1).items() if n != "lm_head.weight"}
        layout = plan_layout(tensors.items(), 1024)
        await client.begin(layout_to_begin(layout, sync_id="x", version=1, checksum="xxh3_64"))
        stream = client.open_push()
        await stream.write(encode_chunk("x", 0, 0, 12345, [bytes(layout.bucket_size(0))]))
        with pytest.raises(PodError, match="DATA_LOSS.*checksum mismatch"):
            for raw in list(make_chunks(layout, tensors, "x"))[1:]:
                await stream.write(raw)
            await stream.done()
        status = await client.status()
        assert status.version == 0 and "checksum mismatch" in status.last_error
    finally:
        await client.close()
        await server.stop(0)


def test_blocking_push_from_sync_code():
    async def make():
        return WeightSyncCore(FakeEngine(_state(0)))

    # the core lives on the pusher's own loop, as a colocated pod would
    pusher = WeightPusher(["unused:1"], tie_word_embeddings=True)
    core = pusher._run(make())
    pusher._targets = [LocalPodClient(core, "p")]
    report = pusher.push(_state(1), version=1)
    assert report.pods["p"]["version"] == 1 and report.total_s > 0
    pusher.close()


async def test_staging_reuse_never_clobbers_the_rollback_copy():
    engine = FakeEngine(_state(0), allow_rollback=True)
    core = WeightSyncCore(engine)
    pusher = WeightPusher([LocalPodClient(core, "p")], tie_word_embeddings=True, bucket_bytes=4096)
    ptrs = []
    for v in (1, 2, 3):
        await pusher.push_async(_state(v), version=v)
        ptrs.append(core._previous.staging.data_ptr())
    assert ptrs[2] == ptrs[0] != ptrs[1]  # sync 3 reused sync 1's buffer; sync 2's is the rollback copy
    engine.corrupt = 1
    with pytest.raises(WeightPushError):
        await pusher.push_async(_state(4), version=4, check=_check(_state(4)))
    assert engine.policy_version == 3 and _equal(engine, _state(3))


async def test_superseded_stream_cannot_touch_the_next_sync():
    engine = FakeEngine(_state(0))
    core = WeightSyncCore(engine)
    layout, tensors = await _begin(core, _state(1), 1)
    chunks = _decoded(layout, tensors, "s1")
    feed: asyncio.Queue = asyncio.Queue()

    async def stream():
        while (item := await feed.get()) is not None:
            yield item

    first = asyncio.ensure_future(core.push(stream()))
    await feed.put(chunks[0])
    await asyncio.sleep(0)
    layout2, tensors2 = await _begin(core, _state(2), 2)  # supersedes s1 (and may reuse its buffer)
    await feed.put(chunks[1])
    with pytest.raises(Exception, match="aborted or superseded"):
        await first
    pusher_chunks = _decoded(layout2, tensors2, "s2")
    assert await core.push(_chunks(pusher_chunks)) == (layout2.num_buckets, layout2.total_bytes)
    await core.commit("s2", 2)
    assert engine.policy_version == 2 and _equal(engine, _state(2))
    assert core._spare is None or core._spare.data_ptr() != core._previous.staging.data_ptr()


async def test_gloo_refused_begin_does_not_wedge_the_group():
    """The trainer and one pod in one process (two threads join a 2-rank gloo group over a TCPStore)."""
    engine = FakeEngine(_state(0))
    core = WeightSyncCore(engine)
    pusher = WeightPusher(
        [LocalPodClient(core, "p")], tie_word_embeddings=True, transport="gloo", bucket_bytes=4096, timeout_s=60
    )
    try:
        await pusher.push_async(_state(1), version=1)
        assert engine.policy_version == 1 and _equal(engine, _state(1))
        assert core.status()["collective"] == "gloo rank 1/2"
        bad = _state(2)
        bad["model.norm.weight"] = torch.ones(31)
        with pytest.raises(WeightPushError, match="shape mismatch"):
            await pusher.push_async(bad, version=2)
        assert engine.policy_version == 1
        report = await pusher.push_async(_state(2), version=2)  # the group still moves in step
        assert report.pods["p"]["version"] == 2 and _equal(engine, _state(2))
    finally:
        await pusher._close_clients()
        core.close()


async def test_status_walks_receiving_staged_applying_idle():
    """Status's state, as docs/weightsync.md lists it, through one sync: the engine's load is held open to read
    "applying" while it runs."""
    loading, release = asyncio.Event(), asyncio.Event()

    class SlowEngine(FakeEngine):
        async def apply_weights(self, tensors, version, keep, replace=False):
            loading.set()
            await release.wait()
            return await super().apply_weights(tensors, version, keep, replace)

    core = WeightSyncCore(SlowEngine(_state(0)))
    layout, tensors = await _begin(core, _state(1), 1)
    assert core.status()["state"] == "receiving"
    await core.push(_chunks(_decoded(layout, tensors, "s1")))
    assert core.status()["state"] == "staged"
    commit = asyncio.ensure_future(core.commit("s1", 1))
    await loading.wait()
    assert core.status()["state"] == "applying"
    release.set()
    await commit
    assert core.status()["state"] == "idle" and core.status()["version"] == 1
    core.close()


async def test_abort_drops_the_pending_sync():
    engine = FakeEngine(_state(0))
    core = WeightSyncCore(engine)
    await _begin(core, _state(1), 1)
    assert core.status()["state"] == "receiving"
    assert await core.abort("s1", "trainer step failed") and not await core.abort("s1", "again")
    status = core.status()
    assert status["state"] == "idle" and "aborted by the trainer: trainer step failed" in status["last_error"]
    with pytest.raises(Exception, match="no pending sync"):
        await core.commit("s1", 1)
    assert engine.policy_version == 0 and engine.applied == 0


async def test_a_nan_in_the_probe_fails_the_check():
    """NaN compares below any threshold: a pod whose new weights give NaN logprobs (or a trainer sending NaN)
    must not be promoted."""
    engine = FakeEngine(_state(0))
    core = WeightSyncCore(engine)
    pusher = WeightPusher([LocalPodClient(core, "p")], tie_word_embeddings=True)
    v1 = _state(1)
    check = _check(v1)
    check.expected_logprobs[0] = float("nan")
    with pytest.raises(WeightPushError, match="weight check failed for version 1"):
        await pusher.push_async(v1, version=1, check=check)
