"""``astrai-fabric chat SRC``: a conversation with a model, each reply streamed as it is sampled.

The conversation is rendered with the tokenizer's chat template (an optional system message, then user and
assistant turns), or, for a tokenizer without one (or ``--template false``), kept as running text: each input on a
new line after what came before, continued by the model. A reply ends at a stop token (the template's,
``Tokenizer.stop_ids``; EOS for running text) or after ``max_new_tokens``, and prints as whole UTF-8 characters (a
byte-level token can end inside one: its bytes wait for the rest).

Replies come from the generation engine (``inference.Engine``), which keeps the KV cache's blocks across turns. Each
turn renders the whole conversation again and is one request; the engine's prefix reuse finds the full blocks of
what it computed before, as long as the ids are the same (a template that rewrites earlier turns, dropping past
reasoning, say, or a reply whose text encodes to other ids than those sampled, match up to where they differ), and
computes the rest. The test is on ids, not text. A conversation that no longer fits ``max_position_embeddings`` is
said in one line; ``/reset`` starts a new one.

``/reset`` clears the conversation (the system message stays) and the cache; ``/exit`` or the end of input leaves
(exit 0). Ctrl-C during a reply stops it (what was printed stays in the conversation) and returns to the prompt; at
the prompt it leaves with exit 130. Turn t samples with the seed ``--seed + t``.

Each line of stdin is one message of at most ``--max_input_bytes`` bytes: a longer one is refused in one line and
the chat goes on (a pipe is read in pieces of that size, so no line is held whole). Bytes that are not text in
stdin's encoding are read as U+FFFD, said once: refusing them would end an interactive session.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import BinaryIO

from torch import nn

from astrai_fabric.config.generate import ChatArgs
from astrai_fabric.errors import UserError
from astrai_fabric.generate import load_sampler
from astrai_fabric.inference import Engine, SamplingParams
from astrai_fabric.tokenizer import Message, Tokenizer

PROMPT = ">>> "
RESET, EXIT = "/reset", "/exit"


class Conversation:
    """What was said, rendered to token ids for the next reply: with the chat template, or as running text."""

    def __init__(self, tokenizer: Tokenizer, system: str | None, template: bool) -> None:
        self.tokenizer = tokenizer
        self.system = system
        self.templated = template and bool(tokenizer.chat_template)
        self.messages: list[Message] = []
        self.text = ""
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system and self.templated else []
        self.text = "" if self.templated else self.system or ""

    @property
    def stop_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.stop_ids if self.templated else [eos] if eos is not None else []

    def ids_with(self, user: str) -> list[int]:
        """The conversation with ``user`` said next, as ids the reply continues."""
        if self.templated:
            return self.tokenizer.apply_chat_template([*self.messages, {"role": "user", "content": user}])
        return self.tokenizer.encode(self._text_with(user))

    def add(self, user: str, reply: str) -> None:
        if self.templated:
            self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        else:
            self.text = self._text_with(user) + reply

    def _text_with(self, user: str) -> str:
        return f"{self.text}\n{user}" if self.text else user


class ChatSession:
    """The model behind the generation engine, which keeps the conversation's blocks across turns."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, args: ChatArgs) -> None:
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.conversation = Conversation(tokenizer, args.system, args.template)
        # One conversation at a time: the pool holds the model's whole window once, and what it held of the
        # earlier turns stays there (prefix reuse) until a longer conversation needs the room.
        self.engine = Engine(model, max_num_seqs=1, seed=args.seed, kv_cache_memory=args.kv_cache_bytes())
        self.max_positions = self.engine.max_model_len
        self.turns = 0
        self.cached_prompt_tokens = 0
        """The last turn's prompt positions found in the KV cache, not computed again: for tests."""
        self.last_ids: list[int] = []
        """The last turn's prompt and reply ids as sampled."""
        self.cut_at_max_new_tokens = False
        """The last reply ended at ``--max_new_tokens``, not at a stop token: it may be unfinished."""

    def reset(self) -> None:
        self.conversation.reset()

    def ids_with(self, user: str) -> list[int]:
        """The conversation's ids with ``user`` said next; a template that refuses it, or renders no token, is the
        user's error."""
        ids = self.conversation.ids_with(user)
        if not ids:
            raise UserError(
                f"with the tokenizer in {self.tokenizer.directory}, the conversation renders as no token (and no "
                "bos_token is added): there is nothing to continue"
            )
        return ids

    def reply(self, user: str, write: Callable[[str], None]) -> str | None:
        """Answer ``user``, each piece of text ``write``-n as it is sampled; the reply, or None when the conversation
        does not fit the model (said in one line). Ctrl-C stops the reply where it is: what was written is kept.

        Each turn is one request of the whole conversation: the engine finds the blocks of what it held before
        (the earlier turns, as their ids were; a template that rewrites them, or a reply whose text encodes to
        other ids, matches up to where the ids differ) and computes the rest. Turn t is seeded ``seed + t``."""
        ids = self.ids_with(user)
        room = self.max_positions - len(ids)
        if room < 1:
            say(
                f"the conversation ({len(ids)} tokens with this message) no longer fits the model's "
                f"{self.max_positions} positions (max_position_embeddings): type {RESET} to start a new one"
            )
            return None
        budget = min(self.args.max_new_tokens, room)
        stop_ids = self.conversation.stop_ids
        params = SamplingParams(
            max_tokens=budget,
            temperature=self.args.temperature,
            top_k=self.args.top_k,
            top_p=self.args.top_p,
            seed=self.args.seed + self.turns,
            stop_token_ids=stop_ids,
        )
        self.turns += 1
        text_of, pieces, interrupted = self.tokenizer.decode_stream(), [], False
        request = self.engine.add_request(ids, params)
        try:
            while self.engine.has_work():
                for _, token in self.engine.step():
                    if piece := text_of(token):
                        write(piece)
                        pieces.append(piece)  # once shown
        except KeyboardInterrupt:  # Ctrl-C: this reply ends here, its blocks back to the pool
            interrupted = True
            self.engine.cancel(request)
        [completion] = self.engine.completions.pop(request)
        self.cached_prompt_tokens = completion.num_cached_prompt_tokens
        self.last_ids = ids + completion.tokens
        write("\n")
        text = "".join(pieces)
        self.conversation.add(user, text)
        sampled = completion.tokens
        unended = not interrupted and bool(sampled) and completion.finish_reason == "length"
        if unended and len(sampled) == room:
            say(
                f"the reply stopped at the model's {self.max_positions} positions (max_position_embeddings): type "
                f"{RESET} to start a new conversation"
            )
        self.cut_at_max_new_tokens = unended and len(sampled) == budget < room
        return text


