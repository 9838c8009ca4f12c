"""The fake backend: deterministic words, what the surfaces' tests run against (never offered by the CLI)."""
