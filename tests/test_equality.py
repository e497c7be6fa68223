"""The suite's criterion for "trained the same model" (tests/equality.py) on updates built here: what float32
arithmetic does to Adam's steps passes it, what a wrong mechanism does fails it."""

import pytest
import torch
from equality import UPDATE_RTOL, assert_same_training, update_ratio

LR = 2e-3


def adam_like_run(num_weights: int = 50_000) -> tuple[dict, dict]:
    """The start and 2 steps of an Adam-like update (every weight moved by the learning rate a step) of a model as
    small as the smallest the suite trains (the Hugging Face families' tiny MoE models: ~50k weights)."""
    generator = torch.Generator().manual_seed(0)
    initial = {"w": torch.randn(num_weights, generator=generator) * 0.02, "norm": torch.ones(64)}
    steps = {key: LR * torch.sign(torch.randn(value.shape, generator=generator)) * 2 for key, value in initial.items()}
    return initial, {key: initial[key] + steps[key] for key in initial}


def test_rounding_and_a_few_near_cancelling_weights_pass():
    initial, trained = adam_like_run()
    ours = {key: value.clone() for key, value in trained.items()}
    ours["w"] *= 1 + 1e-6  # rounding: a millionth of every weight
    ours["w"][0] += 0.05 * 2 * LR  # a near-cancelling weight: 5% of its steps apart
    ratio, _ = update_ratio(ours, trained, initial)
    assert ratio < UPDATE_RTOL / 4
    assert_same_training(ours, trained, initial)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda ours, initial: ours["w"].sub_(0.01 * (ours["w"] - initial["w"])),  # every update 1% short
        lambda ours, initial: ours["norm"].copy_(initial["norm"]),  # one small tensor left untrained
        lambda ours, initial: ours["w"][:1000].copy_(initial["w"][:1000]),  # 1% of the weights untrained
    ],
    ids=["updates_1pct_short", "a_tensor_untrained", "1pct_of_weights_untrained"],
)
def test_a_wrong_update_fails(break_it):
    initial, trained = adam_like_run()
    ours = {key: value.clone() for key, value in trained.items()}
    break_it(ours, initial)
    with pytest.raises(AssertionError, match="of the update"):
        assert_same_training(ours, trained, initial)


def test_a_tensor_the_reference_left_alone_must_not_move_and_nothing_trained_is_refused():
    initial, trained = adam_like_run()
    frozen = dict(trained, frozen=torch.zeros(4))
    _, per_tensor = update_ratio(dict(frozen, frozen=torch.ones(4)), frozen, dict(initial, frozen=torch.zeros(4)))
    assert per_tensor[0] == (float("inf"), "frozen")
    with pytest.raises(AssertionError, match="did not train"):
        update_ratio(initial, initial, initial)
