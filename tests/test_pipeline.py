"""Pipeline parallelism (``--pp_size``): the stages' split, the flags it refuses, and training on 2 and 4 real gloo
processes against one process.

The reference for every equality is one process training the same model on the same samples (the bundled tiny
model: 4 layers, tied embeddings): 2 stages (and 2 stages x FSDP 2 on 4 ranks) must give its losses and gradient
norms within float32 norms' rounding and its weights within 1e-4 of the update (tests/equality.py), the tied head's
two copies updated as one tensor; the
checkpoint a pipeline writes is one process's (weights and ``optimizer.pt`` whole), and it resumes in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from equality import assert_bit_equal, assert_same_training, initial_weights
from safetensors.torch import load_file
from spawn import run_ranks
from test_lora import make_base
from test_training_distributed import base_args, stored_state_bytes

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import ConfigError
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.model.pipeline import (
    StageLoss,
    check_pipeline,
    describe_pipeline,
    describe_stages,
    held_by_other_stages,
    in_whole_order,
    keep_stages,
    layer_parameters,
    stage_layers,
)
from astrai_fabric.parallel.mesh import MeshLayout, mesh_layout
from astrai_fabric.train import run

# --- the split and the layout --------------------------------------------------------------------------------------


def test_stages_are_balanced_by_parameters_counting_the_embedding_and_the_head():
    # Embeddings as large as two blocks: the end stages take fewer blocks than the middle ones.
    config = tiny_config(num_hidden_layers=8, vocab_size=200, hidden_size=16, intermediate_size=24)
    per_layer = layer_parameters(config)
    assert sum(per_layer) + 16 + 200 * 16 == AutoRegressiveLM(config).num_parameters()
    ranges = stage_layers(config, 3)
    assert [list(r) for r in ranges] == [[0, 1], [2, 3, 4, 5], [6, 7]]
    assert describe_stages(ranges) == (
        "stage 0: layers 0-1 (+ embedding); stage 1: layers 2-5; stage 2: layers 6-7 (+ norm, head)"
    )
    # Uneven counts are balanced, not refused; every stage holds a block.
    assert [len(r) for r in stage_layers(tiny_config(num_hidden_layers=5), 2)] == [3, 2]
    assert [len(r) for r in stage_layers(tiny_config(num_hidden_layers=3), 3)] == [1, 1, 1]


def test_models_the_stages_cannot_split_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="pp_size 3 exceeds the model's 2 decoder layers"):
        check_pipeline(tiny_config(), 3)
    with pytest.raises(ConfigError, match="pp_size 2 x pp_stages_per_rank 2 = 4 stages exceed the model's 2 decoder"):
        check_pipeline(tiny_config(), 2, 2)
    moe = tiny_config(ffn_type="moe", n_routed_experts=4, n_activated_experts=2, moe_intermediate_size=8)
    with pytest.raises(ConfigError, match="pp_size 2 with an MoE model"):
        check_pipeline(moe, 2)


def test_interleaved_ranks_hold_their_stages_looped():
    # 2 ranks x 2 stages of one block each: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (torch's looped
    # placement, which its interleaved schedules assume).
    config = tiny_config(num_hidden_layers=4)
    assert describe_pipeline(config, 2, 2, "interleaved_1f1b", 4) == (
        "4 stages on 2 ranks (2 each, looped), interleaved_1f1b over 4 micro-batches per step (blocks balanced by "
        "parameters): stage 0 (rank 0): layer 0 (+ embedding); stage 1 (rank 1): layer 1; stage 2 (rank 0): layer 2; "
        "stage 3 (rank 1): layer 3 (+ norm, head)"
    )
    whole = list(AutoRegressiveLM(config).state_dict())
    first, last = (keep_stages(AutoRegressiveLM(config), rank, 2, 2) for rank in range(2))
    assert [i for i, _ in first.numbered_blocks()] == [0, 2] and [i for i, _ in last.numbered_blocks()] == [1, 3]
    assert [[m.stage.index for m in rank.stage_modules] for rank in (first, last)] == [[0, 2], [1, 3]]
    # Each stage module runs the rank's own tensors: one set of parameters, under the whole model's names.
    assert first.stage_modules[1].layers["2"] is first.layers["2"]
    assert first.stage_modules[0].embed_tokens is first.embed_tokens and first.stage_modules[1].embed_tokens is None
    assert last.stage_modules[1].lm_head is last.lm_head and last.stage_modules[0].lm_head is None
    # The ranks' names, one after the other, interleave the blocks; in_whole_order gives the whole model's order.
    joined = [n for rank in (first, last) for n in rank.state_dict() if n != "lm_head.weight"]
    assert joined != whole and in_whole_order(joined) == whole
    first.eval()
    assert not any(module.training for module in first.stage_modules)  # their recomputation follows the mode
    with pytest.raises(TypeError, match="runs through its schedule"):
        first(torch.zeros(1, 4, dtype=torch.long))


def test_a_schedule_of_one_stage_per_rank_refuses_a_rank_of_several(tmp_path):
    from astrai_fabric.parallel.pipeline import Pipeline

    model = keep_stages(AutoRegressiveLM(tiny_config(num_hidden_layers=4)), 0, 2, 2)
    with pytest.raises(ConfigError, match="pp_schedule 1f1b runs one stage per rank, and this model holds 2"):
        Pipeline(None, model, "1f1b", 4, 2, torch.float32, StageLoss(), tmp_path)


def test_the_pipeline_is_the_outermost_dimension_of_the_mesh():
    layout = mesh_layout(8, tp_size=2, pp_size=2)
    assert layout == MeshLayout(replicas=1, shards=2, tp=2, pp=2)
    assert layout.describe() == "2-way pipeline x 1 replica(s) x 2 shard(s) x 2 tensor-parallel"
    assert [layout.stage(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # both stages read the same
    with pytest.raises(ConfigError, match="pp_size 3 must divide the world size 8"):
        mesh_layout(8, pp_size=3)
    with pytest.raises(ConfigError, match="pp_size 2 with cp_size 2"):
        mesh_layout(8, cp_size=2, pp_size=2)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(parallel_mode="ddp"), "pp_size 2 needs parallel_mode fsdp"),
        (dict(train_type="dpo"), "pp_size 2 with train_type dpo"),
        (dict(grad_accum_steps=1), "pp_schedule 1f1b needs grad_accum_steps"),
        (dict(train_type="sft", packing=False), "pp_size 2 with --packing false"),
        (dict(neftune_alpha=5.0), "pp_size 2 with neftune_alpha: not supported with pipeline stages yet"),
        (dict(lora_r=4, quantize="nf4"), "pp_size 2 with quantize"),
        (dict(compile="default"), "pp_size 2 with compile"),
        (dict(fsdp_sync_each_micro_batch=True), "pp_size 2 with fsdp_sync_each_micro_batch"),
        (
            dict(pp_schedule="interleaved_1f1b", grad_accum_steps=5),
            "interleaved_1f1b runs grad_accum_steps 5 in 2 rounds",
        ),
        (dict(pp_stages_per_rank=2), "pp_stages_per_rank 2 with pp_schedule 1f1b, which runs one stage per rank"),
        (dict(pp_size=None, pp_stages_per_rank=2), "pp_stages_per_rank 2 needs pipeline stages: set --pp_size"),
        (dict(pp_schedule="looped_bfs", pp_stages_per_rank=0), "pp_stages_per_rank must be positive, got 0"),
    ],
)
def test_flags_a_pipeline_cannot_take_are_refused(flags, message):
    values = dict(train_type="seq", parallel_mode="fsdp", pp_size=2, grad_accum_steps=2) | flags
    with pytest.raises(ConfigError, match=message):
        TrainArgs(**values).validate()


def test_a_stage_keeps_its_blocks_under_their_whole_model_names():
    torch.manual_seed(0)
    whole = AutoRegressiveLM(tiny_config(num_hidden_layers=4))
    names = list(whole.state_dict())
    first = keep_stages(AutoRegressiveLM(tiny_config(num_hidden_layers=4)), 0, 2)
    last = keep_stages(AutoRegressiveLM(tiny_config(num_hidden_layers=4)), 1, 2)
    assert [i for i, _ in first.numbered_blocks()] == [0, 1] and [i for i, _ in last.numbered_blocks()] == [2, 3]
    # Between them the whole model's tensors; the last stage's tied head is its own copy, read from the embedding.
    assert set(first.state_dict()) | set(last.state_dict()) == set(names) | {"lm_head.weight"}
    assert set(held_by_other_stages(last)) == set(names) - set(last.state_dict())
    assert "embed_tokens.weight" in held_by_other_stages(last)


def test_the_footprint_plans_the_fullest_stage():
    from test_footprint import workload

    from astrai_fabric.footprint import Layout, footprint

    config = tiny_config(num_hidden_layers=4, vocab_size=64)
    layout = Layout("fsdp", mesh_layout(2, pp_size=2), ranks_per_node=2)  # 2 stages of one rank each
    stage_bytes = []
    for index in range(2):
        stage = keep_stages(AutoRegressiveLM(config), index, 2)
        stage_bytes.append(sum(p.numel() for p in stage.parameters()) * 4)  # a tied head's copy counted: it is held
    planned = [footprint(config, layout, workload(grad_accum_steps=8, pp_schedule=kind)) for kind in ("gpipe", "1f1b")]
    for found in planned:
        assert found.parameters == stage_bytes[found.stage]  # the stage's own tensors, to the byte
    gpipe, one_f_one_b = planned
    assert gpipe.micro_batches_held == 8 and one_f_one_b.micro_batches_held in (1, 2)  # 1F1B: the stages after it
    assert one_f_one_b.total < gpipe.total
    sends = next(c for c in gpipe.collectives if c.name == "PP send")
    # Each micro-batch: the hidden states forward (and the int64 targets), or their gradient back: one neighbour.
    hidden = 2 * 32 * config.hidden_size * 4
    assert sends.handed_bytes in (8 * (hidden + 2 * 32 * 8), 8 * hidden) and sends.link_bytes == sends.handed_bytes


def test_the_footprint_plans_a_rank_of_several_stages():
    from test_footprint import workload

    from astrai_fabric.footprint import Layout, footprint, stage_footprint

    config = tiny_config(num_hidden_layers=4, vocab_size=64)
    layout = Layout("fsdp", mesh_layout(2, pp_size=2), ranks_per_node=2)
    rank_bytes = [
        sum(p.numel() for p in keep_stages(AutoRegressiveLM(config), r, 2, 2).parameters()) * 4 for r in (0, 1)
    ]
    plans = {
        kind: workload(grad_accum_steps=8, pp_schedule=kind, pp_stages_per_rank=2)
        for kind in ("interleaved_1f1b", "looped_bfs")
    }
    stages = stage_layers(config, 2, 2)
    for kind, work in plans.items():
        found = footprint(config, layout, work)
        assert found.parameters == rank_bytes[found.stage]  # the rank's stages' tensors, to the byte
        ranks = [stage_footprint(config, layout, work, stages, rank) for rank in (0, 1)]
        assert [r.parameters for r in ranks] == rank_bytes
        if kind == "looped_bfs":  # every micro-batch of both stages before the backwards
            assert [r.micro_batches_held for r in ranks] == [16, 16]
        else:  # torch's warm-up on 2 ranks of 2 stages, rounds of 2 micro-batches: 2 + 2 forwards on rank 0, 2 on 1
            assert [r.micro_batches_held for r in ranks] == [5, 3]
    assert (
        footprint(config, layout, plans["interleaved_1f1b"]).total
        < footprint(config, layout, plans["looped_bfs"]).total
    )


# --- 2 and 4 ranks against one process ------------------------------------------------------------------------------

PP2 = dict(parallel_mode="fsdp", pp_size=2)
TWO_RANK_RUNS = {
    # GPipe, AdamW, the fused head (CPU's default) on seq's windows; the sharded state (torch distributed
    # checkpoint) at step 2, to resume.
    # Validated at every step (3 batches: a group of 2 micro-batches, then one filled with one weighing 0).
    "pp2_seq": dict(
        PP2, pp_schedule="gpipe", optimizer="adamw", sharded_checkpoint=True, ckpt_interval=2, val_split=0.0013,
        val_step=1,
    ),
    # 1F1B, Muon, sft's packed documents through the logits path, each block recomputed in the backward pass, a
    # checkpoint at step 2 to resume in one process.
    "pp2_sft": dict(
        PP2, train_type="sft", data_root_path="bundled:data/sft", optimizer="muon_adamw", loss_chunk_size=0,
        gradient_checkpointing=True, ckpt_interval=2,
    ),
    # LoRA on every block's attention, the frozen base from weights (each rank reading its blocks), the merged
    # model written too; interleaved 1F1B over 2 stages per rank (4 stages of one block each), validated at every
    # step through its forward-only schedule.
    "pp2_lora": dict(
        PP2, pp_schedule="interleaved_1f1b", optimizer="adamw", lora_r=4, lora_alpha=8, lora_save_full=True,
        val_split=0.0013, val_step=1,
    ),
}  # fmt: skip
RESUMED_RUNS = {  # step 3 again, from each run's step 2 at the same layout: optimizer.pt, then the sharded state
    f"{name}_resumed": (name, dict(TWO_RANK_RUNS[name], max_steps=3)) for name in ("pp2_sft", "pp2_seq")
}
FOUR_RANK_RUNS = {  # 2 stages x: FSDP 2 (seq, sft), HSDP's 2 replicas of 1 shard (sft), tensor parallel 2 (seq)
    "pp2_fsdp2_seq": dict(TWO_RANK_RUNS["pp2_seq"], batch_per_device=1),
    # Looped BFS: 2 stages per rank, each its own FSDP root over the rank's 2 shards.
    "pp2_fsdp2_sft": dict(TWO_RANK_RUNS["pp2_sft"], batch_per_device=1, pp_schedule="looped_bfs"),
    "pp2_hsdp2_sft": dict(TWO_RANK_RUNS["pp2_sft"], batch_per_device=1, fsdp_shard_size=1),
    # Muon over the tensor-parallel shards (its whole-matrix step on the owner rank), as test_training_distributed's.
    "pp2_tp2_seq": dict(TWO_RANK_RUNS["pp2_seq"], tp_size=2, optimizer="muon_adamw"),
}


def _reference(name: str) -> dict:
    """The one-process flags of a pipeline run: the same samples per step on one rank. Its stages' data ranks (2
    with FSDP or HSDP inside 4 ranks) read 1 sample each where one process reads 2; tensor parallelism's ranks read
    the same samples."""
    layout = ("pp_size", "pp_schedule", "pp_stages_per_rank", "sharded_checkpoint", "tp_size", "fsdp_shard_size")
    flags = {k: v for k, v in (TWO_RANK_RUNS | FOUR_RANK_RUNS)[name].items() if k not in layout}
    if name.startswith(("pp2_fsdp2", "pp2_hsdp2")):
        # sft's loss is a token mean per micro-batch: 2 data ranks x 1 sample x 2 = 1 x 1 sample x 4 micro-batches;
        # seq's a mean over equal windows: 2 x 1 x 2 = 1 x 2 x 2
        sft = flags.get("train_type") == "sft"
        flags |= dict(batch_per_device=1, grad_accum_steps=4) if sft else dict(batch_per_device=2)
    return flags | dict(parallel_mode="none")


def _with_base(flags: dict, root: Path) -> dict:
    """A LoRA run's flags with its base: weights written by the fixture (``test_lora.make_base``)."""
    return flags | (dict(param_path=str(root / "base")) if flags.get("lora_r") else {})


