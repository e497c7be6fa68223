"""The generation engine (``astrai_fabric.inference``): continuous batching, the paged KV cache, prefix reuse,
per-request sampling, and the requests it refuses.

The reference for greedy decoding is the static batch of ``generate.generate`` run on one prompt alone (one row, a
contiguous cache): the engine, running every prompt together in a few slots with chunked prefill and small blocks,
must give each the same tokens. The random models' heads are scaled up so greedy choices are far from ties (the
logits of a row alone and in a batch differ by ~1e-7 on CPU, which a near-tie would turn into another token).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_config
from test_context_parallel import CONFIGS

from astrai_fabric.generate import generate
from astrai_fabric.inference import Engine, RequestError, SamplingParams, blocks
from astrai_fabric.inference.blocks import BlockPool
from astrai_fabric.inference.sampling import token_probabilities
from astrai_fabric.model import AutoRegressiveLM

FAMILIES = {
    **CONFIGS,  # GQA, one KV head, Gemma's sliding windows and soft-capping, MLA, MoE
    "qk_norm_gated": dict(use_qk_norm=True, qk_norm_before_rope=True, use_gated_attention=True, head_dim=8),
}
MAX_TOKENS = 12


def model(name: str = "grouped_kv", sharpen: bool = True) -> AutoRegressiveLM:
    torch.manual_seed(0)
    net = AutoRegressiveLM(tiny_config(max_position_embeddings=64, **FAMILIES[name])).eval()
    if sharpen:  # greedy choices far from ties
        with torch.no_grad():
            net.lm_head.weight.mul_(40)
    return net


def prompts(count: int = 9, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (count,), generator=generator).tolist()
    return [torch.randint(0, 32, (length,), generator=generator).tolist() for length in lengths]


def greedy(max_tokens: int = MAX_TOKENS, **more) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **more)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_under_a_mixed_concurrent_load_equals_each_request_alone(name):
    net, batch = model(name), prompts()
    alone = [generate(net, [prompt], MAX_TOKENS, temperature=0)[0] for prompt in batch]
    # Three slots for nine requests, prefill chunks of 7 positions, blocks of 4: requests join and leave mid-run
    engine = Engine(net, block_size=4, max_num_seqs=3, max_prefill_tokens=7)
    ids = [engine.add_request(prompt, greedy(logprobs=0)) for prompt in batch]
    overlapped = False
    while engine.has_work():
        engine.step()
        overlapped |= len({sequence.prefilled for sequence in engine.running}) == 2  # prefill beside decode
    assert overlapped
    assert [engine.completions[i][0].tokens for i in ids] == alone
    assert all(engine.completions[i][0].finish_reason == "length" for i in ids)
    for prompt, i in zip(batch, ids, strict=True):  # the log-probabilities of the whole sequence's one forward
        completion = engine.completions[i][0]
        with torch.no_grad():
            logits = net(torch.tensor([prompt + completion.tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(1, torch.tensor(completion.tokens)[:, None])[:, 0]
        assert [r.logprob for r in completion.logprobs] == pytest.approx(expected.tolist(), abs=1e-4)


def test_a_prompts_completions_share_its_blocks_and_a_later_prompt_finds_them():
    net, prompt = model(), prompts(1, seed=5)[0] + list(range(20))
    engine = Engine(net, block_size=4)
    [group] = engine.generate([prompt], greedy(n=4))
    assert engine.num_prefill_positions == len(prompt)  # once for the four
    expected = generate(net, [prompt], MAX_TOKENS, temperature=0)[0]
    assert [c.tokens for c in group] == [expected] * 4 and [c.index for c in group] == [0, 1, 2, 3]
    longer = prompt + [7, 8]
    [[again]] = engine.generate([longer], greedy())
    assert again.num_cached_prompt_tokens == (len(longer) - 1) // 4 * 4
    assert engine.num_prefill_positions == len(prompt) + len(longer) - again.num_cached_prompt_tokens
    assert again.tokens == generate(net, [longer], MAX_TOKENS, temperature=0)[0]
    assert 0 < engine.prefix_hit_rate < 1


def test_requests_sharing_a_system_prompt_prefill_it_once_even_when_they_arrive_together():
    net, system = model(), list(range(3, 23))  # 20 positions: 5 full blocks of 4
    batch = [system + tail for tail in ([1, 2, 3], [4, 5], [6, 7, 8, 9])]
    engine = Engine(net, block_size=4, max_num_seqs=4)
    for prompt in batch:
        engine.add_request(prompt, greedy())
    engine.step()
    assert len(engine.running) == 1 and len(engine.waiting) == 2  # the others wait for its blocks
    while engine.has_work():
        engine.step()
    found = [engine.completions[i][0].num_cached_prompt_tokens for i in range(3)]
    assert found == [0, 20, 20]
    assert engine.num_prefill_positions == sum(len(p) for p in batch) - 40
    assert [engine.completions[i][0].tokens for i in range(3)] == [
        generate(net, [p], MAX_TOKENS, temperature=0)[0] for p in batch
    ]


def test_blocks_return_to_the_pool_when_requests_finish_or_are_cancelled():
    engine = Engine(model(), block_size=4, num_blocks=40)
    available = engine.pool.num_available()
    ids = [engine.add_request(prompt, greedy(20)) for prompt in prompts(3)]
    for _ in range(4):
        engine.step()
    victim = next(s for s in engine.running if s.completion.request_id == ids[1])
    held, before = len(victim.blocks), engine.pool.num_available()
    assert held > 0 and victim.prefilled
    engine.cancel(ids[1])
    assert engine.pool.num_available() == before + held  # at once, not when the others finish
    assert engine.completions[ids[1]][0].finish_reason == "cancelled"
    while engine.has_work():
        engine.step()
    assert engine.pool.num_available() == available
    assert all(block.refs == 0 for block in engine.pool.blocks)


def test_a_request_that_does_not_fit_yet_waits_and_then_runs():
    net, batch = model(), prompts(4)
    # Room for one request at a time: each takes ceil((prompt + 11) / 4) <= 10 blocks of the 10
    engine = Engine(net, block_size=4, num_blocks=10)
    ids = [engine.add_request(prompt, greedy()) for prompt in batch]
    engine.step()
    assert len(engine.running) == 1 and len(engine.waiting) == 3
    while engine.has_work():
        engine.step()
    alone = [generate(net, [prompt], MAX_TOKENS, temperature=0)[0] for prompt in batch]
    assert [engine.completions[i][0].tokens for i in ids] == alone


def test_stop_tokens_end_a_completion_and_keep_it():
    net, prompt = model(), prompts(1)[0]
    free = generate(net, [prompt], MAX_TOKENS, temperature=0)[0]
    [[stopped]] = Engine(net).generate([prompt], greedy(stop_token_ids=[free[4]]))
    assert stopped.tokens == free[: free.index(free[4]) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", free[4])


def test_stop_strings_end_a_completion_across_token_boundaries():
    net, prompt = model(), prompts(1)[0]
    spelled = {token: chr(ord("a") + token % 26) * (1 + token % 3) for token in range(32)}  # 1-3 letters a token

    def decode(tokens: list[int]) -> str:
        return "".join(spelled[t] for t in tokens)

    free = generate(net, [prompt], MAX_TOKENS, temperature=0)[0]
    text = decode(free)
    boundary = len(decode(free[:5]))  # a stop string that begins in token 4 and ends in token 5
    stop = text[boundary - 1 : boundary + 1]
    [[stopped]] = Engine(net, decode=decode).generate([prompt], greedy(stop=[stop]))
    cut = text.find(stop)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[:cut]
    assert len(decode(stopped.tokens)) >= cut + len(stop) > len(decode(stopped.tokens[:-1]))


def test_seeded_sampling_repeats_and_each_completion_draws_its_own():
    net, prompt = model(sharpen=False), prompts(1)[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, n=3, seed=11)
    first = [c.tokens for c in Engine(net).generate([prompt], params)[0]]
    again = [c.tokens for c in Engine(net, seed=99).generate([prompt], params)[0]]
    assert first == again and len({tuple(t) for t in first}) == 3


def test_a_prompts_completions_each_equal_a_request_seeded_as_it_is():
    """Completion i of ``n`` (seed s) samples as a request of its own seeded s + i, and the model gives it the same
    log-probabilities (to 1e-5: another batch): the completions' own copies of the prompt's last, partial block
    (20 positions in blocks of 8) keep them apart."""
    net, prompt = model(sharpen=False), (prompts(1, seed=8)[0] * 2)[:20]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, n=3, seed=11, logprobs=0)
    together = Engine(net, block_size=8).generate([prompt], params)[0]
    assert len({tuple(c.tokens) for c in together}) == 3
    for index, completion in enumerate(together):
        alone = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11 + index, logprobs=0)
        [[reference]] = Engine(net, block_size=8).generate([prompt], alone)
        assert completion.tokens == reference.tokens
        ours, theirs = ([r.logprob for r in c.logprobs] for c in (completion, reference))
        assert ours == pytest.approx(theirs, abs=1e-5)


def test_logprobs_are_the_models_own():
    net, prompt = model(), prompts(1)[0]
    [[completion]] = Engine(net).generate([prompt], greedy(4, logprobs=3))
    with torch.no_grad():
        logits = net(torch.tensor([prompt + completion.tokens])).logits[0, len(prompt) - 1 : -1].float()
    expected = logits.log_softmax(-1)
    for step, (token, record) in enumerate(zip(completion.tokens, completion.logprobs, strict=True)):
        assert record.logprob == pytest.approx(expected[step, token].item(), abs=1e-4)
        assert [t for t, _ in record.top] == expected[step].topk(3).indices.tolist()


def test_the_sampling_filters_equal_transformers_logits_processors():
    """Our probabilities after the penalty, temperature, top-k, top-p and min-p against transformers' processors
    applied in the same order (the reference: ``transformers.generation.logits_process``)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    history = torch.tensor([3, 7, 7, 20, 41])
    cases = [
        dict(repetition_penalty=1.3),
        dict(temperature=0.7, top_k=10),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=0.9, min_p=0.05),
        dict(repetition_penalty=0.8, temperature=0.6, top_k=20, top_p=0.9, min_p=0.02),
    ]
    for case in cases:
        params = SamplingParams(**case)
        processors = [RepetitionPenaltyLogitsProcessor(params.repetition_penalty)]
        processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            processors.append(TopPLogitsWarper(params.top_p))
        if params.min_p:
            processors.append(MinPLogitsWarper(params.min_p))
        scores = logits[None].clone()
        for processor in processors:
            scores = processor(history[None], scores)
        ours = token_probabilities(logits, params, history, num_prompt=len(history))
        assert torch.allclose(ours, scores.softmax(-1)[0], atol=1e-6), case


