"""Reward-env workers: stateless HTTP workers that run agent episodes (molt.agents) against the gateway."""