class LineTooLong(Exception):
    """A line of stdin over ``--max_input_bytes``, read through and dropped."""

    def __init__(self, size_bytes: int) -> None:
        super().__init__(size_bytes)
        self.size_bytes = size_bytes


def read_line(stream: BinaryIO, max_bytes: int) -> bytes | None:
    """The next line of ``stream`` without its ``\\n``, or None at the end of input. At most ``max_bytes + 1``
    bytes are asked for at a time, so a line over ``max_bytes`` is never held whole: it is read through piece by
    piece and dropped, raising ``LineTooLong`` with its size."""
    line = stream.readline(max_bytes + 1)
    if not line:
        return None
    if line.endswith(b"\n"):
        return line[:-1]
    if len(line) <= max_bytes:  # the last line, without a line end
        return line
    size_bytes = len(line)
    del line  # each piece is dropped before the next is read: readline holds about twice what it returns
    while True:
        piece = stream.readline(max_bytes + 1)
        if not piece or piece.endswith(b"\n"):
            raise LineTooLong(size_bytes + max(len(piece) - 1, 0))  # the last piece without its line end
        size_bytes += len(piece)
        del piece


class Turns:
    """The user's lines of stdin, as text: a terminal's through ``input()`` (with the line editor, ``readline``), a
    pipe's through ``read_line`` in pieces of ``max_bytes``. Bytes that are not text in stdin's encoding are read as
    U+FFFD (a refusal would end an interactive session), said once; a line over ``max_bytes`` is refused."""

    def __init__(self, max_bytes: int, interactive: bool) -> None:
        self.max_bytes, self.interactive = max_bytes, interactive
        self.encoding = getattr(sys.stdin, "encoding", None) or "utf-8"
        self.line_number = 0
        self.said_replaced = False
        if interactive and hasattr(sys.stdin, "reconfigure"):  # input() keeps undecodable bytes, to say so below
            sys.stdin.reconfigure(errors="surrogateescape")

    def next(self) -> str:
        """The next line; ``EOFError`` at the end of input, ``UserError`` for a line over ``max_bytes`` (dropped:
        the next call reads the line after it)."""
        self.line_number += 1
        if self.interactive:
            raw = input(PROMPT).encode(self.encoding, "surrogateescape")
            size_bytes = len(raw)
        else:
            try:
                raw = read_line(sys.stdin.buffer, self.max_bytes)
            except LineTooLong as err:
                raw, size_bytes = b"", err.size_bytes
            else:
                if raw is None:
                    raise EOFError
                size_bytes = len(raw)
        if size_bytes > self.max_bytes:
            raise UserError(
                f"input line {self.line_number} is {size_bytes:,} bytes, over chat's {self.max_bytes:,} "
                "(--max_input_bytes): this message is skipped"
            )
        try:
            return raw.decode(self.encoding)
        except UnicodeDecodeError as err:
            if not self.said_replaced:
                self.said_replaced = True
                say(
                    f"input line {self.line_number} is not {self.encoding} text ({err.reason} at byte {err.start}): "
                    "bytes that do not decode are read as U+FFFD, here and in any later line"
                )
            return raw.decode(self.encoding, "replace")


