"""The prompt cache's notices in the chat: shown as a note in the conversation, above the answer
they came with, and never written to stderr (which would draw over the Textual screen)."""
from __future__ import annotations

import asyncio

from localctx.app.chat.widgets.conversation import Answer, Note
from localctx.kvcache import prompt_cache
from localctx.kvcache.prompt_cache import CHUNK, CacheScope, PromptCache

from chat_helpers import SIZE, RecordingSession, fake_session, make_app, send, wait_until

SCOPE = CacheScope(model_hash="0" * 64, backend="fake", policy="fp16", layout="test")


class PromptCacheSession(RecordingSession):
    """The fake session with a real prompt cache on disk that it consults before each answer, as the
    llama.cpp, torch and MLX sessions do."""

    def __init__(self):
        super().__init__(fake_session())
        self.prompt_cache = PromptCache(lambda: SCOPE)

    def generate(self, prompt, params=None, cancel=None):
        self.prompt_cache.lookup(list(range(CHUNK + 8)), CHUNK + 7)
        yield from super().generate(prompt, *(a for a in (params, cancel) if a is not None))


def test_a_prompt_cache_notice_shows_in_the_chat_not_on_stderr(history, capfd):
    folder = prompt_cache.root() / SCOPE.key()
    folder.mkdir(parents=True)
    (folder / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    session = PromptCacheSession()
    app = make_app(history, session)

    async def go():
        async with app.run_test(size=SIZE) as pilot:
            await send(pilot, "hello there")
            await wait_until(pilot, lambda: not app.chat.busy and len(app.query(Answer)) == 1)
            notes = [n for n in app.query(Note) if "prompt cache" in n.source]
            assert len(notes) == 1
            assert notes[0].source.startswith("prompt cache: ignoring broken.safetensors")
            children = list(app.chat.view.children)
            assert children.index(notes[0]) < children.index(app.query_one(Answer))

    asyncio.run(go())
    assert not (folder / "broken.safetensors").exists()  # refused and removed, as on the command line
    assert "prompt cache" not in capfd.readouterr().err
