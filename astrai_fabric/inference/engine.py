"""``Engine``: continuous batching over a paged KV cache with prefix reuse (the package docstring says how).

One ``step`` admits what fits, decodes one token for every request past its prompt (one forward), then prefills the
next chunk of the prompts still being read (one more forward, at most ``max_prefill_tokens`` positions), and samples
for every request whose logits are ready. A request that finishes leaves at once and gives its blocks back.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from astrai_fabric.inference.blocks import BlockPool
from astrai_fabric.inference.paged_cache import BatchView, LayerShape, PagedKVCache
from astrai_fabric.inference.sampling import RequestError, SamplingParams, TokenLogprobs, sample
from astrai_fabric.model.attention import MLA

CPU_KV_CACHE_MEMORY = 2**30
"""The KV pool's bytes on CPU when none is given (1 GiB), capped at what ``max_num_seqs`` requests of the longest
length hold."""
CUDA_KV_CACHE_FRACTION = 0.9
PREFILL_PADDING = 1.25
"""How much longer than a row a prefill forward's longest row may be (its padding costs a forward's work)."""
"""Of the device's free memory when none is given, on CUDA."""


@dataclass
class Completion:
    """One completion of one request: what it has sampled so far, and why it ended."""

    request_id: int
    index: int
    """Which of the request's ``n`` completions."""
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    """The sampled tokens (a stop token kept)."""
    finish_reason: str | None = None
    """None while it runs; ``stop`` (a stop token or string), ``length`` (``max_tokens``), ``cancelled``."""
    stop_reason: int | str | None = None
    """The stop token or string that ended it."""
    text: str | None = None
    """The decoded tokens (an engine with a tokenizer), cut before a stop string."""
    logprobs: list[TokenLogprobs] | None = None
    num_cached_prompt_tokens: int = 0
    """Prompt positions found in the prefix cache (not computed)."""


