"""Shared helpers of the rollout tests: engine settings for tiny models and the transformers reference."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import httpx
import torch

from services.rollout.config import RolloutSettings

PROMPT = [1, 45, 300, 12, 77, 501, 9, 2, 1, 33]


def tiny_settings(model: Path, **rollout) -> RolloutSettings:
    """fp32, eager, 64 MiB KV cache, short context: vLLM on CPU sized for tests."""
    return RolloutSettings.model_validate(
        {
            "model": {"path": str(model)},
            "vllm": {
                "dtype": "float32",
                "enforce_eager": True,
                "kv_cache_memory_bytes": 64 << 20,
                "max_model_len": 256,
            },
            "rollout": rollout,
        }
    )


@lru_cache(maxsize=8)
def _hf(model: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def hf_token_logprobs(model: Path, prompt: list[int], completion: list[int]) -> list[float]:
    """transformers' log_softmax of each completion token given everything before it (fp32)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = _hf(str(model))(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [lp[start + i, tok].item() for i, tok in enumerate(completion)]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


class ServerThread:
    """A real uvicorn server on a kernel-picked loopback port, in a thread of the test process."""

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        self.app = app
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
        )
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> str:
        import time

        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("rollout server did not start")
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def hf_routing(model: Path, token_ids: list[int]):
    """transformers' own top-k expert ids of every token in every MoE layer: int16 numpy [T, layers, top_k]."""
    import numpy as np

    from services.trainer.routing_replay import find_routers

    seen: dict[int, torch.Tensor] = {}
    hf = _hf(str(model))
    hooks = [
        m.register_forward_hook(lambda mod, args, out, layer=layer: seen.__setitem__(layer, out[2].clone()))
        for layer, _, m in find_routers(hf)
    ]
    try:
        with torch.no_grad():
            hf(torch.tensor([token_ids]))
    finally:
        for h in hooks:
            h.remove()
    return np.stack([seen[k].numpy() for k in sorted(seen)], axis=1).astype(np.int16)


def same_experts(a, b) -> float:
    """Share of (token, layer) rows of two [T, L, K] routings that pick the same set of experts."""
    import numpy as np

    assert a.shape == b.shape, (a.shape, b.shape)
    return float((np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1).mean())


def assert_serves(url: str) -> None:
    """Decode alone, then a prefill over several KV blocks: each gives its 8 tokens."""
    for prompt in ([1, 2, 3], list(range(1, 80))):
        out = httpx.post(
            f"{url}/v1/generate",
            json={"prompt_token_ids": prompt, "sampling_params": {"max_tokens": 8, "ignore_eos": True}},
            timeout=60,
        )
        assert out.status_code == 200, out.text
        assert len(out.json()["outputs"][0]["token_ids"]) == 8