def test_presence_frequency_penalties_and_logit_bias_as_openai_defines_them():
    logits = torch.zeros(8)
    history = torch.tensor([1, 2, 2, 5, 5, 5])  # prompt [1, 2], completion [2, 5, 5, 5]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 2.0}, temperature=1.0)
    probs = token_probabilities(logits, params, history, num_prompt=2)
    expected = torch.zeros(8)
    expected[2] -= 0.5 + 0.25  # once in the completion (the prompt's does not count)
    expected[5] -= 0.5 + 0.75
    expected[7] += 2.0
    assert torch.allclose(probs, expected.softmax(-1), atol=1e-6)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (dict(prompt=[]), "prompt: expected a non-empty list of token ids"),
        (dict(prompt=[40]), r"prompt: expected token ids in \[0, 32\)"),
        (dict(prompt=[1] * 60), "max_tokens: the prompt's 60 tokens . max_tokens 12 = 72 exceed the model's 64"),
        (dict(max_tokens=0), "max_tokens: expected an integer >= 1, got 0"),
        (dict(max_tokens=100), "exceed the model's 64 positions"),
        (dict(n=10**6), r"n: expected an integer in \[1, 256\], got 1000000"),
        (dict(top_p=0), r"top_p: expected a number in \(0, 1\], got 0"),
        (dict(top_p=2), r"top_p: expected a number in \(0, 1\], got 2"),
        (dict(temperature=math.nan), "temperature: expected a finite number >= 0, got nan"),
        (dict(seed="7"), "seed: expected an integer"),
        (dict(stop=["x" * 10_000_000]), "stop: expected non-empty strings of at most 1024 characters"),
        (dict(logprobs=21), r"logprobs: expected an integer in \[0, 20\]"),
        (dict(logit_bias={99: 1.0}), r"logit_bias: expected token ids in \[0, 32\)"),
    ],
)
def test_bad_requests_are_refused_in_one_line_and_the_engine_serves_the_others(request_, message):
    engine = Engine(model(), decode=lambda tokens: "")
    good = engine.add_request([1, 2, 3], greedy(4))
    prompt = request_.pop("prompt", [1, 2, 3])
    with pytest.raises(RequestError, match=message) as refused:
        engine.add_request(prompt, SamplingParams(**{"max_tokens": MAX_TOKENS, **request_}))
    assert "\n" not in str(refused.value)
    while engine.has_work():
        engine.step()
    assert engine.completions[good][0].finish_reason == "length" and len(engine.completions) == 1


