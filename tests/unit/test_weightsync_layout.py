"""Packing, manifest and wire codec of the weight sync (pure, no engine)."""

from __future__ import annotations

import platform

import pytest
import torch

from molt._proto import weightsync_pb2 as pb
from molt.weightsync.layout import (
    ALIGN,
    Hasher,
    checksum,
    iter_buckets,
    iter_chunks,
    plan_layout,
    validate_layout,
    view_tensors,
    wire_dtype,
)
from molt.weightsync.manifest import ManifestError, select_tensors, verify_manifest
from molt.weightsync.pusher import make_chunks
from molt.weightsync.wire import decode_chunk, encode_chunk, keep_malloc_hot, layout_from_begin, layout_to_begin


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(37, 16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.gate.weight": torch.randn(4, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).to(torch.float16),
        "lm_head.weight": torch.randn(37, 16, generator=g),
    }


def _stream(layout, tensors, chunk_bytes):
    staging = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    mv = memoryview(staging.numpy())
    pos = 0
    for bucket, offset, pieces, _ in iter_chunks(layout, tensors, chunk_bytes):
        assert bucket * layout.bucket_bytes + offset == pos
        for p in pieces:
            mv[pos : pos + len(p)] = p
            pos += len(p)
    return staging


@pytest.mark.parametrize("bucket_bytes,chunk_bytes", [(64, 64), (128, 100), (1 << 20, 1 << 10), (4096, 7)])
def test_roundtrip_through_buckets_and_chunks(bucket_bytes, chunk_bytes):
    state = _state()
    layout = plan_layout(state.items(), bucket_bytes)
    validate_layout(layout)
    assert all(e.start(bucket_bytes) % ALIGN == 0 for e in layout.entries)
    # each tensor's nbytes and the number of buckets follow from the layout
    assert layout.num_buckets == -(-layout.total_bytes // bucket_bytes)
    staging = _stream(layout, state, chunk_bytes)
    out = view_tensors(layout, staging)
    for name, t in state.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)
        assert out[name].data_ptr() >= staging.data_ptr()  # a view of the staging buffer, no copy
    # packing whole buckets gives the same bytes
    packed = torch.cat([b.clone() for _, b in iter_buckets(layout, state)])
    assert torch.equal(packed, staging)


def test_chunks_never_cross_buckets_and_mark_completion():
    state = _state()
    layout = plan_layout(state.items(), 256)
    done = []
    for bucket, offset, pieces, completes in iter_chunks(layout, state, 100):
        end = offset + sum(len(p) for p in pieces)
        assert end <= layout.bucket_size(bucket)
        assert completes == (end == layout.bucket_size(bucket))
        if completes:
            done.append(bucket)
    assert done == list(range(layout.num_buckets))


def test_checksum_is_incremental():
    data = bytes(range(256)) * 1000
    h = Hasher("xxh3_64")
    for i in range(0, len(data), 777):
        h.update(data[i : i + 777])
    assert h.digest() == checksum(data, "xxh3_64")
    h = Hasher("crc32")
    h.update(data[:5])
    h.update(data[5:])
    assert h.digest() == checksum(data, "crc32")
    with pytest.raises(ValueError, match="checksum"):
        Hasher("md4")


def test_chunk_codec_is_a_plain_protobuf_message():
    raw = encode_chunk("abc", 3, 128, 2**64 - 5, [b"hello ", memoryview(b"world")])
    msg = pb.Chunk.FromString(raw)
    assert (msg.sync_id, msg.bucket, msg.offset, msg.checksum, msg.data) == ("abc", 3, 128, 2**64 - 5, b"hello world")
    ser = pb.Chunk(sync_id="x", bucket=1, offset=0, checksum=0, data=b"\x00" * 300).SerializeToString()
    sync_id, bucket, offset, digest, data = decode_chunk(ser)
    assert (sync_id, bucket, offset, digest, bytes(data)) == ("x", 1, 0, 0, b"\x00" * 300)
    with pytest.raises(ValueError):
        decode_chunk(raw[:-3])


