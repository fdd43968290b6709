"""Weight-sync throughput: gRPC Push vs a raw TCP copy of the same bytes, both on loopback, same run.

    OMP_NUM_THREADS=1 python -m bench.weightsync [--gib 1.0] [--reps 3] [--model .cache/models/smollm2]

Part 1 pushes a synthetic state dict (--gib GiB of fp32 tensors) to a pod process whose engine
only stages (a null engine: the bench measures the data path, not vLLM), and copies the same
bytes over a plain TCP socket into a preallocated buffer in another process: the limit of this
machine's loopback for one stream. It also prints the CPU seconds per GB each side spends (all
threads) and the page faults per MB: on a shared machine the rates follow the CPU that other jobs
leave over, while CPU per byte barely moves, so it shows where a change helps.

Part 2 (when --model exists; build it with ``python -m molt.models smollm2 --out
.cache/models/smollm2``) runs a real rollout pod (``python -m services.rollout``) and times
gather + transfer + load of the model's weights over gRPC and over the gloo collective. Prints one markdown table
per part.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import time

import torch

from molt.net import free_port


def synthetic_state(gib: float) -> dict[str, torch.Tensor]:
    per = 32 << 20  # 32 MiB tensors, like the big matrices of a ~1B model
    n = max(1, int(gib * (1 << 30)) // per)
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.mlp.weight": torch.rand(4096, 2048, generator=g) for i in range(n)}


# ---- the pod side processes


class NullEngine:
    def __init__(self, spec: dict) -> None:
        self.spec = {n: (tuple(s), d) for n, (s, d) in spec.items()}
        self.serving_dtype = ""  # the bench sends the bytes it measures as they are
        self.policy_version = 0

    def expected_parameters(self):
        return dict(self.spec)

    async def apply_weights(self, tensors, version, keep, replace=False):
        self.policy_version = version
        return {"untouched": []}

    async def prompt_logprobs(self, token_ids):
        return [0.0] * (len(token_ids) - 1)


async def _null_pod(spec_path: str) -> None:
    from molt.weightsync.server import start_weightsync_server

    engine = NullEngine(json.loads(Path(spec_path).read_text()))
    server, port = await start_weightsync_server(engine, "127.0.0.1", 0, keep_rollback_copy=False)
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop(0)


def _raw_sink() -> None:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    print(ls.getsockname()[1], flush=True)
    buf = torch.empty(0, dtype=torch.uint8)
    while True:
        conn, _ = ls.accept()
        head = conn.recv(9, socket.MSG_WAITALL)
        total, fresh = int.from_bytes(head[:8], "little"), head[8]
        if total == 0:
            return
        if fresh or buf.numel() != total:  # fresh: page faults included, like a first sync's staging buffer
            buf = torch.empty(total, dtype=torch.uint8)
        view, pos = memoryview(buf.numpy()), 0
        while pos < total:
            pos += conn.recv_into(view[pos:], min(total - pos, 4 << 20))
        conn.sendall(b"k")
        conn.close()


def _spawn(*args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    return proc, int(proc.stdout.readline())


# ---- part 1


def _cpu_s(pid: int | None = None) -> tuple[float, int]:
    """(user + system CPU seconds, minor page faults) of this process (all threads) or of child ``pid``."""
    fields = Path(f"/proc/{pid or 'self'}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def _timed(fn, peer: int, total: int, cpu: dict, key: str):
    """Run fn(), adding (sender, receiver) CPU seconds per GB and page faults per MB to cpu[key]."""
    c0, p0 = _cpu_s(), _cpu_s(peer)
    out = fn()
    c1, p1 = _cpu_s(), _cpu_s(peer)
    cpu.setdefault(key, []).append(
        (
            (c1[0] - c0[0]) / total * 1e9,
            (p1[0] - p0[0]) / total * 1e9,
            (c1[1] - c0[1]) / total * 2**20,
            (p1[1] - p0[1]) / total * 2**20,
        )
    )
    return out


def raw_copy(port: int, state: dict[str, torch.Tensor], fresh: bool = False) -> float:
    from molt.weightsync.layout import tensor_bytes

    total = sum(t.numel() * t.element_size() for t in state.values())
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(total.to_bytes(8, "little") + bytes([fresh]))
        for t in state.values():
            s.sendall(tensor_bytes(t))
        assert s.recv(1) == b"k"
    return total / (time.perf_counter() - t0) / 1e9


def part1(gib: float, reps: int, chunk_bytes: int, bucket_bytes: int) -> list[str]:
    from molt.weightsync.pusher import WeightPusher

    state = synthetic_state(gib)
    spec = {n: (list(t.shape), "float32") for n, t in state.items()}
    spec_path = Path(f"/tmp/molt-bench-weightsync-{os.getpid()}.json")
    spec_path.write_text(json.dumps(spec))
    pod, pod_port = _spawn("_null_pod", str(spec_path))
    sink, sink_port = _spawn("_raw_sink")
    pusher = WeightPusher([f"127.0.0.1:{pod_port}"], bucket_bytes=bucket_bytes, chunk_bytes=chunk_bytes)
    total = sum(t.numel() * t.element_size() for t in state.values())
    grpc_rates, raw_rates, fresh_rates, e2e, cpu = [], [], [], [], {}
    try:
        raw_copy(sink_port, state)  # warm both paths (buffers allocated and touched once)
        pusher.push(state, version=1)
        for i in range(reps):  # interleaved so both see the same machine load
            raw_rates.append(_timed(lambda: raw_copy(sink_port, state), sink.pid, total, cpu, "raw"))
            fresh_rates.append(raw_copy(sink_port, state, fresh=True))
            r = _timed(lambda i=i: pusher.push(state, version=i + 2), pod.pid, total, cpu, "grpc")
            grpc_rates.append(r.bytes / r.transfer_s / 1e9)
            e2e.append(r.total_s)
    finally:
        pusher.close()
        with socket.create_connection(("127.0.0.1", sink_port)) as s:
            s.sendall(bytes(9))
        pod.stdin.close()
        pod.wait(30)
        sink.wait(30)
        spec_path.unlink(missing_ok=True)
    g, raw, fresh = (statistics.median(x) for x in (grpc_rates, raw_rates, fresh_rates))
    return [
        f"Part 1: {total / (1 << 30):.2f} GiB ({len(state)} fp32 tensors), bucket {bucket_bytes >> 20} MiB, "
        f"chunk {chunk_bytes >> 20} MiB, median of {reps}",
        "",
        "| path | GB/s | vs raw TCP |",
        "| --- | --- | --- |",
        f"| raw TCP socket copy, sendall -> recv_into a reused (already touched) buffer: the limit | {raw:.2f} "
        "| 100% |",
        f"| raw TCP socket copy into a fresh buffer (page faults included) | {fresh:.2f} | {100 * fresh / raw:.0f}% |",
        f"| gRPC Push (Begin -> all chunks staged + checksummed on the pod, staging reused) | {g:.2f} | "
        f"{100 * g / raw:.0f}% |",
        "",
        f"all reps (GB/s): raw {[round(x, 2) for x in raw_rates]}, raw fresh {[round(x, 2) for x in fresh_rates]}, "
        f"gRPC {[round(x, 2) for x in grpc_rates]} (gRPC / the same rep's raw: "
        f"{[round(a / b, 2) for a, b in zip(grpc_rates, raw_rates)]}); "
        f"gRPC sync end to end (gather + transfer + commit on a null engine): "
        f"{statistics.median(e2e):.2f} s",
        "CPU s/GB and page faults/MB (sender, receiver; all threads, medians; gRPC: the whole sync): "
        + "; ".join(
            f"{k} {statistics.median(x[0] for x in v):.2f}, {statistics.median(x[1] for x in v):.2f} s/GB, "
            f"{statistics.median(x[2] for x in v):.0f}, {statistics.median(x[3] for x in v):.0f} faults/MB"
            for k, v in cpu.items()
        ),
    ]


# ---- part 2


def part2(model_dir: Path, reps: int, pod_dtype: str = "float32") -> list[str]:
    import httpx
    from transformers import AutoModelForCausalLM

    from molt.weightsync.check import probe_check
    from molt.weightsync.pusher import WeightPusher

    http_port, grpc_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "services.rollout",
        "--model",
        str(model_dir),
        "--server.port",
        str(http_port),
        "--grpc.port",
        str(grpc_port),
        "--vllm.dtype",
        pod_dtype,
        "--vllm.enforce_eager",
        "--vllm.kv_cache_memory_bytes",
        str(256 << 20),
        "--vllm.max_model_len",
        "512",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    log = open(f"/tmp/molt-bench-weightsync-pod-{os.getpid()}.log", "w")
    pod = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if pod.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rollout pod did not start; see {log.name}")
            time.sleep(1)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        # bf16 serving is a different policy than the fp32 model at any tight bound: no probe check there.
        check = probe_check(model, max_abs_diff=1e-3) if pod_dtype == "float32" else None
        version = 1
        for transport in ("grpc", "gloo"):
            pusher = WeightPusher([f"127.0.0.1:{grpc_port}"], transport=transport)
            try:
                for _ in range(reps):
                    r = pusher.push(model.state_dict(), version=version, check=check)
                    version += 1
                    pod_r = next(iter(r.pods.values()))
                    diff = f"{pod_r['check_max_abs_diff']:.1e}" if check else "-"
                    rows.append(
                        f"| {transport} | {r.bytes / 1e6:.0f} | {r.gather_s:.2f} | {r.transfer_s:.2f} | "
                        f"{r.load_s:.2f} ({pod_r['load_seconds']:.2f} apply) | {r.total_s:.2f} | {diff} |"
                    )
            finally:
                pusher.close()
    finally:
        pod.terminate()
        pod.wait(60)
        log.close()
    Path(log.name).unlink()  # kept only when the pod failed
    return [
        f"Part 2: {model_dir.name} (fp32) into a real rollout pod (vLLM CPU, {pod_dtype}), every fp32 rep with the "
        "probe check",
        "",
        "| transport | MB | gather s | transfer s | load s (commit; of which apply_weights) | total s | "
        "probe max abs diff |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_null_pod":
        asyncio.run(_null_pod(sys.argv[2]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_raw_sink":
        _raw_sink()
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk-mib", type=int, default=2)
    p.add_argument("--bucket-mib", type=int, default=256)
    p.add_argument("--model", default=str(ROOT / ".cache" / "models" / "smollm2"))
    p.add_argument("--skip-model", action="store_true")
    p.add_argument(
        "--pod-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the pod's --vllm.dtype; bfloat16: the fp32 trainer sends bf16 (the pod's serving dtype)",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    print("\n".join(part1(a.gib, a.reps, a.chunk_mib << 20, a.bucket_mib << 20)), flush=True)
    model = Path(a.model)
    if a.skip_model:
        return
    if not (model / "config.json").exists():
        print(f"\nPart 2 skipped: {model} missing (python -m molt.models smollm2 --out {model})")
        return
    print()
    print("\n".join(part2(model, a.reps, a.pod_dtype)))


if __name__ == "__main__":
    main()
