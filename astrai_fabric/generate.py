"""Batched autoregressive sampling with a KV cache: temperature, top-k, top-p, stop tokens.

Prompts of different lengths are left-padded; position ids count real tokens only (a prompt starts at 0 whatever
its padding) and attention never looks at padding, so a prompt's continuation does not depend on its neighbours
in the batch. Used by online GRPO and by ``astrai-fabric generate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from astrai_fabric import assets
from astrai_fabric.checkpoint import load_model
from astrai_fabric.config.generate import GenerateArgs
from astrai_fabric.errors import ConfigError, UserError
from astrai_fabric.model.kv_cache import KVCache
from astrai_fabric.tokenizer import Tokenizer


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
    """``ids [B, P]`` with each prompt right-aligned, and ``valid [B, P]`` marking the real tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(prompt, device=device)
        valid[row, width - len(prompt) :] = True
    return ids, valid


def padded_attention(valid: Tensor) -> tuple[Tensor, Tensor]:
    """``position_ids [B, L]`` and a causal mask ``[B, 1, L, L]`` that skips padding (True = attend).

    A padding position attends to itself only, so no row of the mask is empty (an empty row gives NaN).
    """
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    length = valid.size(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    itself = torch.eye(length, dtype=torch.bool, device=valid.device)
    return positions, ((causal & valid[:, None, :]) | itself).unsqueeze(1)


def sample_next(
    logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    """One token per row of ``logits [B, V]``; ``temperature == 0`` is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs > top_p  # tokens after the nucleus (the first always stays)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    all_done: Callable[[bool], bool] | None = None,
) -> list[list[int]]:
    """Continue each prompt (token ids) by up to ``max_new_tokens``; a continuation ends with its stop token.

    ``all_done(local_done) -> bool`` lets distributed callers stop only when every rank is done (each forward of a
    sharded model is a collective, so all ranks must take the same number of steps). ``use_cache=False`` recomputes
    the whole sequence at every step (for checking the cache).
    """
    device = next(model.parameters()).device
    ids, valid = left_pad(prompts, pad_id, device)
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    cache = KVCache(ids.size(1) + max_new_tokens) if use_cache else None
    positions, mask = padded_attention(valid)
    logits = model(ids, input_mask=mask, position_ids=positions, kv_cache=cache)["logits"][:, -1]
    new_tokens, finished = [], torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        token = token.masked_fill(finished, pad_id)
        new_tokens.append(token)
        finished |= torch.isin(token, stop)
        done = bool(finished.all())
        if (all_done(done) if all_done is not None else done) or step == max_new_tokens - 1:
            break
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        if cache is not None:
            next_positions = positions[:, -1:] + 1
            out = model(token[:, None], input_mask=valid[:, None, None, :], position_ids=next_positions, kv_cache=cache)
            positions = torch.cat([positions, next_positions], dim=1)
        else:
            ids = torch.cat([ids, token[:, None]], dim=1)
            positions, mask = padded_attention(valid)
            out = model(ids, input_mask=mask, position_ids=positions)
        logits = out["logits"][:, -1]
    return [_until_stop(row.tolist(), set(stop_ids)) for row in torch.stack(new_tokens, dim=1)]


def _until_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens


def run_generate(args: GenerateArgs) -> list[list[str]]:
    """Print and return ``num_samples`` continuations of every prompt."""
    if args.param_path is None or not args.prompt:
        raise ConfigError("generate needs --param_path and at least one --prompt")
    if (
        not (0 <= args.temperature < math.inf and 0 < args.top_p <= 1 and args.top_k >= 0)
        or min(args.max_new_tokens, args.num_samples) < 1
    ):
        raise ConfigError(
            "generate: need a finite temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 1 and "
            f"num_samples >= 1; got {args.temperature}, {args.top_p}, {args.top_k}, {args.max_new_tokens}, "
            f"{args.num_samples}"
        )
    if args.device_type not in (None, "cpu", "cuda"):
        raise ConfigError(f"generate: device_type must be cpu or cuda, got {args.device_type!r}")
    if args.device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("generate: --device_type cuda, but no CUDA device is available here")
    device = torch.device(args.device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(assets.resolve(args.param_path)).to(device).eval()
    tokenizer = Tokenizer.from_dir(assets.resolve(args.tokenizer_path or args.param_path))
    system = [{"role": "system", "content": args.system}] if args.system else []
    encoded = [
        tokenizer.apply_chat_template([*system, {"role": "user", "content": p}]) if args.chat else tokenizer.encode(p)
        for p in args.prompt
    ]
    for prompt, ids in zip(args.prompt, encoded, strict=True):
        if not ids:
            how = "its chat_template renders it" if args.chat else "it encodes"
            raise UserError(
                f"--prompt {prompt[:40]!r}: with the tokenizer in {tokenizer.directory}, {how} as no token (and no "
                "bos_token is added): there is nothing to continue"
            )
    stop_ids = tokenizer.stop_ids if args.chat else [t for t in (tokenizer.eos_token_id,) if t is not None]
    generator = torch.Generator(device).manual_seed(args.seed)
    batch = [ids for ids in encoded for _ in range(args.num_samples)]
    limit = model.config.max_position_embeddings - max(len(ids) for ids in batch)
    if limit < 1:
        raise ConfigError(f"a prompt fills the model's {model.config.max_position_embeddings} positions")
    outputs = generate(
        model, batch, min(args.max_new_tokens, limit), temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, stop_ids=stop_ids, pad_id=tokenizer.padding_id, generator=generator,
    )  # fmt: skip
    texts = [tokenizer.decode_whole_chars(out) for out in outputs]
    grouped = [texts[i : i + args.num_samples] for i in range(0, len(texts), args.num_samples)]
    for prompt, samples in zip(args.prompt, grouped, strict=True):
        for sample in samples:
            print(f">>> {prompt}\n{sample}\n")
    return grouped
