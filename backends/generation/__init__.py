"""Generation helpers every backend shares: the decode loop, prompt-lookup speculation and its draft
policy, conversation slots, and the stream sources a server drives."""
