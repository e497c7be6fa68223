"""``losses.head_token_nll``: the head and the log-softmax fused and computed in chunks of positions. Its values and
gradients (of the hidden states and the head's weight) equal ``F.cross_entropy`` on the unfused head's float32
logits, to float32 precision, for every chunk size, with label smoothing and a loss mask; and no step of it holds
more than one chunk of logits, where the unfused computation holds all of them (counted with a dispatch mode that
sees every tensor torch creates). Where the forward takes the gradients (a frozen head under any loss, seq's and sft's
weighted mean), they are still exact and the backward makes no logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from astrai_fabric.losses import head_nll_loss, head_token_nll, token_nll_loss, token_nll_weights

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
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none", label_smoothing=smoothing).view(
        targets.shape
    )


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


@pytest.mark.parametrize("frozen", [False, True], ids=["trained-head", "frozen-head"])
@pytest.mark.parametrize("chunk_size", [4, 9])
def test_no_step_holds_more_than_one_chunk_of_logits(chunk_size, frozen):
    hidden, weight, targets, mask = inputs(hidden_size=3)  # the weight's V x 3 below a chunk's V x chunk_size
    weight.requires_grad_(not frozen)
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
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        head_nll_loss(hidden, weight, targets, token_nll_weights(targets), 0)


# --- gradients taken in the forward: a frozen head, and a loss whose token weights are known ----------------------


def dpo_like(nll: torch.Tensor) -> torch.Tensor:
    """A loss nonlinear in each token's log-probability and across tokens: squared, then dpo's logsigmoid of the
    difference of two sequences' sums."""
    logp = -nll
    return -F.logsigmoid(0.1 * (logp[0].sum() - logp[1].sum())) + (nll**2).sum() / 50


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [1, 5, 1000])
def test_a_frozen_heads_stored_gradient_serves_a_nonlinear_loss(chunk_size, smoothing):
    """The frozen head's forward stores each position's ``d nll / d hidden``; dpo, grpo and kto take the token losses
    through nonlinear functions, and each token's gradient is still its stored row times its upstream scalar."""
    hidden, weight, targets, _ = inputs(2)
    weight.requires_grad_(False)
    dpo_like(unfused(hidden, weight, targets, smoothing)).backward()
    expected = hidden.grad.clone()
    hidden.grad = None
    dpo_like(head_token_nll(hidden, weight, targets, chunk_size, smoothing)).backward()
    assert_close(hidden.grad, expected)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained-head", "frozen-head"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("masked", [False, True], ids=["seq", "sft"])
def test_the_weighted_loss_and_its_gradients_equal_cross_entropy(masked, smoothing, frozen):
    """``head_nll_loss`` with ``token_nll_weights``: seq's mean over every token, sft's over the masked ones, equal
    to the unfused mean (value and gradients), the upstream scalar applied (a loop dividing by its accumulation
    steps), the per-token losses returned detached."""
    hidden, weight, targets, mask = inputs(3)
    weight.requires_grad_(not frozen)
    loss_mask = mask if masked else None
    expected = token_nll_loss(unfused(hidden, weight, targets, smoothing), loss_mask)
    (expected / 4).backward()
    expected_grads = hidden.grad.clone(), weight.grad.clone() if not frozen else None
    hidden.grad = weight.grad = None
    loss, token_nll = head_nll_loss(hidden, weight, targets, token_nll_weights(targets, loss_mask), 5, smoothing)
    (loss / 4).backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert not token_nll.requires_grad
    assert_close(token_nll, unfused(hidden, weight, targets, smoothing).detach())
    assert_close(hidden.grad, expected_grads[0])
    if frozen:
        assert weight.grad is None
    else:
        assert_close(weight.grad, expected_grads[1])


def test_a_weighted_micro_batch_without_trained_tokens_is_exactly_zero():
    """B8 on the weighted path: all-zero weights, a loss of exactly 0 and gradients of exactly 0 (not NaN)."""
    hidden, weight, targets, mask = inputs(4)
    loss, _ = head_nll_loss(hidden, weight, targets, token_nll_weights(targets, torch.zeros_like(mask)), 5, 0.1)
    loss.backward()
    assert loss.item() == 0.0
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


