"""Offline batch summarisation (``localctx summarize``): inputs → structure-aware chunks →
map-reduce (or refine) over a batching session → one summary per input, resumable."""
