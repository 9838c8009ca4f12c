"""Hardware detection, model loading, tokenizers, model graphs and generation loops, one module per backend.

Knows nothing of the TUI or the CLI."""
