#!/usr/bin/env bash
# One prepared check for a lent GPU machine: the NCCL weight-sync path and the `vllm` GPU engine.
#
#   bash scripts/gpu_check.sh            # from the repo root; log -> $OUT/gpu_check.log (or /tmp)
#
# Needs a python with CUDA torch (+ vllm for steps 3-4; + transformers); nothing is downloaded.
# PYTHON=... picks the interpreter (default: .venv/bin/python if present, else python3). Each step
# prints PASS/FAIL/SKIP and the script goes on; the last lines summarise. About 4-8 minutes.
#   0. the install is requirements/gpu.lock: every pinned version installed, and vllm, torch,
#      nemo_automodel and quack (both its users) import together on CUDA
#   1. environment: GPUs, torch/CUDA/NCCL, vllm versions
#   2. NCCL group through molt.weightsync.collective (vLLM StatelessProcessGroup + PyNccl): world 1
#      on one GPU; world 2 (trainer GPU 0 -> pod GPU 1) when there are 2+ GPUs (NCCL refuses two
#      ranks on one GPU)
#   3. a real RolloutEngine on the GPU (vllm, tiny Qwen3, fp32) fed over gRPC by WeightPusher:
#      logprobs after the sync vs transformers, versions
#   4. with 2+ GPUs: the same sync with --transport nccl (pod on GPU 1, trainer on GPU 0)
#   5. SFT through NeMo AutoModel on one GPU, full, LoRA (NeMo's own adapters), Muon (FSDP2's DTensor
#      shards) and bf16 master weights: 2 steps each, the exports differ from the base (LoRA: only the
#      *_proj weights, the adapters folded in)
#   6. `molt up --recipe tiny` for 2 steps: each pod and the trainer pinned to their GPUs
set -u
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp}
LOG=$OUTDIR/gpu_check.log
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export OMP_NUM_THREADS=4 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
exec > >(tee "$LOG") 2>&1
RESULTS=()
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  if timeout "$limit" "$@"; then RESULTS+=("PASS $name"); else RESULTS+=("FAIL($?) $name"); fi
}

step "0 installed = requirements/gpu.lock" 300 "$PY" - <<'EOF'
import importlib, importlib.metadata as md, re
pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", open("requirements/gpu.lock").read(), re.M))
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(d.metadata["Name"]): d.version for d in md.distributions()}
off = {n: (v, have.get(norm(n))) for n, v in pins.items() if have.get(norm(n)) != v}
print(f"{len(pins) - len(off)}/{len(pins)} pins installed as locked; differing (locked, installed): {off}")
for m in ("torch", "vllm", "nemo_automodel", "quack", "transformers"):
    mod = importlib.import_module(m); print(m, getattr(mod, "__version__", ""), "ok")
import torch; assert torch.cuda.is_available(), "no CUDA"
assert not off, "the environment is not the locked combination"
EOF

step "1 environment" 120 "$PY" - <<'EOF'
import subprocess, torch
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
try:
    import vllm; print("vllm", vllm.__version__)
except Exception as exc:
    print("vllm not importable:", exc)
assert torch.cuda.is_available(), "no CUDA"
EOF
"$PY" -m molt.proto_build || RESULTS+=("FAIL proto_build (grpcio-tools missing?)")
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
mkdir -p /tmp/molt-gpu && "$PY" -m molt.models tiny --arch qwen3 --out /tmp/molt-gpu/a --seed 0 >/dev/null \
  && "$PY" -m molt.models tiny --arch qwen3 --out /tmp/molt-gpu/b --seed 1 >/dev/null || echo "tiny model build failed"

step "2 NCCL broadcast via molt.weightsync.collective (world $([ "$NGPU" -ge 2 ] && echo 2 || echo 1))" 180 "$PY" - "$NGPU" <<'EOF'
import sys, time, torch, multiprocessing as mp
from molt.weightsync import collective as coll

def member(rank, world, port, n, q):
    torch.cuda.set_device(rank)
    g = coll.join("nccl", "127.0.0.1", port, rank, world, "gpucheck", 120)
    buf = torch.full((n,), 7 if rank == 0 else 0, dtype=torch.uint8, device=g.device)
    g.broadcast(buf); t = time.perf_counter(); g.broadcast(buf); dt = time.perf_counter() - t
    q.put((rank, int(buf.min()), int(buf.max()), n / dt / 1e9))

world = 2 if int(sys.argv[1]) >= 2 else 1
port, n = coll.free_port(), 256 << 20
ctx = mp.get_context("spawn"); q = ctx.Queue()
procs = [ctx.Process(target=member, args=(r, world, port, n, q)) for r in range(world)]
[p.start() for p in procs]; out = [q.get(timeout=150) for _ in procs]; [p.join() for p in procs]
print(sorted(out))
assert all(lo == hi == 7 for _, lo, hi, _ in out), "broadcast content wrong"
EOF