def say(message: str) -> None:
    """A line for the user on stderr (not part of the replies on stdout)."""
    print(f"astrai-fabric: {message}", file=sys.stderr, flush=True)


def _write(text: str) -> None:
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:  # a terminal that cannot show the character
        encoding = sys.stdout.encoding or "ascii"
        sys.stdout.write(text.encode(encoding, "replace").decode(encoding))
    sys.stdout.flush()


def run_chat(args: ChatArgs) -> int:
    """The conversation on stdin and stdout: 0 after ``/exit`` or the end of input, 130 after Ctrl-C at the prompt."""
    args.validate()
    interactive = sys.stdin.isatty()
    try:
        model, tokenizer = load_sampler(args.param_path, args.tokenizer_path, args.device_type, "chat")
        session = ChatSession(model, tokenizer, args)
        session.ids_with("Hello")  # a template that refuses this conversation (a system message) fails now
        if interactive:
            import readline  # noqa: F401 - line editing and history for input()

            how = "its chat template" if session.conversation.templated else "plain continuation of the text"
            say(f"chat with {args.param_path} ({how}); {RESET} clears the conversation, {EXIT} or Ctrl-D leaves")
        turns = Turns(args.max_input_bytes, interactive)
        while True:
            try:
                line = turns.next()
            except EOFError:
                if interactive:
                    _write("\n")
                return 0
            except UserError as err:  # a line too long: skipped, and the chat goes on
                print(f"astrai-fabric: error: {err}", file=sys.stderr, flush=True)
                continue
            command = line.strip()
            if command == EXIT:
                return 0
            if command == RESET:
                session.reset()
                if interactive:  # piped input is a script, whose output stays the replies alone
                    kept = " (the system message stays)" if args.system else ""
                    say(f"a new conversation{kept}")
                continue
            if not command:
                continue
            try:
                session.reply(line, _write)
                if interactive and session.cut_at_max_new_tokens:
                    say(f"(cut at --max_new_tokens {args.max_new_tokens}; the model had not finished this reply)")
            except UserError as err:  # this conversation only (a template refusing it): the chat goes on
                print(f"astrai-fabric: error: {err}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        _write("\n")
        return 130
