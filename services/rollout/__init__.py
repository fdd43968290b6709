"""Rollout pod: one real vLLM engine behind token-in/token-out HTTP, with policy versions."""