def test_a_request_larger_than_the_pool_is_refused_naming_the_limits():
    engine = Engine(model(), block_size=4, num_blocks=3)
    with pytest.raises(RequestError, match=r"of 22 positions take 6 blocks of 4, more than the KV cache's 3"):
        engine.add_request(list(range(10)), greedy())


@pytest.mark.parametrize("collide", [False, True])
def test_the_pool_finds_a_chain_only_after_exactly_its_parents_and_evicts_the_least_recently_used(collide, monkeypatch):
    """Also when every key's hash is the same: a block is found by its tokens after its very parent, never by a
    hash alone."""
    if collide:
        monkeypatch.setattr(blocks, "chain_hash", lambda key: 0)
    pool = BlockPool(num_blocks=4, block_size=2)
    first, second = pool.allocate(), pool.allocate()
    pool.register(first, None, [1, 2])
    pool.register(second, first, [3, 4])
    assert pool.lookup([1, 2, 3, 4, 5], max_blocks=2) == [first, second]
    assert pool.lookup([9, 9, 3, 4], max_blocks=2) == []  # the same second block after another first
    other_first, other_second = pool.allocate(), pool.allocate()
    pool.register(other_first, None, [5, 6])
    pool.register(other_second, other_first, [3, 4])  # the tokens of ``second``, after another block
    assert pool.lookup([5, 6, 3, 4], max_blocks=2) == [other_first, other_second]
    pool.release([other_first, other_second])
    pool.release([other_first, other_second])
    pool.release([first, second])
    pool.release([first, second])
    assert pool.num_available() == 4
    pool.allocate(), pool.allocate()  # the other chain goes first: used longer ago
    evicted = pool.allocate()  # then the least recently used cached: the chain's tail before its head
    assert evicted == second and pool.lookup([1, 2, 3, 4], max_blocks=2) == [first]
    pool.release([first])
    assert pool.allocate() == first and pool.lookup([1, 2], max_blocks=1) == []


