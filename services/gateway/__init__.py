"""The gateway: OpenAI- and Anthropic-compatible front that captures token-exact sessions.

Layers, outside in: ``routes`` / ``wire_routes`` (thin HTTP handlers) -> ``openai_wire`` / ``anthropic_wire``
(decode a wire body into canonical chat messages, encode answers and SSE streams) -> ``core.Gateway`` (sessions,
capture, finishing) -> ``pods.PodPool`` (sticky least-loaded routing and failover over the rollout
pods' ``/v1/generate``). ``capture`` holds the token accumulation (TITO) and ``chat`` the template.
"""
