"""HTTP routes of a rollout pod: thin adapters over RolloutEngine. Errors are mapped in app.py."""

from __future__ import annotations

import asyncio
import base64
import json

from fastapi import APIRouter, Request, Response

from molt.weightsync.auth import TOKEN_ENV, bearer_matches
from services.rollout.params import RolloutInputError

router = APIRouter()


def _json(payload: dict, status: int = 200) -> Response:
    return Response(json.dumps(payload, separators=(",", ":")), status_code=status, media_type="application/json")


async def _body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's stack
        raise RolloutInputError(
            f"request body is not valid JSON: {str(exc)[:200]}", param=None, code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise RolloutInputError("request body must be a JSON object", param=None, code="invalid_json")
    return body


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def generate(request: Request) -> Response:
    """POST /v1/generate: {"prompt_token_ids": [...], "sampling_params": {...}, "images": [...]?,
    "return_routed_experts": bool?} -> outputs with token ids, logprobs, finish reasons and policy versions
    (images: services/rollout/images.py; routed experts: services/rollout/routing.py).
    Mounted as a plain Starlette route (app.py): it is the hot path and needs none of FastAPI's machinery."""
    body = await _body(request)
    unknown = sorted(set(body) - {"prompt_token_ids", "sampling_params", "images", "return_routed_experts"})
    if unknown:
        raise RolloutInputError(
            f"unknown field(s) {ascii(unknown)[:200]}; expected prompt_token_ids, sampling_params, images, "
            "return_routed_experts",
            param=ascii(unknown[0])[1:-1][:80],
            code="unknown_parameter",
        )
    engine, metrics = request.app.state.engine, request.app.state.metrics
    extra = call_options(body)
    work = asyncio.ensure_future(engine.generate(body.get("prompt_token_ids"), body.get("sampling_params"), **extra))
    gone = asyncio.ensure_future(_until_disconnect(request))
    gone.add_done_callback(lambda _: work.cancel())  # client gone: cancelling aborts the engine requests
    try:
        result = await work  # raises RolloutInputError etc. -> handlers in app.py
    except asyncio.CancelledError:
        if not gone.done() or gone.cancelled():
            raise  # we are being cancelled (shutdown), not the client
        metrics.request_done("client_disconnect")
        return Response(status_code=499)
    finally:
        gone.cancel()
    generated = sum(len(s.token_ids) for s in result.samples)
    metrics.request_done("ok", result.prompt_token_count, generated)
    return _json(result_json(result))


def call_options(body: dict) -> dict:
    """The optional parts of a generate call as ``RolloutEngine.generate`` keywords: ``images`` (vision-language
    models, images.py) and ``return_routed_experts`` (MoE: each output carries its tokens' routed experts)."""
    out: dict = {}
    if "images" in body:
        out["images"] = body["images"]
    if "return_routed_experts" in body:
        if not isinstance(body["return_routed_experts"], bool):
            raise RolloutInputError("return_routed_experts must be true or false", param="return_routed_experts")
        out["routed_experts"] = body["return_routed_experts"]
    return out


def result_json(result) -> dict:
    """The answer to one generate call (a GenerateResult), as /v1/generate and each /v1/generate_batch line
    carry it."""
    return {
        "request_id": result.request_id,
        "policy_version": result.policy_version,
        "prompt_token_count": result.prompt_token_count,
        **({"prompt_token_ids": result.prompt_token_ids} if result.prompt_token_ids is not None else {}),
        "outputs": [
            {
                "index": i,
                "token_ids": s.token_ids,
                "logprobs": s.logprobs,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
                "policy_version": s.policy_version,
                **({"routed_experts": _array(s.routed_experts, "int16")} if s.routed_experts is not None else {}),
                **({"top_logprobs": s.top_logprobs} if s.top_logprobs is not None else {}),
            }
            for i, s in enumerate(result.samples)
        ],
    }


def _array(values, dtype: str) -> dict:
    """Big arrays travel as base64 bytes + dtype + shape, never as JSON lists (little-endian)."""
    import numpy as np

    arr = np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
    return {"dtype": dtype, "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode("ascii")}


@router.post("/v1/prompt_logprobs")
async def prompt_logprobs(request: Request) -> Response:
    """{"token_ids": [...], "return_routed_experts": bool?} -> {"logprobs": [log p(t_i | t_<i) for i >= 1],
    "policy_version", "routed_experts"?}: weight probes, and the gateway's --rollout.rescore_logprobs (the version is
    that of the weights that computed them; the routing, of every token, comes from the same pass)."""
    body = await _body(request)
    routed = call_options(body).get("routed_experts", False)
    lps, version, rows = await request.app.state.engine.versioned_prompt_logprobs(body.get("token_ids"), routed)
    experts = {} if rows is None else {"routed_experts": _array(rows, "int16")}
    return _json({"logprobs": lps, "policy_version": version, **experts})


@router.get("/v1/version")
async def version(request: Request) -> Response:
    engine = request.app.state.engine
    return _json({"policy_version": engine.policy_version, "model": str(request.app.state.settings.model.path)})


@router.get("/v1/stats")
async def stats(request: Request) -> Response:
    """The engine's own counters: steps, max running requests seen, idle and step seconds, tokens."""
    engine = request.app.state.engine
    return _json({**engine.stats.snapshot(), "policy_version": engine.policy_version})


@router.get("/v1/weights/expected")
async def expected(request: Request) -> Response:
    """HF tensor names the pod loads, with shape and dtype (what a weight sender must send)."""
    params = request.app.state.engine.expected_parameters()
    return _json({"parameters": {n: {"shape": list(s), "dtype": d} for n, (s, d) in params.items()}})


@router.post("/v1/weights/reload")
async def reload(request: Request) -> Response:
    """{"path": DIR, "version": N}: load a saved model dir through the atomic weight path.

    With a weight-sync token the request must carry ``Authorization: Bearer <token>`` (401 otherwise,
    before the body is read)."""
    token = request.app.state.weights_token
    if token is not None and not bearer_matches(request.headers.get("authorization"), token):
        body = {
            "error": {
                "message": f"missing or wrong weight-sync token ({TOKEN_ENV})",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_weights_token",
            }
        }
        return Response(
            json.dumps(body), status_code=401, media_type="application/json", headers={"WWW-Authenticate": "Bearer"}
        )
    body = await _body(request)
    path, new_version = body.get("path"), body.get("version")
    if not isinstance(path, str) or not isinstance(new_version, int) or isinstance(new_version, bool):
        raise RolloutInputError('expected {"path": "<model dir>", "version": <int>}', param="path")
    result = await request.app.state.engine.reload_from_path(path, new_version)
    return _json(result)


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    engine = request.app.state.engine
    if engine.dead is not None:
        return _json({"status": "engine_failed", "error": repr(engine.dead)}, 503)
    return _json({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    engine = request.app.state.engine
    body = {
        "ready": engine.ready,
        "policy_version": engine.policy_version,
        "grpc_port": request.app.state.grpc_port,
        "vocab": engine.vocab,
        "max_logprobs": request.app.state.settings.vllm.max_logprobs,
    }
    return _json(body, 200 if engine.ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    data, content_type = request.app.state.metrics.render(request.app.state.engine)
    return Response(data, media_type=content_type)
