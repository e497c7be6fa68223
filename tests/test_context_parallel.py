"""Context parallelism (``--cp_size``, ``model/context_parallel.py``) and the one mesh (``mesh.py``).

The reference for every equality is one process running the same model on the same batch: 2 gloo ranks with
``cp_size 2`` (each holding half of every window's positions, attention trading them for heads) must give its loss
and gradients to float32 rounding (1e-5 relative), for the attention variants whose masks and heads differ:
grouped KV heads split over the group, a single KV head repeated first, sliding windows with soft-capping and
Gemma's layout, MLA with DeepSeek-V3's shared RoPE key, and MoE layers (their balance loss and routing statistics
the whole window's); with document boundaries (sft's packed windows), and
on lengths the group does not split (the model pads them), causal and with a padding mask.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config
from spawn import run_ranks

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import ConfigError
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.model.transformer import forward_window
from astrai_fabric.parallel.context import check_context_parallel, describe_context_parallel
from astrai_fabric.parallel.mesh import MeshLayout, mesh_layout

# --- the layout ---------------------------------------------------------------------------------------------------


def test_the_layout_orders_dimensions_as_torchtitan_and_counts_data_ranks_apart():
    layout = mesh_layout(16, tp_size=2, fsdp_shard_size=2, cp_size=2)
    assert layout == MeshLayout(replicas=2, shards=2, cp=2, tp=2)
    assert layout.describe() == (
        "2 replica(s) x 2 shard(s) x 2 context x 2 tensor-parallel; FSDP shards over 2 x 2 = 4 rank(s)"
    )
    assert (layout.num_dp_ranks, layout.num_fsdp_shards, layout.world_size) == (4, 4, 16)
    # Row-major over (replica, shard, context, tensor): ranks 0-3 are data rank 0, its 2 context x 2 tensor ranks.
    assert [layout.dp_rank(rank) for rank in range(16)] == [r // 4 for r in range(16)]
    assert mesh_layout(4).describe() == "1 replica(s) x 4 shard(s)"


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((8, 2, None, 3), "cp_size 3 x tp_size 2 must divide the world size 8"),
        ((8, None, None, 3), "cp_size 3 must divide the world size 8"),
        ((8, None, 3, 2), "fsdp_shard_size 3 must divide the data-parallel size 4 (world size 8 / cp_size 2)"),
    ],
)
def test_sizes_that_do_not_divide_are_named(sizes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mesh_layout(*sizes)


def test_models_the_group_cannot_split_are_refused_in_one_line():
    check_context_parallel(tiny_config(), 2)  # 4 heads, 2 KV heads: both split
    check_context_parallel(tiny_config(num_key_value_heads=1), 4)  # 1 KV head: repeated, said in the plan
    assert "the KV heads repeated to 1 per rank" not in describe_context_parallel(tiny_config(), 2)
    assert "the KV heads repeated to 1" in describe_context_parallel(tiny_config(num_key_value_heads=1), 4)
    with pytest.raises(ConfigError, match=r"cp_size 4 must divide the attention heads per tensor-parallel rank \(2"):
        check_context_parallel(tiny_config(), 4, tp_size=2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(parallel_mode="ddp"), "cp_size 2 needs parallel_mode fsdp"),
        (dict(window_size=33), "cp_size 2 must divide window_size 33"),
        (dict(neftune_alpha=5.0), "cp_size 2 with neftune_alpha"),
    ],
)
def test_flags_context_parallelism_cannot_take_are_refused(flags, message):
    values = dict(train_type="seq", parallel_mode="fsdp", cp_size=2) | flags
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainArgs(**values).validate()


# --- 2 ranks against one process ---------------------------------------------------------------------------------

CONFIGS = {
    "grouped_kv": dict(),
    "one_kv_head": dict(num_key_value_heads=1),
    "gemma_sliding_softcap": dict(
        norm_placement="sandwich",
        query_pre_attn_scalar=10,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0,
        rope_local_theta=1000.0,
    ),
    "mla_shared_rope_key": dict(
        attn_type="mla",
        kv_lora_rank=8,
        q_lora_rank=12,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=6,
        mla_shared_rope_key=True,
    ),
    # The balance loss and routing statistics over the group's positions (not the padding the model adds).
    "moe": dict(ffn_type="moe", n_routed_experts=4, n_activated_experts=2, n_shared_experts=1, moe_intermediate_size=8),
}
POSITIONS = torch.tensor([list(range(6)) + list(range(10)), list(range(16))])
"""Two windows of 16: the first packs two documents (attention stops at the boundary), the second one."""


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 32, (2, 16), generator=generator)
    targets = torch.randint(0, 32, (2, 16), generator=generator)
    weights = (torch.rand(2, 16, generator=generator) > 0.3).float()
    return ids, targets, weights / weights.sum()


def losses_and_grads(model: torch.nn.Module) -> dict:
    """The logits path's and the fused head's losses on ``batch()`` (document masks on), the logits path's on 15
    of its positions with AstrAI's causal default (padded to 16 under context parallelism) and on 13 with a padding
    mask, and the gradients of their sum, each parameter whole."""
    ids, targets, weights = batch()
    whole = forward_window(model, ids, POSITIONS)
    plain = weighted_nll(whole.logits.float(), targets, weights)
    fused = forward_window(model, ids, POSITIONS, nll_targets=targets, nll_chunk_size=8, nll_weights=weights)
    short = model(ids[:, :15])
    odd = weighted_nll(short.logits.float(), targets[:, :15], weights[:, :15])
    keys = torch.arange(13) < torch.tensor([[13], [9]])  # a 2-D padding mask (AstrAI: bidirectional over the kept)
    masked = model(ids[:, :13], input_mask=keys)
    padded = weighted_nll(masked.logits.float(), targets[:, :13], weights[:, :13] * keys)
    total = plain + fused.nll_loss + odd + padded
    moe = {}
    if whole.aux_loss is not None:  # each forward's balance loss in the gradients; its statistics compared
        for name, out in (("whole", whole), ("odd", short), ("padded", masked)):
            total = total + out.aux_loss
            moe[f"aux_{name}"] = out.aux_loss.detach()
            moe[f"stats_{name}"] = [{key: value.detach() for key, value in s.items()} for s in out.router_stats]
    total.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    losses = {"plain": plain, "fused": fused.nll_loss, "odd": odd, "padded": padded}
    return {**{key: loss.detach() for key, loss in losses.items()}, "token_nll": fused.token_nll, "grads": grads, **moe}


def weighted_nll(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (per_token * weights.flatten()).sum()


def build(name: str) -> AutoRegressiveLM:
    torch.manual_seed(11)
    return AutoRegressiveLM(tiny_config(**CONFIGS[name]))


def context_parallel_worker(out: str) -> None:
    """Each config under ``parallelize(cp_size=2)`` on 2 ranks (FSDP over the context group); rank 0 saves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from astrai_fabric.parallel.parallelize import parallelize

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    results = {}
    for name in CONFIGS:
        model = parallelize(build(name), mesh, cp_size=2)
        assert model.context_parallel is not None and model.context_parallel.size == 2
        results[name] = losses_and_grads(model)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def tensor_and_context_parallel_worker(out: str) -> None:
    """Run inside tests/test_training_distributed.py's 4-rank spawn (its process group): each config on a 2 x 2
    mesh, tensor parallelism inside each context group's ranks, FSDP over the context group; rank 0 saves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from astrai_fabric.parallel.parallelize import parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    results = {name: losses_and_grads(parallelize(build(name), mesh, cp_size=2)) for name in TENSOR_PARALLEL_CONFIGS}
    if dist.get_rank() == 0:
        torch.save(results, out)


TENSOR_PARALLEL_CONFIGS = [name for name in CONFIGS if name != "one_kv_head"]
"""The configs tensor parallelism splits (one KV head does not split over 2 ranks); under it each rank's one KV
head of ``grouped_kv`` is repeated for the context group."""


def test_two_context_ranks_equal_one_process(tmp_path):
    run_ranks(context_parallel_worker, 2, str(tmp_path / "cp.pt"))
    assert list(torch.load(tmp_path / "cp.pt", weights_only=False)) == list(CONFIGS)
    check_against_one_process(str(tmp_path / "cp.pt"))


def check_against_one_process(out: str) -> None:
    """Each config's losses and gradients in ``out`` against one process's (1e-5 of the largest gradient)."""
    results = torch.load(out, weights_only=False)
    for name in results:
        ours, reference = results[name], losses_and_grads(build(name))
        for key in ("plain", "fused", "odd", "padded", "token_nll", *(k for k in reference if k.startswith("aux"))):
            torch.testing.assert_close(ours[key], reference[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        for key in (k for k in reference if k.startswith("stats")):  # counts exact, the entropy to rounding
            torch.testing.assert_close(ours[key], reference[key], rtol=1e-5, atol=0, msg=f"{name} {key}")
        for param, grad in reference["grads"].items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(
                ours["grads"][param], grad, rtol=0, atol=1e-5 * scale + 1e-8, msg=f"{name} {param}"
            )


# --- the command line ---------------------------------------------------------------------------------------------

TINY_SEQ = ["seq", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/seq", "--window_size", "32"]


def test_the_dry_run_prints_the_mesh_and_how_attention_splits(tmp_path, capsys):
    from astrai_fabric.cli import main

    flags = ["--nprocs", "8", "--parallel_mode", "fsdp", "--cp_size", "2", "--fsdp_shard_size", "2"]
    assert main([*TINY_SEQ, *flags, "--ckpt_dir", str(tmp_path / "out"), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "parallel_mode fsdp (2 replica(s) x 2 shard(s) x 2 context; FSDP shards over 2 x 2 = 4 rank(s))" in out
    assert "context      context parallel over 2 ranks" in out and "(2 query head(s) and 1 KV head(s) per rank)" in out
    assert "4 rank(s) x 1 per device" in out  # 8 ranks, 4 of them data-parallel
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nprocs", "8", "--cp_size", "8"], "cp_size 8 must divide the attention heads per tensor-parallel rank (4"),
        (["--nprocs", "2", "--cp_size", "4"], "cp_size 4 must divide the world size 2"),
    ],
)
def test_layouts_that_cannot_run_exit_2_in_one_line(tmp_path, capsys, flags, message):
    from astrai_fabric.cli import main

    argv = [*TINY_SEQ, "--parallel_mode", "fsdp", *flags, "--ckpt_dir", str(tmp_path / "out")]
    for dry in (["--dry_run"], []):  # the dry run lists it; the run refuses before it launches or writes
        if not dry and "heads" in message:
            continue  # the run meets the heads in its ranks' preflight: 8 processes here for one line
        assert main([*argv, *dry]) == 2
        captured = capsys.readouterr()
        assert message in (captured.out if dry else captured.err)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["generate", "chat", "evaluate"])
def test_commands_that_train_nothing_refuse_cp_size_in_one_line(command, capsys):
    """Generation and evaluation run every position on each rank (a KV cache, or one process): the flag is not
    theirs, and says so in one line."""
    from astrai_fabric.cli import main

    assert main([command, "bundled:tiny", "--cp_size", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown flag --cp_size" in err and "Traceback" not in err
