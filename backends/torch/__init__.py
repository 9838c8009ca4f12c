"""The torch backend: localctx's own Llama-family model over a paged KV cache (CUDA; CPU for tests)."""
