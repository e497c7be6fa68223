"""``astrai-fabric chat SRC``: a conversation with a model, each reply streamed as it is sampled.

The conversation is rendered with the tokenizer's chat template (an optional system message, then user and
assistant turns), or, for a tokenizer without one (or ``--template false``), kept as running text: each input on a
new line after what came before, continued by the model. A reply ends at a stop token (the template's,
``Tokenizer.stop_ids``; EOS for running text) or after ``max_new_tokens``, and prints as whole UTF-8 characters (a
byte-level token can end inside one: its bytes wait for the rest).

The KV cache is kept across turns. Each turn renders the whole conversation again; when its token ids start with
the ids the cache holds, only the rest is fed, else the cache is dropped and the conversation recomputed: a template
that rewrites earlier turns (dropping past reasoning, say), or a reply whose text encodes to other ids than those
sampled. The test is on ids, not text. A conversation that no longer fits ``max_position_embeddings`` is said in
one line; ``/reset`` starts a new one.

``/reset`` clears the conversation (the system message stays) and the cache; ``/exit`` or the end of input leaves
(exit 0). Ctrl-C during a reply stops it (what was printed stays in the conversation) and returns to the prompt; at
the prompt it leaves with exit 130. Sampling is ``generate.sample_tokens``, the loop ``generate`` runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn

from astrai_fabric.config.generate import ChatArgs
from astrai_fabric.errors import UserError
from astrai_fabric.generate import load_sampler, sample_tokens
from astrai_fabric.model.kv_cache import KVCache
from astrai_fabric.tokenizer import Message, Tokenizer

PROMPT = ">>> "
RESET, EXIT = "/reset", "/exit"
MIN_CACHE_POSITIONS = 1024
"""Positions the first KV cache holds (or the model's ``max_position_embeddings``, if fewer); a conversation
outgrowing it gets one twice as large (recomputed once), so a model with a long context does not reserve all of it
for a short chat."""


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
    """The model and its KV cache, kept across turns, with the ids the cache holds."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        args: ChatArgs,
        generator: torch.Generator | None = None,
        min_cache_positions: int = MIN_CACHE_POSITIONS,
    ) -> None:
        self.model, self.tokenizer, self.args, self.generator = model, tokenizer, args, generator
        self.conversation = Conversation(tokenizer, args.system, args.template)
        self.max_positions = model.config.max_position_embeddings
        self.min_cache_positions = min_cache_positions
        self.device = next(model.parameters()).device
        self.cache: KVCache | None = None
        self._fed: list[int] = []
        """The ids fed into the cache, in order; the first ``cache.length`` are in it (an interrupted forward may
        leave the rest out)."""
        self.recomputed_turns = 0
        """Turns whose conversation was fed whole (no cache, or one that did not hold its start): for tests."""

    @property
    def cached_ids(self) -> list[int]:
        return self._fed[: self.cache.length] if self.cache is not None else []

    def reset(self) -> None:
        self.conversation.reset()
        self.cache, self._fed = None, []

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
        does not fit the model (said in one line). Ctrl-C stops the reply where it is: what was written is kept."""
        ids = self.ids_with(user)
        room = self.max_positions - len(ids)
        if room < 1:
            say(
                f"the conversation ({len(ids)} tokens with this message) no longer fits the model's "
                f"{self.max_positions} positions (max_position_embeddings): type {RESET} to start a new one"
            )
            return None
        budget = min(self.args.max_new_tokens, room)
        text_of, pieces, sampled = self.tokenizer.decode_stream(), [], []
        stop_ids, interrupted = set(self.conversation.stop_ids), False
        try:
            with torch.no_grad():
                logits = self._prefill(ids, len(ids) + budget)
                for token in sample_tokens(
                    logits,
                    self._feed_token,
                    budget,
                    temperature=self.args.temperature,
                    top_k=self.args.top_k,
                    top_p=self.args.top_p,
                    stop_ids=sorted(stop_ids),
                    generator=self.generator,
                ):
                    sampled.append(int(token))
                    if piece := text_of(sampled[-1]):
                        write(piece)
                        pieces.append(piece)  # once shown
        except KeyboardInterrupt:  # Ctrl-C: this reply ends here
            interrupted = True
        write("\n")
        text = "".join(pieces)
        self.conversation.add(user, text)
        if not interrupted and len(sampled) == room and sampled[-1] not in stop_ids:
            say(
                f"the reply stopped at the model's {self.max_positions} positions (max_position_embeddings): type "
                f"{RESET} to start a new conversation"
            )
        return text

    def _prefill(self, ids: list[int], positions: int) -> Tensor:
        """Logits after ``ids``, feeding only what the cache does not hold; a cache for ``positions`` positions."""
        cached = self.cached_ids
        reuse = len(ids) > len(cached) and ids[: len(cached)] == cached
        if self.cache is None or not reuse or self.cache.max_len < positions:
            held = self.cache.max_len if self.cache is not None else 0
            size = held if held >= positions else max(positions, 2 * held, self.min_cache_positions)
            self.cache, self._fed = KVCache(min(self.max_positions, size)), []
            self.recomputed_turns += 1
        return self._feed(ids[self.cache.length :])

    def _feed(self, ids: list[int]) -> Tensor:
        del self._fed[self.cache.length :]
        self._fed += ids
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model(tokens, kv_cache=self.cache).logits[:, -1]

    def _feed_token(self, token: Tensor) -> Tensor:
        return self._feed(token.tolist())


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
        model, tokenizer, generator = load_sampler(args, "chat")
        session = ChatSession(model, tokenizer, args, generator)
        session.ids_with("Hello")  # a template that refuses this conversation (a system message) fails now
        if interactive:
            import readline  # noqa: F401 - line editing and history for input()

            how = "its chat template" if session.conversation.templated else "plain continuation of the text"
            say(f"chat with {args.param_path} ({how}); {RESET} clears the conversation, {EXIT} or Ctrl-D leaves")
        while True:
            try:
                line = input(PROMPT if interactive else "")
            except EOFError:
                if interactive:
                    _write("\n")
                return 0
            command = line.strip()
            if command == EXIT:
                return 0
            if command == RESET:
                session.reset()
                continue
            if not command:
                continue
            try:
                session.reply(line, _write)
            except UserError as err:  # this conversation only (a template refusing it): the chat goes on
                print(f"astrai-fabric: error: {err}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        _write("\n")
        return 130
