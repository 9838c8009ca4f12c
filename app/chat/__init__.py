"""``localctx chat``: a Textual chat that shows what the KV cache is doing."""
