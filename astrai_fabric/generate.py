"""``astrai-fabric generate`` (``run_generate``, on the generation engine, ``inference.Engine``), and the static
batch the engine replaced: ``generate``, batched sampling with a contiguous KV cache (temperature, top-k, top-p, stop
tokens), kept as the engine tests' reference (nothing of the package generates with it).

Prompts of different lengths are left-padded; position ids count real tokens only (a prompt starts at 0 whatever
its padding) and attention never looks at padding, so a prompt's continuation does not depend on its neighbours
in the batch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from astrai_fabric import hub
from astrai_fabric.checkpoint import load_language_model
from astrai_fabric.config.generate import GenerateArgs
from astrai_fabric.errors import ConfigError, UserError
from astrai_fabric.inference import Engine, SamplingParams
from astrai_fabric.json_files import parse_json
from astrai_fabric.model.kv_cache import KVCache
from astrai_fabric.regular_files import read_regular_file
from astrai_fabric.tokenizer import Tokenizer

MAX_PROMPTS_FILE_BYTES = 2**30
"""The largest ``--prompts_file`` read (whole, then a line at a time)."""


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
    cache = KVCache(ids.size(1) + max_new_tokens) if use_cache else None
    positions, mask = padded_attention(valid)
    logits = model(ids, input_mask=mask, position_ids=positions, kv_cache=cache).logits[:, -1]

    def feed(token: Tensor) -> Tensor:
        nonlocal ids, valid, positions
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        if cache is not None:
            next_positions = positions[:, -1:] + 1
            out = model(token[:, None], input_mask=valid[:, None, None, :], position_ids=next_positions, kv_cache=cache)
            positions = torch.cat([positions, next_positions], dim=1)
        else:
            ids = torch.cat([ids, token[:, None]], dim=1)
            positions, mask = padded_attention(valid)
            out = model(ids, input_mask=mask, position_ids=positions)
        return out.logits[:, -1]

    sampled = sample_tokens(
        logits,
        feed,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_ids=stop_ids,
        pad_id=pad_id,
        generator=generator,
        all_done=all_done,
    )
    new_tokens = list(sampled)
    return [_until_stop(row.tolist(), set(stop_ids)) for row in torch.stack(new_tokens, dim=1)]


@torch.no_grad()
def sample_tokens(
    logits: Tensor,
    feed: Callable[[Tensor], Tensor],
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    all_done: Callable[[bool], bool] | None = None,
) -> Iterator[Tensor]:
    """The one sampling loop (``generate``'s, and ``chat``'s as it streams): a token per row of ``logits [B, V]``,
    yielded as soon as it is sampled, then ``feed(token [B]) -> logits`` for the next, until every row has sampled a
    stop token (rows that have are padded with ``pad_id``) or ``max_new_tokens``. The last token is never fed."""
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=logits.device)
    finished = torch.zeros(logits.size(0), dtype=torch.bool, device=logits.device)
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        token = token.masked_fill(finished, pad_id)
        finished |= torch.isin(token, stop)
        yield token
        done = bool(finished.all())
        if (all_done(done) if all_done is not None else done) or step == max_new_tokens - 1:
            break
        logits = feed(token)


def _until_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens


def load_sampler(
    param_path: str, tokenizer_path: str | None, device_type: str | None, command: str
) -> tuple[nn.Module, Tokenizer]:
    """The model (on ``device_type``, default cuda where there is one; in eval mode) and its tokenizer (the model's
    own unless ``tokenizer_path``) that ``command`` (generate, chat, serve) samples from."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{command}: --device_type cuda, but no CUDA device is available here")
    device = torch.device(device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
    directory = hub.resolve_model(param_path, "param_path")  # a path, or a Hub id's snapshot
    model = load_language_model(directory, command=command).to(device).eval()
    tokenizer = Tokenizer.from_dir(hub.resolve_model(tokenizer_path, "tokenizer_path") if tokenizer_path else directory)
    return model, tokenizer


def run_generate(args: GenerateArgs) -> list[list[str]]:
    """``num_samples`` continuations of every prompt, all run together by the generation engine
    (``inference.Engine``); printed, or written to ``--output`` as JSONL. Prompt i's continuation j is seeded
    ``seed + i * num_samples + j``, whatever else runs beside it."""
    args.validate()
    texts = list(args.prompt) + (read_prompts(Path(args.prompts_file)) if args.prompts_file else [])
    if args.output and (Path(args.output).is_dir() or not Path(args.output).parent.is_dir()):
        raise ConfigError(f"output {args.output}: expected a file path in an existing directory")
    model, tokenizer = load_sampler(args.param_path, args.tokenizer_path, args.device_type, "generate")
    system = [{"role": "system", "content": args.system}] if args.system else []
    encoded = [
        tokenizer.apply_chat_template([*system, {"role": "user", "content": p}]) if args.chat else tokenizer.encode(p)
        for p in texts
    ]
    for prompt, ids in zip(texts, encoded, strict=True):
        if not ids:
            how = "its chat_template renders it" if args.chat else "it encodes"
            raise UserError(
                f"--prompt {prompt[:40]!r}: with the tokenizer in {tokenizer.directory}, {how} as no token (and no "
                "bos_token is added): there is nothing to continue"
            )
    stop_ids = tokenizer.stop_ids if args.chat else [t for t in (tokenizer.eos_token_id,) if t is not None]
    engine = Engine(model, max_num_seqs=args.max_num_seqs, seed=args.seed, kv_cache_memory=args.kv_cache_bytes())
    requests = []
    for index, ids in enumerate(encoded):
        room = engine.max_model_len - len(ids)
        if room < 1:
            raise ConfigError(f"a prompt ({len(ids)} tokens) fills the model's {engine.max_model_len} positions")
        params = SamplingParams(
            max_tokens=min(args.max_new_tokens, room),
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed + index * args.num_samples,
            stop_token_ids=stop_ids,
            n=args.num_samples,
        )
        requests.append(engine.add_request(ids, params))
    with tqdm(total=len(requests), desc="prompts", unit="prompt", disable=len(requests) < 2) as bar:
        while engine.has_work():
            for completion, _ in engine.step():
                group = engine.completions[completion.request_id]
                if completion.finish_reason and all(c.finish_reason for c in group) and len(group) == args.num_samples:
                    bar.update()
    grouped = [[tokenizer.decode_whole_chars(c.tokens) for c in engine.completions[i]] for i in requests]
    if args.output:
        reasons = [[c.finish_reason for c in engine.completions[i]] for i in requests]
        lines = [
            {"prompt": prompt, "completions": samples, "finish_reasons": why}
            for prompt, samples, why in zip(texts, grouped, reasons, strict=True)
        ]
        output = Path(args.output)
        staging = output.with_name(f".{output.name}.tmp-{os.getpid()}")  # whole or not at all
        staging.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
        staging.replace(output)
        print(f"{len(lines)} prompt(s) x {args.num_samples} completion(s) written to {args.output}")
        return grouped
    for prompt, samples in zip(texts, grouped, strict=True):
        for sample in samples:
            print(f">>> {prompt}\n{sample}\n")
    return grouped


def read_prompts(path: Path) -> list[str]:
    """The ``prompt`` of each line of the JSONL file ``path`` (blank lines skipped); one line naming the file and
    line where one is not an object with a ``prompt`` string."""
    prompts = []
    data = read_regular_file(path, max_bytes=MAX_PROMPTS_FILE_BYTES, what="JSONL prompts", error=ConfigError)
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json(line, f"prompts_file {path}:{number}", ConfigError)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ConfigError(f'prompts_file {path}:{number}: expected an object with a "prompt" string')
        prompts.append(record["prompt"])
    if not prompts:
        raise ConfigError(f"prompts_file {path}: holds no prompt")
    return prompts
