"""Sampling: the KV cache changes nothing, padding changes nothing, and the sampling knobs do what they say."""

import torch
from conftest import tiny_config

from astrai_fabric.generate import generate, left_pad, padded_attention, sample_next
from astrai_fabric.model import AutoRegressiveLM


def model():
    torch.manual_seed(0)
    config = tiny_config(max_position_embeddings=64, num_hidden_layers=2)
    net = AutoRegressiveLM(config).eval()
    with torch.no_grad():  # sharpen the random model so greedy choices are far from ties
        net.lm_head.weight.mul_(40)
    return net


def test_greedy_with_cache_equals_without_token_for_token():
    net, prompts = model(), [[5, 6, 7], [9], [1, 2, 3, 4, 5, 6]]
    cached = generate(net, prompts, 20, temperature=0, use_cache=True)
    recomputed = generate(net, prompts, 20, temperature=0, use_cache=False)
    assert cached == recomputed and all(len(c) == 20 for c in cached)


def test_a_prompt_continues_the_same_alone_or_padded_in_a_batch():
    net, prompts = model(), [[5, 6, 7], [9], [1, 2, 3, 4, 5, 6]]
    batch = generate(net, prompts, 10, temperature=0)
    assert [generate(net, [p], 10, temperature=0)[0] for p in prompts] == batch


def test_generation_stops_at_a_stop_token():
    net = model()
    free = generate(net, [[5, 6, 7]], 12, temperature=0)[0]
    stop = free[3]
    stopped = generate(net, [[5, 6, 7]], 12, temperature=0, stop_ids=[stop])[0]
    assert stopped == free[: free.index(stop) + 1]


def test_padding_and_positions():
    ids, valid = left_pad([[4, 5], [6]], pad_id=0, device="cpu")
    assert ids.tolist() == [[4, 5], [0, 6]] and valid.tolist() == [[True, True], [False, True]]
    positions, mask = padded_attention(valid)
    assert positions.tolist() == [[0, 1], [0, 0]]  # the real token of row 1 is at position 0
    assert mask[1, 0].tolist() == [[True, False], [False, True]]  # padding attends to itself only


def test_top_k_and_top_p_restrict_the_choice():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    generator = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=generator).tolist()) == {0, 1}
    assert set(sample_next(logits, 1.0, top_p=0.7, generator=generator).tolist()) == {0, 1}  # 0.5 + 0.3 >= 0.7
    assert set(sample_next(logits, 1.0, top_p=0.4, generator=generator).tolist()) == {0}
    assert set(sample_next(logits, 1.0, generator=generator).tolist()) == {0, 1, 2, 3}
    assert sample_next(logits[:1], 0.0).item() == 0
