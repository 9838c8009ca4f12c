"""The chat's screens: the chat itself, the plan view and the list of saved chats."""
