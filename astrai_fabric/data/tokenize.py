"""Raw JSONL records to token streams: plain text for ``seq``, chat ``messages`` for ``sft``.

Chat records follow AstrAI's built-in messages pipeline: a BOS token (not trained) when the tokenizer has one,
then each message rendered alone with the chat template and encoded without special tokens, trained when the
role is ``assistant`` and masked for ``system``/``user``; position ids restart at 0 for every record (AstrAI's
``doc_reset``), which is what lets attention stop at document boundaries.

Departure from AstrAI: plain-text records are separated by the tokenizer's EOS token (AstrAI's text pipeline joins
documents with nothing between them), so the model can learn where a document ends.
"""

from __future__ import annotations

import numpy as np

from astrai_fabric.data.storage import Record
from astrai_fabric.errors import UserError
from astrai_fabric.tokenizer import Tokenizer

TRAINED_ROLES = {"assistant"}
ROLES = {"system", "user", "assistant"}


def tokenize_text(records: list[Record], tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """``{"sequence"}``: each record's ``text`` followed by EOS."""
    texts = []
    for where, record in records:
        text = record.get("text")
        if not isinstance(text, str):
            raise UserError(f"{where}: a seq record needs a string field 'text', got keys {sorted(record)}")
        texts.append(text)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = [token for encoded in tokenizer.encode_batch(texts, add_special_tokens=False) for token in encoded + eos]
    return {"sequence": np.asarray(ids, dtype=np.int32)}


def tokenize_chats(records: list[Record], tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """``{"sequence", "loss_mask", "position_ids"}`` from records ``{"messages": [{"role", "content"}, ...]}``."""
    sequence, loss_mask, position_ids = [], [], []
    for where, record in records:
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: an sft record needs a non-empty list 'messages', got keys {sorted(record)}")
        ids, mask = ([tokenizer.bos_token_id], [0]) if tokenizer.bos_token_id is not None else ([], [])
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise UserError(f"{where}: each message needs a role in {sorted(ROLES)}, got {message!r}")
            if not isinstance(message.get("content"), str):
                raise UserError(f"{where}: message content must be a string, got {message.get('content')!r}")
            encoded = tokenizer.encode(tokenizer.render_chat([message], where=where), add_special_tokens=False)
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