@pytest.mark.parametrize("frozen", [False, True], ids=["trained-head", "frozen-head"])
@pytest.mark.parametrize("weighted", [False, True], ids=["any-loss", "weighted"])
def test_the_backward_recomputes_no_logits_where_the_forward_took_the_gradients(weighted, frozen):
    """The backward alone under the dispatch mode: no chunk of logits where the forward took the gradients (a frozen
    head, or known token weights); the recomputing backward of a trained head under an unknown loss makes them."""
    hidden, weight, targets, mask = inputs(hidden_size=3)
    weight.requires_grad_(not frozen)
    if weighted:
        loss, _ = head_nll_loss(hidden, weight, targets, token_nll_weights(targets, mask), 4)
    else:
        loss = dpo_like(head_token_nll(hidden, weight, targets, 4))
    with LargestTensor() as backward:
        loss.backward()
    recomputes = not (weighted or frozen)
    assert (backward.largest >= 4 * VOCAB) == recomputes


class MatmulCount(TorchDispatchMode):
    """How many matrix products run while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
        return func(*args, **(kwargs or {}))


def test_no_gradient_work_is_done_without_grad():
    """A reference model, evaluation, rollouts: under ``no_grad`` (where torch still says the inputs need a
    gradient) the forward takes the logits alone, one product per chunk, on both paths."""
    hidden, weight, targets, mask = inputs()
    for with_grad, products in ((False, 6), (True, 18)):  # 6 chunks of 5: logits, then d/d hidden and d/d weight
        with torch.set_grad_enabled(with_grad), MatmulCount() as counted:
            head_nll_loss(hidden, weight, targets, token_nll_weights(targets, mask), 5)
        assert counted.count == products
    weight.requires_grad_(False)
    for with_grad, products in ((False, 6), (True, 12)):  # the frozen head: logits, then d/d hidden
        with torch.set_grad_enabled(with_grad), MatmulCount() as counted:
            head_token_nll(hidden, weight, targets, 5)
        assert counted.count == products


# --- the model and the train types -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [{"tie_word_embeddings": True}, {"tie_word_embeddings": False},
     {"ffn_type": "moe", "n_routed_experts": 4, "n_shared_experts": 1, "n_activated_experts": 2}],
    ids=["tied", "untied", "moe"],
)  # fmt: skip
def test_the_models_fused_head_gives_its_logits_loss_and_gradients(overrides):
    """``model(ids, nll_targets=..., nll_chunk_size=N)`` against cross-entropy on ``model(ids)["logits"]``: the
    values, and the gradient of every parameter (a tied head's reaches the embedding through both uses; an MoE
    model's aux loss is still returned)."""
    from conftest import tiny_config

    from astrai_fabric.model import AutoRegressiveLM

    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config(**overrides))
    ids = torch.randint(32, (3, 12))
    targets = torch.randint(32, (3, 12))
    expected = unfused_logits_loss = F.cross_entropy(
        model(ids)["logits"].flatten(0, 1).float(), targets.flatten(), label_smoothing=0.1
    )
    unfused_logits_loss.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    out = model(ids, nll_targets=targets, nll_chunk_size=5, label_smoothing=0.1)
    assert "logits" not in out and ("aux_loss" in out) == ("ffn_type" in overrides)
    got = out["token_nll"].mean()
    got.backward()
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    for name, param in model.named_parameters():
        assert_close(param.grad, expected_grads[name])


def run_args(tmp_path, train_type: str, **overrides):
    from astrai_fabric.config.train import TrainArgs

    values = dict(
        param_path="bundled:tiny",
        data_root_path=f"bundled:data/{train_type}",
        train_type=train_type,
        ckpt_dir=str(tmp_path),
        window_size=32,
        batch_per_device=2,
        max_steps=2,
        max_lr=1e-3,
        num_workers=0,
        parallel_mode="none",
        random_seed=1,
        ckpt_interval=1000,
        label_smoothing=0.1 if train_type in ("seq", "sft") else 0.0,
        group_size=2,
    )
    values.update(overrides)
    return TrainArgs(**values)


