"""The main screen: conversation, input, cache panel. Answers stream from a worker thread: its
tokens collect in a FrameBuffer that the screen draws in frames, as often as its FramePacer
allows (frames.py); other engine results (Loaded / Failed / Replanned) are posted back to this
screen as they come."""
from __future__ import annotations

from functools import partial
from typing import Awaitable, Callable

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header

from localctx.app.chat import slash
from localctx.app.chat.chat_engine import ChatEngine, Failed, Loaded, Notice, Replanned, Streamed
from localctx.app.chat.figures import CacheFigures, SessionFacts
from localctx.app.chat.frames import FrameBuffer, FramePacer, ui_has_own_core
from localctx.app.chat.screens.conversations import ConversationsScreen
from localctx.app.chat.screens.plan_screen import PlanScreen
from localctx.app.chat.setup import ChatSetup
from localctx.app.chat.widgets.cache_panel import CachePanel
from localctx.app.chat.widgets.conversation import Answer, ConversationView, UserMessage
from localctx.app.chat.widgets.prompt_input import PromptInput
from localctx.app.history import ChatMessage, Conversation, TurnStats
from localctx.backends.base import GenerationStats
from localctx.kvcache.errors import RuntimeFailure, UserError
from localctx.kvcache.policy import KVPolicy


class EngineResult(Message):
    def __init__(self, payload: object):
        super().__init__()
        self.payload = payload


class FrameReady(Message):
    """The worker added the first events of a frame (or the final one) to the screen's FrameBuffer."""


