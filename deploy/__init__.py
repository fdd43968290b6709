"""Deploy-time helpers shared by tests and tools: metric-reference checks (metric_refs) and offline tool
fetching (tools)."""
