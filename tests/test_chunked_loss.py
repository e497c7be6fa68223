"""``losses.head_token_nll``: the head and the log-softmax fused and computed in chunks of positions. Its values and
gradients (of the hidden states and the head's weight) equal ``F.cross_entropy`` on the unfused head's float32
logits, to float32 precision, for every chunk size, with label smoothing and a loss mask; and no step of it holds
more than one chunk of logits, where the unfused computation holds all of them (counted with a dispatch mode that
sees every tensor torch creates)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from astrai_fabric.losses import head_token_nll

POSITIONS, HIDDEN, VOCAB = 2 * 13, 24, 97


def inputs(seed: int = 0, hidden_size: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 13, hidden_size, generator=rng, requires_grad=True)
    weight = (torch.randn(VOCAB, hidden_size, generator=rng) / 3).requires_grad_()
    targets = torch.randint(VOCAB, (2, 13), generator=rng)
    mask = torch.rand(2, 13, generator=rng) > 0.3
    return hidden, weight, targets, mask


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-6 of ``expected``'s norm: float32 sums taken in another order (chunks) differ in the last bits of
    elements near zero, so an element-wise relative bound would measure rounding, not correctness."""
    assert got.shape == expected.shape and (got - expected).norm() <= 1e-6 * expected.norm()


def unfused(hidden, weight, targets, smoothing: float) -> torch.Tensor:
    logits = (hidden @ weight.T).float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none",
                           label_smoothing=smoothing).view(targets.shape)  # fmt: skip


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [1, 5, POSITIONS, 1000])
def test_values_and_gradients_equal_cross_entropy_on_the_whole_logits(chunk_size, smoothing):
    hidden, weight, targets, mask = inputs()
    expected = unfused(hidden, weight, targets, smoothing)
    (expected * mask).sum().div(mask.sum()).backward()  # sft's reduction: the mean over trained tokens
    expected_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    got = head_token_nll(hidden, weight, targets, chunk_size, smoothing)
    (got * mask).sum().div(mask.sum()).backward()
    assert_close(got, expected)
    assert_close(hidden.grad, expected_grads[0])
    assert_close(weight.grad, expected_grads[1])
    assert hidden.grad[~mask].abs().max() == 0  # untrained positions get no gradient


def test_log_probabilities_for_dpo_and_grpo_have_the_same_gradients():
    """dpo/grpo sum ``-nll`` (log p) over response tokens with per-sequence weights."""
    hidden, weight, targets, _ = inputs(1)
    weights = torch.tensor([[0.5], [-2.0]])
    expected = -unfused(hidden, weight, targets, 0.0)
    (expected * weights).sum().backward()
    expected_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (-head_token_nll(hidden, weight, targets, 4) * weights).sum().backward()
    assert_close(hidden.grad, expected_grads[0])
    assert_close(weight.grad, expected_grads[1])


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation returns while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


@pytest.mark.parametrize("chunk_size", [4, 9])
def test_no_step_holds_more_than_one_chunk_of_logits(chunk_size):
    hidden, weight, targets, mask = inputs(hidden_size=3)  # the weight's V x 3 below a chunk's V x chunk_size
    with LargestTensor() as whole:
        (unfused(hidden, weight, targets, 0.0) * mask).sum().backward()
    with LargestTensor() as chunked:
        (head_token_nll(hidden, weight, targets, chunk_size) * mask).sum().backward()
    assert whole.largest >= POSITIONS * VOCAB  # the unfused head's logits (and their gradient)
    assert chunked.largest == chunk_size * VOCAB  # one chunk's logits, or their gradient


def test_a_chunk_size_below_one_is_refused():
    hidden, weight, targets, _ = inputs()
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        head_token_nll(hidden, weight, targets, 0)