class ChatScreen(Screen):
    BINDINGS = [
        Binding("ctrl+c", "stop_or_copy", "Stop", show=False, priority=True),
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+o", "open_chats", "Chats"),
        Binding("f2", "show_plan", "Plan"),
        Binding("f1", "help", "Help"),
    ]

    busy = reactive(False, bindings=True)  # an answer or a re-plan is running (the footer follows it)

    def __init__(self, setup: ChatSetup, engine: ChatEngine):
        super().__init__()
        self.setup = setup
        self.engine = engine
        self.facts = SessionFacts.planned(setup.plan, setup.model, setup.hardware)
        self.conv = Conversation(system=setup.system)
        self.turn = 0
        self.answer: Answer | None = None
        self.question: ChatMessage | None = None
        self.last_stats: GenerationStats | None = None
        self.after_answer: Callable[[], Awaitable[None]] | None = None
        self.frames: FrameBuffer | None = None  # the streaming answer's events, not yet drawn
        self.frames_drawn = 0  # frames that changed the screen (tests compare it with the tokens streamed)
        self.pacer = FramePacer()
        self._frame_timer: Timer | None = None
        self._cursor_blink: bool | None = None  # the input's blink setting while an answer holds it still

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield ConversationView(id="conversation")
                yield PromptInput(id="prompt", placeholder="Ask anything · Enter sends · /help")
            yield CachePanel(CacheFigures(self.facts, state="starting"), id="panel")
        yield Footer()

    async def on_mount(self) -> None:
        # the model loads while the screen is up; a question sent meanwhile waits for it in the engine
        self.run_worker(partial(self.engine.load, self.setup.load, self.emit), thread=True, group="engine",
                        exit_on_error=False)
        self.sub_title = self.conv.title
        if self.setup.notice:
            await self.view.add_note(self.setup.notice, "error")
        if self.setup.resume:
            chats = self.setup.history.conversations()
            if chats:
                await self.load_conversation(chats[0].id)
        self.query_one(PromptInput).focus()

    @property
    def view(self) -> ConversationView:
        return self.query_one(ConversationView)

    @property
    def panel(self) -> CachePanel:
        return self.query_one(CachePanel)

    def set_state(self, state: str, stats: GenerationStats | None = None) -> None:
        self.panel.show(CacheFigures(self.facts, stats, state))

    # -- sending -------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def submitted(self, message: PromptInput.Submitted) -> None:
        prompt = self.query_one(PromptInput)
        try:
            command = slash.parse(message.text)
        except UserError as exc:
            await self.view.add_note(str(exc), "error")
            return
        if self.busy and (command is None or command.name not in ("help", "plan")):
            self.notify("An answer is in progress: Escape stops it.", severity="warning")
            return
        prompt.clear()
        if command is not None:
            await self.run_command(command)
        else:
            await self.send(slash.message_text(message.text))

    async def send(self, text: str) -> None:
        self.question = ChatMessage("user", text)
        self.conv.messages.append(self.question)
        self.save(self.question)
        self.sub_title = self.conv.title
        await self.view.add_user(text)
        self.answer = await self.view.start_answer()
        self.turn += 1
        self.frames = FrameBuffer(self.turn)
        self.pacer.reset()
        self.busy = True
        self.hold_cursor(True)
        self.last_stats = None
        self.set_state("prefilling")
        work = partial(self.engine.answer, self.turn, self.conv.prompt(), self.engine.new_cancel(), self.emit)
        self.run_worker(work, thread=True, group="engine", exit_on_error=False)

    def emit(self, payload: object) -> None:
        """Called from the worker thread; post_message is thread-safe. A streamed event goes to the
        frame buffer, and only the first one of a frame (or the last of the answer) wakes the screen."""
        if isinstance(payload, Streamed):  # per token: no Message unless the screen has to wake
            frames = self.frames
            if frames is None or frames.turn != payload.turn or not frames.add(payload.event):
                return
            message: Message = FrameReady()
        else:
            message = EngineResult(payload)
        try:
            self.post_message(message)
        except RuntimeError:
            pass  # the app has shut down (its event loop is closed): nobody is left to tell

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "stop":
            return True if self.busy and self.answer is not None else None  # None: shown greyed out
        return True

    @on(FrameReady)
    async def frame_ready(self, message: FrameReady) -> None:
        if self._frame_timer is None or (self.frames is not None and self.frames.finished):
            await self.frame_due()

    async def frame_due(self) -> None:
        """Draws now if a frame is due (or the answer ended), else looks again when the pacer says:
        by then the UI may have spent more time (the last frame's layout), which puts it off again."""
        if self._frame_timer is not None:
            self._frame_timer.stop()
            self._frame_timer = None
        frames = self.frames
        if frames is None or self.answer is None:  # no answer streams: a wake-up after its last frame
            return
        wait = self.pacer.wait()
        if wait <= 0 or frames.finished:
            await self.draw_frame()
        else:
            self._frame_timer = self.set_timer(wait, self.frame_due, name="answer frame")

    async def draw_frame(self) -> None:
        """One frame: the text streamed since the last one goes to the answer in one append, and the
        panel shows the latest figures; the final event finishes the answer."""
        if self._frame_timer is not None:
            self._frame_timer.stop()
            self._frame_timer = None
        if self.frames is None:
            return
        frame = self.frames.take()
        self.pacer.drawn()
        if frame.turn != self.turn or self.answer is None or frame.events == 0:
            return
        self.frames_drawn += 1
        self.last_stats = frame.stats
        if frame.done is not None:
            await self.answer.append(frame.text)
            await self.finish_answer(TurnStats.from_stats(frame.done.stats, frame.done.finish_reason or "stop"))
            return
        with self.app.batch_update():  # the answer and the panel change in one layout and one repaint
            self.set_state("streaming", frame.stats)
            await self.answer.append(frame.text)

    @on(EngineResult)
    async def engine_result(self, message: EngineResult) -> None:
        payload = message.payload
        if isinstance(payload, Failed) and payload.turn == self.turn:
            if payload.detail:
                self.log.error(payload.detail)
            await self.draw_frame()  # what streamed before the failure is kept
            await self.fail_answer(payload.message)
        elif isinstance(payload, Replanned):
            await self.replanned(payload)
        elif isinstance(payload, Loaded):
            self.loaded(payload)
        elif isinstance(payload, Notice):  # above the answer it came with, if one is streaming
            await self.view.add_note(payload.message, before=self.answer)

    def take_session(self, session) -> None:
        """A session was loaded or re-planned: the panel's facts, and whether frames take from its decoder."""
        self.facts = SessionFacts.of(session, self.setup.hardware)
        self.pacer.own_core = ui_has_own_core(session.decode_threads, self.engine.decodes_here)

    def loaded(self, result: Loaded) -> None:
        if result.session is None:
            self.app.load_error = result.error
            self.app.exit(return_code=1)
            return
        self.take_session(result.session)
        if self.busy:  # a question sent while the model loaded: its answer sets the panel's state
            self.panel.show(CacheFigures(self.facts, self.panel.figures.stats, self.panel.figures.state))
        else:
            self.set_state("idle")

    async def finish_answer(self, stats: TurnStats) -> None:
        answer, self.answer = self.answer, None
        if not answer.text and stats.finish_reason == "cancelled":
            await answer.remove()
            await self.take_back_question("Stopped before the first token; your message is back in the input.")
        else:
            reply = ChatMessage("assistant", answer.text, stats)
            self.conv.messages.append(reply)
            self.save(reply)
            await answer.finish(stats)
        self.set_state("stopped" if stats.finish_reason == "cancelled" else "done", self.last_stats)
        await self.answer_ended()

    async def fail_answer(self, text: str) -> None:
        answer, self.answer = self.answer, None
        if answer is not None and answer.text:
            reply = ChatMessage("assistant", answer.text)
            self.conv.messages.append(reply)
            self.save(reply)
            await answer.settle()
            await self.view.add_note(text, "error")
        else:
            if answer is not None:
                await answer.remove()
            await self.take_back_question(text)
        self.set_state("failed", self.last_stats)
        await self.answer_ended()

    async def take_back_question(self, why: str) -> None:
        question, self.question = self.question, None
        if question is not None:
            try:
                self.setup.history.remove_message(self.conv, question)
            except RuntimeFailure as exc:
                self.notify(str(exc), severity="error")
            shown = self.view.query(UserMessage)
            if shown:
                await shown.last().remove()
            prompt = self.query_one(PromptInput)
            if not prompt.text.strip():
                prompt.text = question.content
        await self.view.add_note(why, "error")

    def hold_cursor(self, streaming: bool) -> None:
        """While an answer streams, the input's cursor stops blinking: every blink is a repaint on the
        UI thread, and the UI thread's time is taken from the decoder's cores."""
        prompt = self.query_one(PromptInput)
        if streaming:
            self._cursor_blink, prompt.cursor_blink = prompt.cursor_blink, False
        elif self._cursor_blink is not None:
            prompt.cursor_blink, self._cursor_blink = self._cursor_blink, None

    async def answer_ended(self) -> None:
        self.busy = False
        self.hold_cursor(False)
        self.question = None
        if self.after_answer is not None:
            then, self.after_answer = self.after_answer, None
            await then()

    def save(self, message: ChatMessage) -> None:
        try:
            self.setup.history.add_message(self.conv, message)
        except RuntimeFailure as exc:
            self.notify(str(exc), severity="error")

    def save_partial(self) -> None:
        """On quit mid-answer: keep what was generated, as a stopped answer."""
        if not (self.busy and self.answer is not None):
            return
        text, stats = self.answer.text, self.last_stats
        if self.frames is not None and self.frames.turn == self.turn:
            frame = self.frames.take()  # streamed but not drawn yet
            text, stats = text + frame.text, frame.stats or stats
        if text:
            turn_stats = TurnStats.from_stats(stats, "cancelled") if stats else None
            self.save(ChatMessage("assistant", text, turn_stats))
            self.answer = None

    # -- commands ------------------------------------------------------------------
    async def run_command(self, command: slash.SlashCommand) -> None:
        name, arg = command.name, command.arg
        if name == "help":
            await self.view.add_note(slash.help_text())
        elif name == "plan":
            self.action_show_plan()
        elif name == "clear":
            self.setup.history.clear(self.conv)
            self.engine.reset()
            await self.view.show(self.conv)
            self.set_state("idle")
            await self.view.add_note("Cleared this chat and the cache.")
        elif name == "system":
            await self.set_system(arg)
        elif name == "kv":
            await self.replan(arg)

    async def set_system(self, arg: str) -> None:
        if not arg:
            shown = f"`{self.conv.system}`" if self.conv.system else "none"
            await self.view.add_note(f"System prompt: {shown}. Set it with /system TEXT, remove it with /system none.")
            return
        text = "" if arg.lower() == "none" else arg
        self.setup.history.set_system(self.conv, text)
        await self.view.add_note(f"System prompt {'set' if text else 'removed'}: the next answer prefills this "
                                 "chat again (the cached prefix changed).")

    async def replan(self, arg: str) -> None:
        plan = self.facts.plan
        if not arg:
            await self.view.add_note(f"KV policy: `{plan.policy}` ({plan.kv_layout}). Change it with /kv POLICY.")
            return
        kv = None if arg.lower() == "auto" else arg
        try:
            if kv is not None:
                KVPolicy.parse(kv)
        except UserError as exc:
            await self.view.add_note(str(exc), "error")
            return
        self.busy = True
        self.set_state("loading")
        self.run_worker(partial(self.engine.replan, kv, self.emit), thread=True, group="engine", exit_on_error=False)

    async def replanned(self, result: Replanned) -> None:
        self.busy = False
        if result.session is not None:
            self.take_session(result.session)
            self.set_state("idle")
            await self.view.add_note(result.message + ". The next answer prefills this chat into the new cache.")
        else:
            self.set_state("idle")
            await self.view.add_note(result.message, "error")

    # -- keys ----------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.busy and self.answer is not None:
            self.engine.stop()

    def action_stop_or_copy(self) -> None:
        prompt = self.query_one(PromptInput)
        if self.busy and self.answer is not None:
            self.engine.stop()
        elif self.focused is prompt and prompt.selected_text:
            prompt.action_copy()
        else:
            self.notify("Nothing to stop. Ctrl+Q quits.")

    async def action_new_chat(self) -> None:
        await self.when_idle(self.new_chat)

    async def new_chat(self) -> None:
        self.conv = Conversation(system=self.setup.system)
        await self.show_conversation()

    def action_open_chats(self) -> None:
        chats = self.setup.history.conversations()
        self.app.push_screen(ConversationsScreen(chats, self.conv.id, self.setup.history), self.chat_chosen)

    async def chat_chosen(self, conversation_id: int | None) -> None:
        if conversation_id is not None and conversation_id != self.conv.id:
            await self.when_idle(partial(self.load_conversation, conversation_id))

    async def load_conversation(self, conversation_id: int) -> None:
        try:
            self.conv = self.setup.history.load(conversation_id)
        except KeyError:
            self.notify("That chat was deleted.", severity="warning")
            return
        await self.show_conversation()

    async def show_conversation(self) -> None:
        self.engine.reset()
        self.sub_title = self.conv.title
        await self.view.show(self.conv)
        self.set_state("idle")
        self.query_one(PromptInput).focus()

    async def when_idle(self, then: Callable[[], Awaitable[None]]) -> None:
        """Runs ``then`` now, or stops the answer in progress and runs it once the answer is saved."""
        if not self.busy:
            await then()
        elif self.answer is not None:
            self.after_answer = then
            self.engine.stop()
        else:
            self.notify("Re-planning: wait a moment.", severity="warning")

    def action_show_plan(self) -> None:
        self.app.push_screen(PlanScreen(self.facts))

    async def action_help(self) -> None:
        await self.view.add_note(slash.help_text())