@pytest.mark.parametrize("train_type", ["seq", "sft", "dpo", "grpo"])
def test_each_train_type_trains_the_same_with_the_loss_fused(tmp_path, train_type, capsys):
    """Two optimizer steps with ``--loss_chunk_size 7`` against ``0`` (the whole logits): the same losses, gradient
    norms and metrics (float32 sums in another order: 1e-5); the plan says the loss is fused."""
    from astrai_fabric.train import run

    whole = run(run_args(tmp_path / "whole", train_type, loss_chunk_size=0))
    assert "loss fused with the head" not in capsys.readouterr().out
    fused = run(run_args(tmp_path / "fused", train_type, loss_chunk_size=7))
    assert "loss fused with the head, 7 positions at a time" in capsys.readouterr().out
    assert len(fused) == len(whole) == 2
    for mine, reference in zip(fused, whole, strict=True):
        for name, value in reference.items():
            if isinstance(value, float) and name not in ("tokens_per_sec", "samples_per_sec", "step_time", "mfu"):
                # abs: dpo's rewards are beta times a difference of two summed log-probabilities of about -100
                assert mine[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name


@pytest.mark.parametrize(("train_type", "fused"), [("seq", True), ("sft", True), ("dpo", False), ("grpo", False)])
def test_the_loss_is_fused_by_default_where_that_is_the_faster(tmp_path, train_type, fused, capsys):
    """On CPU a mean over tokens (seq, sft) is fused at any size (bench/fused_loss.py: never the slower at any size
    measured), and the plan says why; a loss whose backward recomputes the logits (dpo, grpo) only from 256 MB of
    them (the bundled model's 2 x 32 x 2,048 logits are far below)."""
    from astrai_fabric.train import run

    run(run_args(tmp_path, train_type, dry_run=True))
    out = capsys.readouterr().out
    reason = "loss fused with the head, 4096 positions at a time (the default for a mean over tokens on CPU"
    assert (reason in out) is fused and (("loss fused with the head" in out) is fused), out  # 2**23 / 2048


@pytest.mark.parametrize("train_type", ["seq", "dpo", "grpo"])
def test_no_train_types_step_holds_the_whole_logits_when_fused(train_type):
    """Each train type's loss and backward (the policy's and, for dpo/grpo, the reference's forward) under the
    dispatch mode: fused, no tensor as large as the micro-batch's logits; whole, at least one."""
    from conftest import tiny_config

    from astrai_fabric.model import AutoRegressiveLM
    from astrai_fabric.train.dpo import dpo_batch_loss
    from astrai_fabric.train.grpo import grpo_batch_loss
    from astrai_fabric.train.lm import lm_loss

    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config(vocab_size=512))
    ids = torch.randint(512, (2, 2, 12))
    batches = {
        "seq": (lm_loss, {"input_ids": ids[0], "target_ids": ids[1]}, {"label_smoothing": 0.0}),
        "dpo": (
            dpo_batch_loss,
            {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)},
            {"reference": None, "beta": 0.1},
        ),
        "grpo": (
            grpo_batch_loss,
            {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool), "rewards": torch.rand(2, 2)},
            {"reference": None, "clip_eps": 0.2, "kl_coef": 0.1},
        ),
    }
    loss_fn, batch, options = batches[train_type]
    positions = batch["input_ids"].numel()
    largest = {}
    for chunk in (0, 5):
        with LargestTensor() as seen:
            loss, _ = loss_fn(model, batch, moe_aux_loss_coef=0.0, loss_chunk_size=chunk, **options)
            loss.backward()
        largest[chunk] = seen.largest
    assert largest[0] >= positions * 512 > largest[5]


def test_a_negative_loss_chunk_size_is_one_line_and_nothing_is_written(tmp_path, capsys):
    from astrai_fabric.cli import main

    argv = [
        "seq",
        "--param_path",
        "bundled:tiny",
        "--data_root_path",
        "bundled:data/seq",
        "--ckpt_dir",
        str(tmp_path / "run"),
        "--loss_chunk_size",
        "-1",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("loss_chunk_size must be >= 0 (0: off), got -1")
    assert not (tmp_path / "run").exists()
