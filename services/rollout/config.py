"""Settings of a rollout pod: `python -m services.rollout --help` lists every flag.

Engine knobs keep Molt's `--vllm.*` names where Molt has the knob. `--model DIR` and `--port N` are
accepted as short forms of `--model.path` and `--server.port` (what people type most); every other
flag is dotted and unknown flags are errors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from molt.config import GuardedServerConfig, ModelConfig, Section, json_object, parse_settings, port_range
from molt.sampling import MAX_TOP_LOGPROBS


class VllmKnobs(Section):
    """Engine arguments passed through to vLLM (unset ones keep vLLM's default)."""

    dtype: str = "auto"
    """Weight/activation dtype (auto, float32, bfloat16, float16). Use float32 for logprob parity tests."""
    max_model_len: int | None = None
    """Context length (prompt + generated tokens). Unset: the model's own limit."""
    tensor_parallel_size: int = 1
    """Tensor-parallel degree of one pod."""
    enable_expert_parallel: bool = False
    """Shard MoE experts across the tensor-parallel ranks (expert parallelism)."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step (chunked prefill)."""
    max_num_seqs: int | None = None
    """Most requests the engine runs at once."""
    gpu_memory_utilization: float = 0.9
    """GPU memory fraction for weights + KV cache (on CPU: fraction of RAM; prefer kv_cache_memory_bytes)."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache size in bytes; when set it wins over VLLM_CPU_KVCACHE_SPACE (GiB). Unset on CPU: context x
    sequences x bytes per token, capped at a quarter of available RAM (services/rollout/kv_size.py)."""
    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs (fast start; tests use it)."""
    enable_prefix_caching: bool = False
    """Reuse KV of shared prompt prefixes (Molt's default is off). Reset on every weight update."""
    mtp_num_speculative_tokens: int = 0
    """MTP speculative tokens (0 = off); models with an MTP head only."""
    seed: int = 0
    """Engine seed (requests may pass their own seed)."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "processed_logprobs"
    """Which logprob of a sampled token is returned: processed = after temperature/top-k/top-p (the
    distribution actually sampled from, what importance sampling needs); raw = the model's log-softmax."""
    max_logprobs: int = Field(MAX_TOP_LOGPROBS, ge=0)
    """Most alternatives per token a request may ask for (vLLM's max_logprobs). The default is OpenAI's bound;
    a gateway recording a larger head (--rollout.top_logprobs K, for score centering) needs pods with K here."""
    enable_return_routed_experts: bool = False
    """Return per-token routed expert ids of MoE models (needs vLLM's model runner V2; not on CPU)."""
    multiprocessing: bool | None = None
    """Run the engine core in its own process (vLLM's default). Unset: in-process on CPU (3 s start,
    no IPC), multiprocess elsewhere."""
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None
    """vLLM executor backend. Unset: uni in-process, mp otherwise."""
    disable_custom_all_reduce: bool = False
    """Use NCCL's all-reduce instead of vLLM's custom kernel between tensor-parallel GPUs."""
    block_size: int | None = Field(None, gt=0)
    """KV-cache block size in tokens. Unset: vLLM's choice for the model and platform."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills across engine steps. Unset: vLLM's default."""
    async_scheduling: bool | None = None
    """Schedule the next engine step while the current one runs. Unset: vLLM's default."""
    decode_context_parallel_size: int = Field(1, gt=0)
    """Shard the KV cache of long contexts across this many of the pod's tensor-parallel GPUs (GPU only)."""
    attention_backend: str | None = None
    """vLLM attention backend (e.g. TRITON_ATTN, FLASH_ATTN, FLASHINFER). Unset: vLLM picks for the platform."""
    mm_encoder_attn_backend: str | None = None
    """Attention backend of a vision-language model's image encoder (e.g. TORCH_SDPA). Unset: vLLM picks."""
    gdn_prefill_backend: Literal["flashinfer", "triton"] | None = None
    """Prefill kernel of gated-delta-net (Qwen3-Next / Qwen3.5 linear attention) layers. Unset: vLLM picks."""
    mamba_ssm_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Dtype of recurrent (Mamba2 / GDN) state caches. float32 keeps a long rollout's log-probs close to the
    trainer's fp32 recompute; auto: the model's dtype."""
    compilation_config: dict[str, Any] | None = None
    """A JSON object passed to vLLM's CompilationConfig (e.g. '{"cudagraph_mode": "FULL_DECODE_ONLY"}'); its
    keys are checked by vLLM when the engine is built. Unset: vLLM's defaults."""

    @field_validator("compilation_config", mode="before")
    @classmethod
    def _json_object(cls, v: Any) -> Any:
        # From the command line or MOLT_VLLM__COMPILATION_CONFIG it is JSON text; from Helm values an object.
        return json_object(v, '{"cudagraph_mode": "NONE"}', "vLLM CompilationConfig fields")


class RolloutSettingsBlock(Section):
    inflight_on_update: Literal["finish", "abort"] = "finish"
    """What happens to requests in flight when weights arrive. finish: they complete on the old version and
    say so, and the update waits for them (Molt without --train.partial_rollout_enable: generation holds
    the lock the refit takes). abort: they stop at once and come back with finish_reason "abort" and
    their partial tokens, tagged with the old version (Molt's --train.partial_rollout_enable lets the refit
    interleave with generation; Molt then mixes weights inside a request, we never do)."""
    max_n: int = 64
    """Largest number of samples per request."""
    max_prompt_tokens: int | None = None
    """Largest prompt accepted (unset: the context length minus max_tokens is the only limit)."""
    idle_poll_ms: float = Field(5.0, ge=0)
    """When the engine runs out of requests, its thread polls for the next one this long (yielding the CPU
    to anything else runnable) before it sleeps. A request arriving within it starts without a thread
    wake-up on a core that went idle, which matters on VMs that halt idle cores at once
    (``haltpoll.guest_halt_poll_ns=0``). 0: sleep at once (many pods sharing few cores)."""
    max_images_per_prompt: int = Field(8, ge=1)
    """Most images in one request (vision-language models; vLLM's limit_mm_per_prompt). More: a 400."""
    max_image_bytes: int = Field(10 << 20, ge=1)
    """Largest encoded image file accepted, in bytes. Larger: a 400."""
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    """Largest image accepted, in pixels (width x height, checked before decoding). Larger: a 400."""


class GrpcConfig(Section):
    port: Annotated[int, port_range("off")] = 0
    """Port of the gRPC weight-sync receiver (molt.weightsync.server), 0..65535; 0 = off."""
    tls_cert: str | None = None
    """PEM certificate (chain) the weight-sync port serves TLS with (with --grpc.tls_key). Unset: plaintext."""
    tls_key: str | None = None
    """PEM private key of --grpc.tls_cert."""
    tls_client_ca: str | None = None
    """PEM CA that signs the trainer's client certificate: set, the port requires one (mutual TLS)."""


class WeightsConfig(Section):
    allow_unauthenticated: bool = False
    """Accept weight changes (gRPC weight sync, POST /v1/weights/reload) without a token while listening on a
    non-loopback address. Off: such a pod refuses to start unless MOLT_WEIGHTS_TOKEN is set (the token the
    trainer sends; env only, never a flag)."""
    await_push: bool = False
    """Report not ready (/readyz 503, so the gateway routes around the pod) until a trainer pushed weights: a pod
    that starts or restarts during a run joins the fleet at the trainer's version, never on its base weights
    (the trainer pushes to pods behind its version within seconds)."""


class RolloutSettings(Section):
    """A rollout pod: one vLLM engine behind token-in/token-out HTTP, with policy versions. Short forms:
    --model DIR = --model.path DIR, --port N = --server.port N, --host H = --server.host H."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    server: GuardedServerConfig = Field(default_factory=GuardedServerConfig)
    vllm: VllmKnobs = Field(default_factory=VllmKnobs)
    rollout: RolloutSettingsBlock = Field(default_factory=RolloutSettingsBlock)
    grpc: GrpcConfig = Field(default_factory=GrpcConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)


def validate_settings(settings: RolloutSettings) -> None:
    """The pod's cross-flag checks (``ValueError``), run by start-up and by --dry-run alike."""
    from molt.auth import check_internal_exposure, internal_token_from_env
    from molt.weightsync.auth import check_exposure, token_from_env

    if not settings.model.path:
        raise ValueError("--model.path (or --model) DIR is required")
    # No weight changes from anyone who reaches the pod: a token, loopback, or an explicit opt-out.
    check_exposure(token_from_env(), settings.server.host, settings.weights.allow_unauthenticated)
    # No generation for anyone who reaches the pod (its GPUs): the service token, loopback, or an opt-out.
    server = settings.server
    check_internal_exposure(
        internal_token_from_env(), server.host, server.allow_unauthenticated, "the pod would generate for"
    )
    g = settings.grpc
    if (g.tls_cert or g.tls_key or g.tls_client_ca) and not (g.tls_cert and g.tls_key):
        raise ValueError("gRPC TLS needs both --grpc.tls_cert and --grpc.tls_key (PEM files)")


def parse(argv: list[str] | None = None) -> RolloutSettings:
    import sys

    return parse_settings(
        RolloutSettings,
        sys.argv[1:] if argv is None else argv,
        prog="python -m services.rollout",
        validate=validate_settings,
    )
