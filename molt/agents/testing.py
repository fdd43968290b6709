"""An in-memory fake of the gateway's session API, for testing agents without a model.

``FakeGateway().app`` serves the session routes of docs/contracts.md with a scripted
policy instead of a model: tokens are UTF-8 bytes (token id = byte value), a message list renders as
``<|role|>content\\n`` lines plus ``<|assistant|>`` (after a ``<|tool|>name\\n`` line per tool), and each
turn's answer is ``policy(prompt_text, turn)`` cut to the turn's max_tokens and the session's remaining budget.
Sessions keep the same token / span bookkeeping as the real gateway, so tests can check what would have been
trained on. Reach it with ``httpx.ASGITransport(app=fake.app)`` (see ``GatewayClient(transport=...)``): no
sockets.

    fake = FakeGateway(policy=lambda prompt, turn: "42")
    gateway = GatewayClient("http://fake", transport=httpx.ASGITransport(app=fake.app))
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

Policy = Callable[[str, int], str]
FAKE_LOGPROB = -0.5


@dataclass
class FakeSession:
    id: str
    fields: dict[str, Any]
    max_length: int
    token_ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    status: str = "open"
    """open, finished or aborted."""
    finish: dict[str, Any] | None = None
    turns: int = 0

    def text(self, start: int = 0, end: int | None = None) -> str:
        return bytes(self.token_ids[start:end]).decode("utf-8", errors="replace")

    def action_texts(self) -> list[str]:
        return [self.text(a, b) for a, b in self.spans]

    def masked_texts(self) -> list[str]:
        """Texts of the non-action stretches (prompt, feedback), in order."""
        out, pos = [], 0
        for a, b in self.spans + [(len(self.token_ids), len(self.token_ids))]:
            if a > pos:
                out.append(self.text(pos, a))
            pos = b
        return out


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    head = "".join(f"<|tool|>{t['function']['name']}\n" for t in tools or ())
    return head + "".join(f"<|{m.get('role')}|>{m.get('content')}\n" for m in messages) + "<|assistant|>"


class FakeGateway:
    def __init__(
        self,
        policy: Policy | None = None,
        default_max_length: int = 4096,
        default_max_tokens: int = 64,
        zero_max_tokens_appends: bool = True,
    ) -> None:
        self.policy: Policy = policy or (lambda prompt, turn: f"answer {turn}")
        self.default_max_length = default_max_length
        self.default_max_tokens = default_max_tokens
        self.zero_max_tokens_appends = zero_max_tokens_appends
        """False mimics a gateway that clamps max_tokens 0 up to 1 (no append-only turn)."""
        self.sessions: dict[str, FakeSession] = {}
        self.app = self._build()

    def _generate(self, s: FakeSession, prompt_ids: list[int], sp: dict[str, Any]) -> dict[str, Any]:
        s.token_ids = prompt_ids
        remaining = s.max_length - len(s.token_ids)
        max_tokens = sp.get("max_tokens")
        max_tokens = self.default_max_tokens if max_tokens is None else int(max_tokens)
        if not self.zero_max_tokens_appends:
            max_tokens = max(max_tokens, 1)
        budget = max(0, min(max_tokens, remaining))
        ids: list[int] = []
        if budget > 0:
            s.turns += 1
            full = list(self.policy(s.text(), s.turns).encode("utf-8"))
            ids = full[:budget]
            finish = "length" if len(full) > budget else "stop"
            s.spans.append((len(s.token_ids), len(s.token_ids) + len(ids)))
            s.token_ids = s.token_ids + ids
        else:
            finish = "length"
        return {
            "token_ids": ids,
            "logprobs": [FAKE_LOGPROB] * len(ids),
            "text": bytes(ids).decode("utf-8", errors="replace"),
            "finish_reason": finish,
            "policy_version": 0,
            "num_tokens": len(s.token_ids),
            "remaining_tokens": s.max_length - len(s.token_ids),
        }

    def _build(self) -> FastAPI:
        app = FastAPI()

        def missing(sid: str) -> JSONResponse:
            return JSONResponse({"error": {"message": f"unknown session {sid}", "code": 404}}, 404)

        @app.get("/healthz")
        @app.get("/readyz")
        async def healthz():
            return {"status": "ok"}

        @app.post("/v1/sessions")
        async def open_session(request: Request):
            body = await request.json()
            sid = uuid.uuid4().hex
            self.sessions[sid] = FakeSession(sid, body, int(body.get("max_length") or self.default_max_length))
            base = str(request.base_url).rstrip("/")
            return {
                "session_id": sid,
                "openai_base_url": f"{base}/s/{sid}/v1",
                "anthropic_base_url": f"{base}/s/{sid}",
            }

        @app.post("/v1/sessions/{sid}/generate")
        async def generate(sid: str, request: Request):
            s = self.sessions.get(sid)
            if s is None or s.status != "open":
                return missing(sid)
            body = await request.json()
            s.requests.append(body)
            prompt = list(s.token_ids)
            if body.get("messages") is not None:
                if prompt:
                    return JSONResponse({"error": {"message": "'messages' is for the first turn only"}}, 400)
                prompt = list(render(body["messages"]).encode("utf-8"))
            prompt += list((body.get("append_text") or "").encode("utf-8")) + list(body.get("append_token_ids") or [])
            sp = dict(s.fields.get("sampling_params") or {}, **(body.get("sampling_params") or {}))
            # The gateway's truncate_prompt rule: reserve the request's own max_tokens, else 32.
            keep = max(1, s.max_length - ((body.get("sampling_params") or {}).get("max_tokens") or 32))
            if body.get("truncate_prompt") == "left" and not s.token_ids and len(prompt) > keep:
                prompt = prompt[-keep:]
                return {**self._generate(s, prompt, sp), "prompt_text": bytes(prompt).decode("utf-8", "replace")}
            return self._generate(s, prompt, sp)

        @app.post("/v1/sessions/{sid}/render")
        async def render_prompt(sid: str, request: Request):
            s = self.sessions.get(sid)
            if s is None or s.status != "open":
                return missing(sid)
            body = await request.json()
            s.requests.append({"render": body})
            text = render(body["messages"], body.get("tools"))
            return {"text": text, "num_tokens": len(text.encode("utf-8"))}

        @app.post("/s/{sid}/v1/chat/completions")
        async def chat(sid: str, request: Request):
            s = self.sessions.get(sid)
            if s is None or s.status != "open":
                return missing(sid)
            body = await request.json()
            s.requests.append(body)
            sp = dict(s.fields.get("sampling_params") or {})
            if body.get("max_tokens") is not None:
                sp["max_tokens"] = body["max_tokens"]
            out = self._generate(s, list(render(body["messages"]).encode("utf-8")), sp)
            return {
                "id": f"chatcmpl-{sid}",
                "object": "chat.completion",
                "created": 0,
                "model": "policy",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": out["text"]},
                        "finish_reason": out["finish_reason"],
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": len(out["token_ids"]), "total_tokens": 0},
            }

        @app.get("/v1/sessions/{sid}")
        async def summary(sid: str):
            s = self.sessions.get(sid)
            if s is None:
                return missing(sid)
            return {"session_id": sid, "status": s.status, "turns": s.turns, "num_tokens": len(s.token_ids)}

        @app.post("/v1/sessions/{sid}/renew")
        async def renew(sid: str):
            s = self.sessions.get(sid)
            if s is None or s.status != "open":
                return missing(sid)
            return {"session_id": sid, "lease_s": s.fields.get("lease_s")}

        @app.post("/v1/sessions/{sid}/finish")
        async def finish(sid: str, request: Request):
            s = self.sessions.get(sid)
            if s is None or s.status == "aborted":
                return missing(sid)
            if s.status == "open":
                s.finish = await request.json()
                s.status = "finished"
            return {"trajectory_id": sid, "written": bool(s.spans)}

        @app.delete("/v1/sessions/{sid}")
        async def abort(sid: str):
            s = self.sessions.get(sid)
            if s is None:
                return missing(sid)
            s.status = "aborted"
            return {"session_id": sid, "aborted": True}

        return app