@dataclass
class _Sequence:
    """A completion being made: its tokens, its block table, what the pool owes it."""

    completion: Completion
    params: SamplingParams
    generator: torch.Generator
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Positions whose keys and values are in the pool."""
    num_registered: int = 0
    """Full blocks registered for prefix reuse."""
    reserved: int = 0
    """Blocks admission promised it and it has not taken yet."""

    @property
    def tokens(self) -> list[int]:
        return self.completion.prompt + self.completion.tokens

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= len(self.completion.prompt)


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    seed: int


def layer_shapes(model: nn.Module) -> dict[int, LayerShape]:
    """What each attention layer caches per position, by its ``layer_id``."""
    shapes = {}
    for _, block in model.numbered_blocks():
        attention = block.attention
        value_dim = attention.v_dim if isinstance(attention, MLA) else attention.head_dim
        shapes[attention.layer_id] = LayerShape(attention.n_kv_heads, attention.head_dim, value_dim)
    return shapes


class Engine:
    """Requests in, tokens out: ``add_request`` then ``step`` until ``has_work`` is False (or ``generate``)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 512,
        max_model_len: int | None = None,
        decode: Callable[[list[int]], str] | None = None,
        seed: int = 0,
        lockstep: Callable[[bool], bool] | None = None,
    ) -> None:
        """``model`` an ``AutoRegressiveLM`` in eval mode, or Fabric's wrapper of one (its forward is called, so a
        sharded model's hooks run); ``decode`` a tokenizer's, for stop strings and texts; ``seed`` draws the seeds of
        requests that give none. ``lockstep``, for ranks whose forwards are collectives (FSDP, tensor parallelism):
        ``lockstep(this rank has work) -> some rank has``, called once a step; every step then runs exactly two
        forwards on every rank, a rank with nothing to run taking a one-token forward without a cache."""
        self.model = model
        config = model.config
        parameter = next(model.parameters())
        self.device, self.vocab_size = parameter.device, config.vocab_size
        # A RoPE whose table changes past a length (LongRoPE, dynamic NTK) would rotate cached keys with the old one:
        # requests stay below it (``max_model_len``).
        switch = model.rotary_embedding.switch_length
        limits = [config.max_position_embeddings, max_model_len or math.inf, switch or math.inf]
        self.max_model_len = int(min(limits))
        self.max_num_seqs, self.max_prefill_tokens, self.block_size = max_num_seqs, max_prefill_tokens, block_size
        shapes = layer_shapes(model)
        dtype = parameter.dtype if parameter.is_floating_point() else torch.float32
        element = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = block_size * sum(s.bytes_per_position(element) for s in shapes.values())
        if num_blocks is None:
            memory = kv_cache_memory if kv_cache_memory is not None else default_kv_cache_memory(self.device)
            most_useful = max_num_seqs * math.ceil(self.max_model_len / block_size)
            num_blocks = min(memory // self.bytes_per_block, most_useful)
        if num_blocks < 1:
            raise RequestError(
                f"kv_cache_memory: {kv_cache_memory} bytes hold no block of {block_size} positions "
                f"({self.bytes_per_block} bytes for this model)"
            )
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PagedKVCache(num_blocks, block_size)
        self.decode, self.lockstep = decode, lockstep
        self.seeds = torch.Generator().manual_seed(seed)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Sequence] = []
        self.completions: dict[int, list[Completion]] = {}
        self.next_id = 0
        self.num_prompt_positions = 0
        """Prompt positions of the requests admitted, each completion's counted (``n`` of them share one)."""
        self.num_prefill_positions = 0
        """Prompt positions computed: the others were found in the prefix cache or shared by a request's
        completions."""
        self.num_forwards = 0
        self.num_cancelled = 0
        """Requests cancelled before they ended."""

    @property
    def capacity_tokens(self) -> int:
        """Positions the pool holds."""
        return self.pool.num_blocks * self.block_size

    @property
    def prefix_hit_rate(self) -> float:
        """Of the prompt positions admitted, the share not computed (found cached, or shared by ``n``)."""
        return 1 - self.num_prefill_positions / self.num_prompt_positions if self.num_prompt_positions else 0.0

    def add_request(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """Queue ``prompt`` (token ids) for ``params.n`` completions; its id. ``RequestError`` naming the field that
        cannot be served, before anything is queued."""
        params.check(self.vocab_size)
        if not isinstance(prompt, Sequence) or isinstance(prompt, str) or not prompt:
            raise RequestError("prompt: expected a non-empty list of token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt):
            raise RequestError(f"prompt: expected token ids in [0, {self.vocab_size})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"max_tokens: the prompt's {len(prompt)} tokens + max_tokens {params.max_tokens} = {total} exceed the "
                f"model's {self.max_model_len} positions"
            )
        if params.stop and self.decode is None:
            raise RequestError("stop: stop strings need the engine's tokenizer (pass decode=)")
        if params.n > self.max_num_seqs:
            raise RequestError(f"n: {params.n} completions exceed max_num_seqs {self.max_num_seqs}")
        if (needed := self._blocks_needed(len(prompt), params, 0)) > self.pool.num_blocks:
            raise RequestError(
                f"max_tokens: {params.n} completion(s) of {total} positions take {needed} blocks of "
                f"{self.block_size}, more than the KV cache's {self.pool.num_blocks}"
            )
        request_id = self.next_id
        self.next_id += 1
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.seeds))
        self.waiting.append(_Request(request_id, list(prompt), params, seed))
        self.completions[request_id] = []
        return request_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def keep_stepping(self) -> bool:
        """Whether to step again: this engine has work, or, in lockstep, some rank's has."""
        return self.lockstep(self.has_work()) if self.lockstep is not None else self.has_work()

    def cancel(self, request_id: int) -> None:
        """Stop ``request_id`` where it is: its blocks back to the pool at once."""
        waiting = len(self.waiting)
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        running = [s for s in self.running if s.completion.request_id == request_id]
        for sequence in running:
            self._finish(sequence, "cancelled")
        self.num_cancelled += bool(running) or len(self.waiting) < waiting

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        """Every prompt's ``params.n`` completions, run to their ends."""
        ids = [self.add_request(prompt, params) for prompt in prompts]
        while self.keep_stepping():
            self.step()
        return [self.completions.pop(i) for i in ids]

    @torch.no_grad()
    def step(self) -> list[tuple[Completion, int]]:
        """Admit, decode, prefill a chunk, sample: each ``(completion, token)`` sampled in this step."""
        self._admit()
        sampled = []
        decoding = [s for s in self.running if s.prefilled]
        if decoding:
            logits = self._forward(decoding, [1] * len(decoding))
            sampled += self._sample(decoding, logits)
        elif self.lockstep is not None:
            self._idle_forward()
        prefilling, chunks, budget = [], [], self.max_prefill_tokens
        for sequence in self.running:
            if sequence.prefilled or budget <= 0:
                continue
            chunk = min(len(sequence.completion.prompt) - sequence.num_computed, budget)
            prefilling.append(sequence)
            chunks.append(chunk)
            budget -= chunk
        if not prefilling and self.lockstep is not None:
            self._idle_forward()
        for group in self._prefill_groups(chunks):
            sequences = [prefilling[row] for row in group]
            logits = self._forward(sequences, [chunks[row] for row in group])
            self.num_prefill_positions += sum(chunks[row] for row in group)
            for sequence, row_logits in zip(sequences, logits, strict=True):
                if sequence.prefilled:
                    forked = self._fork(sequence)
                    sampled += self._sample(forked, row_logits.expand(len(forked), -1))
        return sampled

    def _prefill_groups(self, chunks: list[int]) -> list[list[int]]:
        """The prefill chunks (their indices) in forwards of similar lengths: a forward pads each row to its longest,
        so a row at most ``PREFILL_PADDING`` times shorter joins it. In lockstep, one forward for all (every rank's
        step runs two)."""
        if not chunks:
            return []
        if self.lockstep is not None:
            return [list(range(len(chunks)))]
        groups: list[list[int]] = []
        for row in sorted(range(len(chunks)), key=lambda r: -chunks[r]):
            if groups and chunks[row] * PREFILL_PADDING >= chunks[groups[-1][0]]:
                groups[-1].append(row)
            else:
                groups.append([row])
        return groups

    def _blocks_needed(self, num_prompt: int, params: SamplingParams, num_hits: int) -> int:
        return blocks_needed(num_prompt, params.max_tokens, params.n, self.block_size) - num_hits

    def _admit(self) -> None:
        """Waiting requests in order while they fit (slots and blocks): the first that does not waits, and those
        behind it (no overtaking)."""
        while self.waiting:
            request = self.waiting[0]
            if len(self.running) + request.params.n > self.max_num_seqs:
                return
            # At least the last prompt position is computed: its logits give the first token.
            reusable = (len(request.prompt) - 1) // self.block_size
            hits = self.pool.lookup(request.prompt, reusable)
            if self._being_prefilled(request.prompt, reusable) > len(hits):
                # A request reading the same prompt blocks now (a shared system prompt): wait for them, then reuse
                self.pool.release(hits)
                return
            needed = self._blocks_needed(len(request.prompt), request.params, len(hits))
            if self.pool.num_available() - sum(s.reserved for s in self.running) < needed:
                self.pool.release(hits)
                return
            self.waiting.popleft()
            self.num_prompt_positions += request.params.n * len(request.prompt)
            completion = Completion(request.request_id, 0, request.prompt)
            completion.num_cached_prompt_tokens = len(hits) * self.block_size
            generator = torch.Generator(self.device).manual_seed(request.seed)
            sequence = _Sequence(completion, request.params, generator, list(hits), len(hits) * self.block_size)
            sequence.num_registered, sequence.reserved = len(hits), needed
            self.running.append(sequence)
            self.completions[request.request_id].append(completion)

    def _being_prefilled(self, prompt: list[int], max_blocks: int) -> int:
        """The most of ``prompt``'s first full blocks (at most ``max_blocks``) that a request still reading its own
        prompt shares with it: they will be found in the cache once that request has computed them."""
        most = 0
        for sequence in self.running:
            if sequence.prefilled:
                continue
            other = sequence.completion.prompt
            common = next((i for i, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b), len(other))
            most = max(most, min(common, len(prompt)) // self.block_size)
        return min(most, max_blocks)

    def _forward(self, sequences: list[_Sequence], lengths: list[int]) -> Tensor:
        """The next ``lengths[r]`` positions of each sequence through the model, their keys and values into the
        pool; the logits ``[B, V]`` after each one's last."""
        ids = []
        for sequence, length in zip(sequences, lengths, strict=True):
            self._take_blocks(sequence, sequence.num_computed + length)
            ids.append(sequence.tokens[sequence.num_computed : sequence.num_computed + length])
        width = max(lengths)
        input_ids = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens in ids])
        tables, pasts = [s.blocks for s in sequences], [s.num_computed for s in sequences]
        view = BatchView(self.cache, tables, pasts, lengths, self.device)
        mask, positions = view.mask_and_positions()
        last = torch.tensor(lengths, device=self.device) - 1
        # The model's own forward (a sharded model's hooks run there), the head at each row's last new position only
        out = self.model(input_ids.to(self.device), mask, positions, view, logits_at=last)
        logits = out.logits[:, 0]
        self.num_forwards += 1
        for sequence, length in zip(sequences, lengths, strict=True):
            sequence.num_computed += length
            self._register_full_blocks(sequence)
        return logits

    def _idle_forward(self) -> None:
        """A rank's share of another rank's forward (lockstep): one token, no cache, the output dropped."""
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device))
        self.num_forwards += 1

    def _take_blocks(self, sequence: _Sequence, num_positions: int) -> None:
        """Blocks from the pool until ``sequence`` has room for ``num_positions``, out of its reservation."""
        while len(sequence.blocks) * self.block_size < num_positions:
            if sequence.reserved <= 0:
                raise RuntimeError("a sequence outgrew the blocks admission reserved for it (a bug)")
            sequence.blocks.append(self.pool.allocate())
            sequence.reserved -= 1

    def _register_full_blocks(self, sequence: _Sequence) -> None:
        """Each block now full of computed positions, findable by its tokens."""
        tokens, size = sequence.tokens, self.block_size
        while (sequence.num_registered + 1) * size <= sequence.num_computed:
            index = sequence.num_registered
            parent = sequence.blocks[index - 1] if index else None
            self.pool.register(sequence.blocks[index], parent, tokens[index * size : (index + 1) * size])
            sequence.num_registered += 1

    def _fork(self, sequence: _Sequence) -> list[_Sequence]:
        """A prefilled request's ``n`` completions: the prompt's full blocks shared, its last partial block copied
        for each one after the first, the reservation dealt out (``_blocks_needed``)."""
        params, completion = sequence.params, sequence.completion
        if params.n == 1:
            return [sequence]
        num_prompt, size = len(completion.prompt), self.block_size
        partial = num_prompt % size != 0
        own = math.ceil((num_prompt + params.max_tokens - 1) / size) - num_prompt // size
        full = sequence.blocks[: num_prompt // size]
        forked = [sequence]
        sequence.reserved -= (params.n - 1) * own  # the others' share, now theirs
        seed = sequence.generator.initial_seed()
        for index in range(1, params.n):
            for block in full:
                self.pool.hold(block)
            blocks = list(full)
            if partial:
                blocks.append(self.pool.allocate())
                self.cache.copy_block(sequence.blocks[-1], blocks[-1])
            child = Completion(completion.request_id, index, completion.prompt)
            child.num_cached_prompt_tokens = completion.num_cached_prompt_tokens
            generator = torch.Generator(self.device).manual_seed(seed + index)
            forked.append(_Sequence(child, params, generator, blocks, sequence.num_computed, len(full), own - partial))
            self.completions[completion.request_id].append(child)
        self.running.extend(forked[1:])
        return forked

    def _sample(self, sequences: list[_Sequence], logits: Tensor) -> list[tuple[Completion, int]]:
        sampled = []
        for sequence, row in zip(sequences, logits, strict=True):
            params, completion = sequence.params, sequence.completion
            history = None
            if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
                history = torch.tensor(sequence.tokens, device=row.device)
            token, logprobs = sample(row, params, history, len(completion.prompt), sequence.generator)
            completion.tokens.append(token)
            if logprobs is not None:
                completion.logprobs = [*(completion.logprobs or []), logprobs]
            sampled.append((completion, token))
            self._maybe_finish(sequence, token)
        return sampled

    def _maybe_finish(self, sequence: _Sequence, token: int) -> None:
        params, completion = sequence.params, sequence.completion
        if self.decode is not None:
            completion.text = self.decode(completion.tokens)
        if token in params.stop_token_ids:
            self._finish(sequence, "stop", token)
        elif params.stop and (found := _first_stop(completion.text, params.stop)) is not None:
            completion.text = completion.text[: found[0]]
            self._finish(sequence, "stop", found[1])
        elif len(completion.tokens) >= params.max_tokens:
            self._finish(sequence, "length")

    def _finish(self, sequence: _Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        sequence.completion.finish_reason, sequence.completion.stop_reason = reason, stop_reason
        self.running.remove(sequence)
        self.pool.release(sequence.blocks)
        sequence.blocks, sequence.reserved = [], 0


def blocks_needed(num_prompt: int, max_tokens: int, n: int, block_size: int) -> int:
    """Blocks a request of ``n`` completions may take: its prompt's full blocks once (shared by its completions),
    each completion's own (the prompt's last partial block, copied, and what it samples; the last token sampled is
    never fed)."""
    shared = num_prompt // block_size
    own = math.ceil((num_prompt + max_tokens - 1) / block_size) - shared
    return shared + n * own


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Where the earliest stop string begins in ``text``, and which; None when none is there."""
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(found) if found else None


def default_kv_cache_memory(device: torch.device) -> int:
    """The KV pool's bytes when none is given: a share of the free memory on CUDA, a stated figure elsewhere."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_CACHE_FRACTION)
    return CPU_KV_CACHE_MEMORY