def lockstep_worker(out: str) -> None:
    """Two FSDP ranks, each its own requests (rank 1 more, and longer ones): the engine's forwards are collectives,
    so the ranks step in lockstep until both are done; each saves what it sampled."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from astrai_fabric.parallel.parallelize import parallelize

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    net = parallelize(model(), mesh)  # the same weights on both ranks, then sharded

    def lockstep(has_work: bool) -> bool:
        pending = torch.tensor([float(has_work)])
        dist.all_reduce(pending)
        return bool(pending.item() > 0)

    batch = prompts(2 + 3 * rank, seed=7 + rank)
    engine = Engine(net, block_size=4, max_num_seqs=2, lockstep=lockstep)
    with torch.no_grad():
        sampled = [group[0].tokens for group in engine.generate(batch, greedy(6 + 4 * rank))]
    torch.save({"prompts": batch, "sampled": sampled, "forwards": engine.num_forwards}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_sharded_ranks_step_in_lockstep_and_each_samples_as_one_process(tmp_path):
    from spawn import run_ranks

    run_ranks(lockstep_worker, 2, str(tmp_path / "lockstep"))
    net = model()
    results = [torch.load(f"{tmp_path / 'lockstep'}.{rank}") for rank in (0, 1)]
    assert results[0]["forwards"] == results[1]["forwards"]  # every forward a collective, taken by both
    for rank, result in enumerate(results):
        alone = [generate(net, [p], 6 + 4 * rank, temperature=0)[0] for p in result["prompts"]]
        assert result["sampled"] == alone
