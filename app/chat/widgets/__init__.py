"""The chat's widgets: the conversation, the input and the cache panel."""
