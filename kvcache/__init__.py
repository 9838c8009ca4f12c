"""KV-cache policies, the cost model, the planner and cache implementations.

Must not import a backend or the app (docs/architecture.md, "Layout")."""
