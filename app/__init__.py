"""The surfaces: the CLI, the chat TUI, batch summarisation, chat history."""
