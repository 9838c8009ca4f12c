"""The ``openai`` backend: run, chat and summarize against OpenAI-compatible servers."""