cat > /tmp/molt-gpu/sync.py <<'EOF'
"""Real RolloutEngine on the GPU, fed by WeightPusher; argv: transport (grpc|nccl)."""
import asyncio, os, subprocess, sys, torch
from transformers import AutoModelForCausalLM
from services.rollout.config import RolloutSettings
from services.rollout.engine import RolloutEngine
from molt.weightsync.server import start_weightsync_server
from molt.weightsync.pusher import WeightPusher
from molt.weightsync.check import prompt_logprobs
PROMPT = [1, 45, 300, 12, 77, 501, 9, 2, 1, 33]

async def main(transport):
    s = RolloutSettings.model_validate({"model": {"path": "/tmp/molt-gpu/a"}, "vllm": {
        "dtype": "float32", "enforce_eager": True, "max_model_len": 256, "kv_cache_memory_bytes": 256 << 20}})
    engine = RolloutEngine(s); await engine.start()
    server, port = await start_weightsync_server(engine, "127.0.0.1", 0)
    b = AutoModelForCausalLM.from_pretrained("/tmp/molt-gpu/b", dtype=torch.float32).eval()
    want = prompt_logprobs(b, PROMPT)
    if transport == "grpc":
        pusher = WeightPusher([f"127.0.0.1:{port}"])
        r = await pusher.push_async(b.state_dict(), version=1)
    else:  # the trainer is another process on GPU 0 (this pod runs on GPU 1)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.trainer.push", "--model",
            "/tmp/molt-gpu/b", "--pods", f"127.0.0.1:{port}", "--transport", "nccl", "--version", "1", env=env)
        assert await asyncio.wait_for(proc.wait(), 300) == 0, "push --transport nccl failed"
        r = None
    got = await engine.prompt_logprobs(PROMPT)
    diff = max(abs(x - y) for x, y in zip(got, want))
    print(f"{transport}: version {engine.policy_version}, max |vllm - transformers| {diff:.2e}",
          f"transfer {r.transfer_s:.3f}s load {r.load_s:.3f}s" if r else "")
    await server.stop(0); await engine.close()
    assert engine.policy_version == 1 and diff < 1e-3, "GPU sync mismatch"

asyncio.run(main(sys.argv[1]))
EOF
step "3 vllm GPU RolloutEngine + gRPC sync" 300 "$PY" /tmp/molt-gpu/sync.py grpc
if [ "$NGPU" -ge 2 ]; then
  step "4 NCCL transport end to end (pod GPU 1, trainer GPU 0)" 300 env CUDA_VISIBLE_DEVICES=1 "$PY" /tmp/molt-gpu/sync.py nccl
else
  RESULTS+=("SKIP 4 NCCL transport end to end (needs 2 GPUs: NCCL refuses two ranks on one GPU)")
fi
cat > /tmp/molt-gpu/sft.py <<'EOF'
import json, subprocess, sys
from safetensors.torch import load_file
words = [["a", "b", "c"], ["d", "e"], ["f", "g", "h"], ["b", "a"]] * 4
rows = [{"prompt": "reverse: " + " ".join(w), "response": " ".join(reversed(w))} for w in words]
open("/tmp/molt-gpu/sft.jsonl", "w").write("".join(json.dumps(r) + "\n" for r in rows))
flags = ["--model.model_name_or_path", "/tmp/molt-gpu/a", "--data.dataset", "/tmp/molt-gpu/sft.jsonl",
         "--data.input_key", "prompt", "--data.output_key", "response", "--train.batch_size", "8",
         "--train.micro_batch_size", "4", "--train.num_steps", "2", "--adam.lr", "1e-3"]
base = load_file("/tmp/molt-gpu/a/model.safetensors")
variants = (("full", []), ("lora", ["--model.lora.rank", "4"]), ("muon", ["--optim", "muon"]),
            ("bf16-master", ["--fsdp.bf16_master_weights"]))
for tag, extra in variants:
    out = f"/tmp/molt-gpu/sft-{tag}"
    cmd = [sys.executable, "-m", "services.trainer.sft", *flags, "--ckpt.path", out + "/state",
           "--ckpt.output_dir", out + "/hf", *extra]
    subprocess.run(cmd, check=True)
    w = load_file(out + "/hf/model.safetensors")
    changed = sorted(n for n in w if not (w[n].float() == base[n].float()).all())
    print(tag, len(changed), "tensors changed, e.g.", changed[:3])
    assert changed and (tag == "full" or all(n.endswith("_proj.weight") for n in changed)), tag
EOF
step "5 SFT through NeMo AutoModel: full, LoRA, Muon, bf16 master weights" 600 "$PY" /tmp/molt-gpu/sft.py
# The local stack on the GPUs: pods first, the trainer on the rest (or sharing the one GPU), 2 steps.
step "6 molt up --recipe tiny on the GPUs (placement printed, 2 steps trained)" 480 bash -c '
  rm -rf /tmp/molt-gpu/up && "$0" -m molt.cli up --recipe tiny --steps 2 --no-progress --run-dir /tmp/molt-gpu/up \
    --set rollout vllm.enforce_eager=true | tee /tmp/molt-gpu/up.out
  grep "GPUs (CUDA_VISIBLE_DEVICES)" /tmp/molt-gpu/up.out && test -f /tmp/molt-gpu/up/summary.json' "$PY"
echo "=== summary"; printf '%s\n' "${RESULTS[@]}"