def pipeline_worker(root: str, names: list[str], world_size: int) -> None:
    for name in names:
        if name in RESUMED_RUNS:
            source, flags = RESUMED_RUNS[name]
            flags = dict(flags, resume=str(Path(root) / source / "epoch_0_step_2"))
        else:
            flags = (TWO_RANK_RUNS | FOUR_RANK_RUNS)[name]
        run(base_args(Path(root) / name, nprocs=world_size, **_with_base(flags, Path(root))))


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    make_base(root / "base")
    run_ranks(pipeline_worker, 2, str(root), [*TWO_RANK_RUNS, *RESUMED_RUNS], 2)
    run_ranks(pipeline_worker, 4, str(root), list(FOUR_RANK_RUNS), 4)
    return root


def _history(ckpt_dir) -> list[dict]:
    """Each step's record, with its validation's loss when it has one."""
    lines = (ckpt_dir / "epoch_0_step_3" / "metric.jsonl").read_text().splitlines()
    records = list(map(json.loads, lines))
    validations = {r["step"]: r["val_loss"] for r in records if r["type"] == "validation"}
    steps = [r for r in records if r["type"] == "step"]
    return [r | ({"val_loss": validations[r["step"]]} if r["step"] in validations else {}) for r in steps]


def _weights(ckpt_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(ckpt_dir / f"epoch_0_step_{step}" / "model.safetensors")


@pytest.mark.parametrize("name", ["pp2_sft", "pp2_fsdp2_sft"])
def test_a_pipeline_records_the_whole_models_counts(pipeline_runs, name):
    """Each rank holds a stage's blocks: the parameters and optimizer state the run records (metric.jsonl) are still
    the whole model's, as its checkpoint's weights and optimizer.pt hold them (test_training_distributed's, for the
    other layouts)."""
    last = pipeline_runs / name / "epoch_0_step_3"
    entries = [json.loads(line) for line in (last / "metric.jsonl").read_text().splitlines()]
    (counts,) = [e for e in entries if e["type"] == "parameters"]
    stored = sum(t.numel() for t in load_file(last / "model.safetensors").values())
    assert counts["total_parameters"] == counts["trainable_parameters"] == stored
    assert counts["optimizer_state_bytes"] == stored_state_bytes(last / "optimizer.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", [*TWO_RANK_RUNS, *FOUR_RANK_RUNS])
def test_a_pipeline_trains_what_one_process_trains(pipeline_runs, tmp_path, name):
    one = base_args(tmp_path, **_with_base(_reference(name), pipeline_runs))
    reference = run(one)
    staged = _weights(pipeline_runs / name, 3)
    expected = _weights(tmp_path, 3)
    assert list(staged) == list(expected)  # one process's file: the same names in the same order
    assert_same_training(staged, expected, initial_weights(one))
    records = _history(pipeline_runs / name)
    assert len(records) == len(reference) == 3
    for got, want in zip(records, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        # torch's float32 norms on CPU carry ~1e-5 relative error, differently per layout (as test_training_distributed)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5e-5)
        assert got["grad_snr"] == pytest.approx(want["grad_snr"], rel=1e-4)
        if name in TWO_RANK_RUNS and "val_loss" in want:  # the same validation batches as one process
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    assert ("val_loss" in records[0]) == ("val_split" in (TWO_RANK_RUNS | FOUR_RANK_RUNS)[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED_RUNS))
def test_a_pipeline_resumes_exactly_at_its_own_layout(pipeline_runs, name):
    source = RESUMED_RUNS[name][0]
    resumed, continuous = _weights(pipeline_runs / name, 3), _weights(pipeline_runs / source, 3)
    assert_bit_equal(resumed, continuous)
    assert not torch.equal(continuous["norm.weight"], _weights(pipeline_runs / source, 2)["norm.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2_sft", "pp2_seq", "pp2_fsdp2_sft"])
def test_a_pipelines_checkpoint_resumes_in_one_process(pipeline_runs, tmp_path, name):
    # Its optimizer.pt (sft; looped stages on 4 ranks too, their blocks interleaved) or sharded state (seq) is one
    # process's whole state: the last step taken from it in one process is the pipeline's.
    staged = pipeline_runs / name
    run(base_args(tmp_path, **_reference(name), resume=str(staged / "epoch_0_step_2")))
    assert_same_training(_weights(tmp_path, 3), _weights(staged, 3), _weights(staged, 2))


@pytest.mark.slow
def test_every_command_reads_what_a_pipeline_writes(pipeline_runs, tmp_path, capsys):
    # The looped stages' checkpoint (4 ranks, each rank's blocks interleaved with the other's) is one process's:
    # export writes Hugging Face's files from it, generate reads those, evaluate reads the checkpoint.
    from astrai_fabric.cli import main

    checkpoint = pipeline_runs / "pp2_fsdp2_sft" / "epoch_0_step_3"
    assert main(["export", str(checkpoint), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    argv = ["generate", "--param_path", str(tmp_path / "hf"), "--chat", "false", "--prompt", "In the"]
    assert main([*argv, "--max_new_tokens", "2", "--temperature", "0"]) == 0
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} of a few words, read back"}) + "\n" for i in range(4)))
    flags = ["--data_root_path", str(text), "--window_size", "8", "--output", str(tmp_path / "eval.json")]
    assert main(["evaluate", str(checkpoint), *flags]) == 0
    metrics = json.loads((tmp_path / "eval.json").read_text())["results"][0]["metrics"]
    assert metrics["tokens"] > 0 and 1 < metrics["perplexity"] < float("inf")
    capsys.readouterr()


# --- the command line ----------------------------------------------------------------------------------------------

TINY_SEQ = ["seq", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/seq", "--window_size", "32"]


def test_the_dry_run_prints_the_stages_and_plans_the_fullest(tmp_path, capsys):
    from astrai_fabric.cli import main

    flags = ["--nprocs", "8", "--parallel_mode", "fsdp", "--pp_size", "2", "--grad_accum_steps", "4"]
    assert main([*TINY_SEQ, *flags, "--ckpt_dir", str(tmp_path / "out"), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "parallel_mode fsdp (2-way pipeline x 1 replica(s) x 4 shard(s))" in out
    assert "pipeline     2 stages, 1f1b over 4 micro-batches per step" in out
    assert "stage 0: layers 0-1 (+ embedding); stage 1: layers 2-3 (+ norm, head)" in out
    assert "4 rank(s) x 1 per device x 4 accumulation" in out  # 8 ranks, 4 of them data-parallel
    assert "the fullest)" in out and "PP send over 2" in out
    assert "muon         each matrix orthogonalised once, by one of 4 ranks" in out  # owners among a stage's ranks
    assert not (tmp_path / "out").exists()
    flags = ["--nprocs", "4", "--parallel_mode", "fsdp", "--pp_size", "2", "--pp_schedule", "interleaved_1f1b"]
    assert main([*TINY_SEQ, *flags, "--grad_accum_steps", "4", "--ckpt_dir", str(tmp_path / "out"), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "pipeline     4 stages on 2 ranks (2 each, looped), interleaved_1f1b over 4 micro-batches" in out
    assert "stage 2 (rank 0): layer 2;" in out and "pipeline rank 1 (stages 1, 3)'s ranks, the fullest)" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nprocs", "8", "--pp_size", "3", "--pp_schedule", "gpipe"], "pp_size 3 must divide the world size 8"),
        (["--nprocs", "8", "--pp_size", "8", "--pp_schedule", "gpipe"], "pp_size 8 exceeds the model's 4 decoder"),
        (["--nprocs", "2", "--pp_size", "2"], "pp_schedule 1f1b needs grad_accum_steps"),
        (
            ["--nprocs", "2", "--pp_size", "2", "--pp_schedule", "looped_bfs", "--pp_stages_per_rank", "4"],
            "pp_size 2 x pp_stages_per_rank 4 = 8 stages exceed the model's 4 decoder layers",
        ),
        (["--pp_stages_per_rank", "2"], "pp_stages_per_rank 2 needs pipeline stages: set --pp_size"),
    ],
)
def test_layouts_a_pipeline_cannot_run_exit_2_in_one_line(tmp_path, capsys, flags, message):
    from astrai_fabric.cli import main

    argv = [*TINY_SEQ, "--parallel_mode", "fsdp", "--grad_accum_steps", "1", *flags, "--ckpt_dir", str(tmp_path / "o")]
    for dry in (["--dry_run"], []):  # the dry run lists it; the run refuses before it launches or writes
        if not dry and "exceed" in message:
            continue  # the run meets the model's layers in its ranks' preflight: 8 processes here for one line
        assert main([*argv, *dry]) == 2
        captured = capsys.readouterr()
        assert message in captured.out + captured.err
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["generate", "chat", "evaluate"])
def test_commands_that_train_nothing_refuse_pp_size_in_one_line(command, capsys):
    from astrai_fabric.cli import main

    assert main([command, "bundled:tiny", "--pp_size", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown flag --pp_size" in err and "Traceback" not in err
