"""Raw JSONL records to token streams: plain text for ``seq``, chat ``messages`` for ``sft``.

Chat records follow AstrAI's built-in messages pipeline: a BOS token (not trained) when the tokenizer has one,
then each message rendered alone with the chat template and encoded without special tokens, trained when the
role is ``assistant`` and masked for ``system``/``user``; position ids restart at 0 for every record (AstrAI's
``doc_reset``), which is what lets attention stop at document boundaries.

A Hugging Face tokenizer's templates are written for whole conversations (a BOS or a default system prompt once at
the start, a role header that depends on the turns before), so there each message's tokens are what rendering the
first k messages adds to the first k - 1 (the template must render a conversation's beginning as a prefix of the
whole); no BOS is added beyond what the template writes, as transformers' ``apply_chat_template``.

Departure from AstrAI: plain-text records are separated by the tokenizer's EOS token (AstrAI's text pipeline joins
documents with nothing between them), so the model can learn where a document ends.
"""

from __future__ import annotations

import numpy as np

from astrai_fabric.data.storage import Record
from astrai_fabric.errors import UserError, brief
from astrai_fabric.tokenizer import HUGGING_FACE, Message, Tokenizer

TRAINED_ROLES = ("assistant",)
ROLES = ("system", "user", "assistant")  # tuples: a list or mapping read as a role is compared, never hashed


def tokenize_text(records: list[Record], tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """``{"sequence"}``: each record's ``text`` followed by EOS."""
    texts = []
    for where, record in records:
        text = record.get("text")
        if not isinstance(text, str):  # a parquet or CSV column of numbers arrives here as numbers
            got = f"keys {sorted(record)}" if text is None else f"{type(text).__name__} {text!r:.60}"
            raise UserError(f"{where}: a seq record needs a string field 'text', got {got}")
        texts.append(text)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = [token for encoded in tokenizer.encode_batch(texts, add_special_tokens=False) for token in encoded + eos]
    return {"sequence": np.asarray(ids, dtype=np.int32)}


def message_texts(tokenizer: Tokenizer, messages: list[Message], where: str) -> list[str]:
    """Each message's rendered text: rendered alone (AstrAI's pipeline), or, for a Hugging Face tokenizer, what it
    adds to the conversation before it (module docstring)."""
    if tokenizer.layout != HUGGING_FACE:
        return [tokenizer.render_chat([message], where=where) for message in messages]
    texts, before = [], ""
    for k in range(1, len(messages) + 1):
        text = tokenizer.render_chat(messages[:k], where=where)
        if not text.startswith(before):
            raise UserError(
                f"{where}: the chat template renders the first {k - 1} messages differently once message {k} follows, "
                "so each message's tokens (and the loss mask) cannot be told apart"
            )
        texts.append(text[len(before) :])
        before = text
    return texts


def tokenize_chats(records: list[Record], tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """``{"sequence", "loss_mask", "position_ids"}`` from records ``{"messages": [{"role", "content"}, ...]}``."""
    sequence, loss_mask, position_ids = [], [], []
    for where, record in records:
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            raise UserError(
                f"{where}: an sft record needs a non-empty list 'messages', got keys {brief(sorted(record))}"
            )
        astrai_bos = tokenizer.bos_token_id is not None and tokenizer.layout != HUGGING_FACE
        ids, mask = ([tokenizer.bos_token_id], [0]) if astrai_bos else ([], [])
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise UserError(f"{where}: each message needs a role in {sorted(ROLES)}, got {brief(message)}")
            if not isinstance(message.get("content"), str):
                raise UserError(f"{where}: message content must be a string, got {brief(message.get('content'))}")
        for message, text in zip(messages, message_texts(tokenizer, messages, where), strict=True):
            encoded = tokenizer.encode(text, add_special_tokens=False)
            ids += encoded
            mask += [int(message["role"] in TRAINED_ROLES)] * len(encoded)
        sequence += ids
        loss_mask += mask
        position_ids += range(len(ids))
    return {
        "sequence": np.asarray(sequence, dtype=np.int32),
        "loss_mask": np.asarray(loss_mask, dtype=np.bool_),
        "position_ids": np.asarray(position_ids, dtype=np.int32),
    }
