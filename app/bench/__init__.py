"""``localctx bench``: decode/prefill speed and KV memory against context length, for each backend and
KV policy, beside plain llama-cpp-python measured in the same run (interleaved), with plots.

Seams: ``settings`` (what to measure), ``prompt`` (prompts of N tokens), ``measure`` / ``baseline``
(one measurement each, run inside a ``worker`` subprocess), ``runner`` (the interleaved schedule),
``results`` (medians, ratios, goals), ``projection`` (planner or roofline), ``plots``, ``report``."""
