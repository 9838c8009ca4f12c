"""``localctx serve``: an OpenAI-compatible HTTP server with the planner behind it."""
