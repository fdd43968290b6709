"""Safetensors header reading and the raw-bytes weight path (pure torch, no vLLM)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from services.rollout.checkpoint import expected_parameters, load_tensors
from services.rollout.worker_ext import DTYPES, tensors_from_bytes


def test_expected_parameters_reads_headers_only(tmp_path):
    save_file(
        {"a.weight": torch.zeros(3, 4), "b.bias": torch.zeros(5, dtype=torch.bfloat16)},
        str(tmp_path / "model.safetensors"),
    )
    assert expected_parameters(tmp_path) == {"a.weight": ((3, 4), "float32"), "b.bias": ((5,), "bfloat16")}
    assert set(load_tensors(tmp_path)) == {"a.weight", "b.bias"}
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        expected_parameters(tmp_path / "missing")


def test_bytes_round_trip_keeps_dtype_shape_and_values():
    names = {v: k for k, v in DTYPES.items()}
    originals = {"w": torch.randn(2, 3), "h": torch.randn(4).to(torch.bfloat16), "e": torch.empty(0, 2)}
    wire = [
        (n, names[t.dtype], tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for n, t in originals.items()
    ]
    back = dict(tensors_from_bytes(wire))
    for n, t in originals.items():
        assert back[n].dtype == t.dtype and back[n].shape == t.shape and torch.equal(back[n], t)


def test_routed_experts_travel_as_bytes_dtype_shape():
    import base64

    import numpy as np

    from services.rollout.routes import _array

    ids = np.arange(24).reshape(4, 3, 2)
    wire = _array(ids, "int16")
    assert wire["shape"] == [4, 3, 2] and wire["dtype"] == "int16"
    back = np.frombuffer(base64.b64decode(wire["data"]), dtype="<i2").reshape(wire["shape"])
    assert (back == ids).all()