def test_make_chunks_checksums_match_buckets():
    state = _state()
    layout = plan_layout(state.items(), 512)
    buckets = [b.clone() for _, b in iter_buckets(layout, state)]
    sums = [msg.checksum for msg in map(pb.Chunk.FromString, make_chunks(layout, state, "s", 200)) if msg.checksum]
    assert sums == [checksum(memoryview(b.numpy())) for b in buckets]


def test_keep_malloc_hot_is_idempotent_and_applies_on_glibc():
    first = keep_malloc_hot()
    assert keep_malloc_hot() is first
    assert first == (platform.libc_ver()[0] == "glibc")


def test_begin_message_roundtrip():
    layout = plan_layout(_state().items(), 1024)
    req = layout_to_begin(layout, sync_id="s", version=3, keep=["a"])
    assert layout_from_begin(pb.BeginRequest.FromString(req.SerializeToString())) == layout


def test_validate_layout_rejects_overlap_and_overrun():
    layout = plan_layout(_state().items(), 1024)
    e = layout.entries
    bad = type(layout)(
        (e[0], e[1].__class__(e[1].name, e[1].dtype, e[1].shape, 0, 0, e[1].nbytes)), 1024, layout.total_bytes
    )
    with pytest.raises(ValueError, match="misplaced"):
        validate_layout(bad)
    with pytest.raises(ValueError, match="past total_bytes"):
        validate_layout(type(layout)(e, 1024, 100))


def test_select_tensors_tied_frozen_and_filters():
    state = dict(_state())
    state["_orig_mod.model.layers.0.mlp.up_proj.weight"] = torch.ones(2, 2)
    state["model.rotary.inv_freq_extra_state"] = torch.ones(1)
    state["model.step"] = torch.tensor(3)  # not floating: skipped
    state["mtp.lm_head.weight"] = torch.ones(2)
    send, keep = select_tensors(state.items(), tie_word_embeddings=True, frozen=["model.layers.0.mlp.gate.weight"])
    names = [n for n, _ in send]
    assert "lm_head.weight" not in names and "mtp.lm_head.weight" in names
    assert "model.layers.0.mlp.up_proj.weight" in names
    assert keep == ["model.layers.0.mlp.gate.weight"]
    assert "model.step" not in names and not any("extra_state" in n for n in names)
    send, _ = select_tensors(state.items(), tie_word_embeddings=False)
    assert "lm_head.weight" in [n for n, _ in send]


def _expected(state, drop=()):
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items() if n not in drop}


def test_verify_manifest_accepts_cast_and_keep():
    state = _state()
    expected = _expected(state)
    expected["model.norm.weight"] = ((16,), "float32")  # bf16 on the wire, fp32 in the engine: vLLM casts
    sent = {n: t for n, t in state.items() if n != "model.layers.0.mlp.gate.weight"}
    verify_manifest(plan_layout(sent.items()).entries, ["model.layers.0.mlp.gate.weight"], expected)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda s, e, k: s.pop("model.norm.weight"), "neither sent nor kept: model.norm.weight"),
        (lambda s, e, k: e.pop("lm_head.weight"), "does not load: lm_head.weight.*tied"),
        (lambda s, e, k: s.__setitem__("model.norm.weight", torch.ones(17)), r"shape mismatch for model.norm.weight"),
        (lambda s, e, k: e.__setitem__("model.norm.weight", ((16,), "int8")), "dtype mismatch"),
        (lambda s, e, k: k.append("nope"), "keep names the engine does not have: nope"),
        (lambda s, e, k: k.append("model.norm.weight"), "both sent and kept"),
    ],
)
def test_verify_manifest_rejects(mutate, match):
    state, keep = dict(_state()), []
    expected = _expected(state)
    mutate(state, expected, keep)
    with pytest.raises(ManifestError, match=match):
        verify_manifest(plan_layout(state.items()).entries, keep, expected)


def test_wire_dtype_narrows_floating_tensors_only():
    assert wire_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert wire_dtype(torch.float32, torch.float16) == torch.float16
    assert wire_dtype(torch.bfloat16, torch.float32) == torch.bfloat16  # never wider than held
    assert wire_dtype(torch.int64, torch.bfloat16) == torch.int64
    assert wire_dtype(torch.float32, None) == torch.float32
