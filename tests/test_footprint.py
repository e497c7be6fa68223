"""The footprint (``astrai_fabric/footprint/``) against what runs here, in one process.

References: the parameters of the built model, grouped by name; the bytes of every tensor autograd saves in a real
forward and loss (``saved_tensors_hooks``, each storage once, the parameters left out), with the logits; the
tensors a real optimizer step leaves in the optimizer's state. The multi-rank figures (gathered parameters, the
bytes through each collective) are measured by ``bench/footprint.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from astrai_fabric.config.devices import DEVICES, parse_device_memory
from astrai_fabric.errors import ConfigError
from astrai_fabric.footprint import (
    Layout,
    Workload,
    activation_bytes,
    block_halves_saved,
    footprint,
    model_state_bytes,
)
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.model.transformer import parameter_counts
from astrai_fabric.optim import OptimArgs, build_optimizer
from astrai_fabric.parallel.mesh import MeshLayout, mesh_layout

SHAPE = dict(hidden_size=64, intermediate_size=96, vocab_size=200, max_position_embeddings=64, num_hidden_layers=2)
MOE = dict(ffn_type="moe", n_routed_experts=4, n_activated_experts=2, n_shared_experts=1, moe_intermediate_size=32)
CONFIGS = {
    "gqa": dict(),
    "one_kv_head": dict(num_key_value_heads=1),
    "qk_norm": dict(use_qk_norm=True),
    "sandwich": dict(norm_placement="sandwich", tie_word_embeddings=False),
    "moe": MOE,
    "mla": dict(attn_type="mla", kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=12, mla_shared_rope_key=True),
}  # fmt: skip
ONE_PROCESS = Layout("none", MeshLayout(1, 1), ranks_per_node=1)


def workload(**overrides) -> Workload:
    values = dict(
        sequences_per_micro_batch=2,
        window=32,
        grad_accum_steps=1,
        param_bytes=4,
        compute_bytes=4,
        gather_bytes=4,
        reduce_bytes=4,
        optimizer="adamw",
    )
    return Workload(**values | overrides)


def build(name: str, layers: int = 2) -> AutoRegressiveLM:
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config(**SHAPE | CONFIGS[name] | dict(num_hidden_layers=layers))).train()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_counts_split_the_built_models_parameters_by_role(name):
    model = build(name)
    counts = parameter_counts(model.config)
    found = dict.fromkeys(("embeddings", "attention", "dense_mlp", "routed_experts", "moe_other", "norms"), 0)
    for key, param in model.named_parameters():
        if key.startswith(("embed_tokens", "lm_head", "score")):
            role = "embeddings"
        elif ".attention." in key:
            role = "attention"
        elif ".routed_experts." in key:
            role = "routed_experts"
        elif ".mlp." in key:
            role = "moe_other" if model.config.num_moe_layers else "dense_mlp"
        else:
            role = "norms"
        found[role] += param.numel()
    assert counts.__dict__ == found


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_matrices_are_the_matrices_muon_updates(name):
    """The shapes the footprint gives Muon's owners (``block_matrices``) are the built model's Muon matrices, as a
    multiset: the owners, chosen from shapes alone, are then the run's (``muon_owners.assign_owners``)."""
    from astrai_fabric.footprint import block_matrices
    from astrai_fabric.optim import optimizer_groups

    model = build(name)
    (muon, _) = optimizer_groups(model, OptimArgs("muon_adamw"))
    assert sorted(block_matrices(model.config)) == sorted(tuple(p.shape) for p in muon.params)


def trunk_saved_bytes(model: AutoRegressiveLM, ids: torch.Tensor) -> int:
    """Bytes of every storage autograd saves in the trunk's forward (every block and the final norm), each once,
    the parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.trunk(ids)
    return sum(saved.values())


IDS = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_activations_are_what_autograd_saves_within_ten_percent(name):
    model = build(name)
    activations, _ = activation_bytes(model.config, ONE_PROCESS, workload())
    assert activations == pytest.approx(trunk_saved_bytes(model, IDS[:, :-1]), rel=0.10)


@pytest.mark.parametrize("name", ["gqa", "one_kv_head", "qk_norm"])
def test_one_blocks_saved_elements_are_exactly_what_autograd_saves(name):
    """One dense decoder block (``block_halves_saved``: its norms, attention's query, keys, values, output and the
    log-sum-exp SDPA saves per head, q/k norms' inputs, outputs and 1 / rms per head, the MLP's four) against what
    autograd saves for it: the trunk of two blocks less the trunk of one, to the byte."""
    one, two = build(name, layers=1), build(name, layers=2)
    measured = trunk_saved_bytes(two, IDS[:, :-1]) - trunk_saved_bytes(one, IDS[:, :-1])
    positions = IDS[:, :-1].numel()
    assert measured == sum(block_halves_saved(one.config, False)) * positions * 4


def test_a_plan_off_cpu_counts_keys_and_values_copied_per_query_head():
    # On CPU torch's kernel reads grouped heads as they are (model.attention.sdpa): the test above measures that. A
    # plan for CUDA, where the copies stay, counts every key/value head once per query head of its group.
    from astrai_fabric.config.train import TrainArgs
    from astrai_fabric.strategy import Topology
    from astrai_fabric.train.footprint_plan import plan_cluster

    config = build("gqa").config
    one = Topology(devices=1, num_nodes=1, launched_externally=False)
    plans = {}
    for device in ("cpu", "cuda"):
        args = TrainArgs(train_type="seq", parallel_mode="none", device_type=device)
        plans[device] = plan_cluster(args, config, 32, 0, one, "32-true")
    assert not plans["cpu"].workload.attention_copies_kv and plans["cuda"].workload.attention_copies_kv
    work = plans["cpu"].workload
    positions, per_position = (
        work.sequences_per_micro_batch * work.window,
        work.compute_bytes * config.attention_head_dim,
    )
    copies = config.num_hidden_layers * positions * 2 * (config.num_attention_heads - config.num_key_value_heads)
    assert plans["cuda"].footprint.activations - plans["cpu"].footprint.activations == copies * per_position


LORA_CASES = {
    "gqa_attention": ("gqa", ("q_proj", "k_proj", "v_proj", "o_proj"), 0.0),
    "gqa_all_dropout": ("gqa", ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down"), 0.05),
    "moe_all_dropout": ("moe", ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down"), 0.05),
    "sandwich_mlp": ("sandwich", ("up", "down"), 0.0),
    "mla_q_o": ("mla", ("q_proj", "o_proj"), 0.0),
}
"""LoRA's cases: (config, targets, dropout), on 6 layers (the first block saves less: nothing before the first
adapter takes a gradient, which the footprint counts only roughly)."""


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_activations_and_model_states(case):
    """Under LoRA a frozen weight's input is saved only where an adapter reads it: the activations within 10% of
    what autograd saves; the model states (frozen base, float32 adapters, their gradients and AdamW's two moments
    after a real step) to the byte, AdamW's one-element step counters apart (1%)."""
    from astrai_fabric import lora
    from astrai_fabric.footprint import Adapters

    name, targets, dropout = LORA_CASES[case]
    model = build(name, layers=6)
    lora.inject(model, lora.LoRASpec(4, 8, targets, dropout, "astrai"), 0)
    plan = workload(adapters=Adapters(4, targets, dropout > 0))
    activations, _ = activation_bytes(model.config, ONE_PROCESS, plan)
    assert activations == pytest.approx(trunk_saved_bytes(model, IDS[:, :-1]), rel=0.10)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, foreach=False)
    out = model(IDS[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), IDS[:, 1:].flatten())
    (loss if out.aux_loss is None else loss + 0.01 * out.aux_loss).backward()
    optimizer.step()
    parameters, gradients, state = model_state_bytes(model.config, parameter_counts(model.config), ONE_PROCESS, plan)
    assert parameters == sum(p.numel() * p.element_size() for p in model.parameters())
    assert gradients == sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    assert state == pytest.approx(
        sum(t.numel() * t.element_size() for t in tensors_in(optimizer.state_dict())), rel=0.01
    )


def test_qlora_quantises_the_weights_the_run_would():
    """QLoRA's 4-bit weights, counted from the config (``footprint.quantized_savings``), against the run's own plan
    over the built model (``quantize.plan_quantization``), alone and in FSDP shards."""
    from astrai_fabric.footprint import Adapters, quantized_savings
    from astrai_fabric.quantize import BYTES_PER_WEIGHT, plan_quantization

    config = tiny_config(**SHAPE | dict(hidden_size=256, intermediate_size=512, num_attention_heads=4))
    model = AutoRegressiveLM(config)
    qlora = Adapters(4, ("q_proj",), quantized=True)
    for shards in (1, 2, 4):
        planned = quantized_savings(config, qlora, shards, 4) / (4 - BYTES_PER_WEIGHT)
        assert planned == plan_quantization(model, shards).num_quantized > 0


@pytest.mark.parametrize("name", [*CONFIGS, "gqa_checkpointed"])
def test_the_peak_is_what_torchs_memory_tracker_finds_within_ten_percent(name):
    """The second of two AdamW steps, in one process, under torch's ``MemTracker`` (every storage followed through
    the dispatcher): its peak against the footprint's total (bench/footprint.py does this at 1, 2 and 4 ranks)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = build(name.removesuffix("_checkpointed"))
    model.gradient_checkpointing = name.endswith("_checkpointed")
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)

    def step() -> None:
        out = model(IDS[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), IDS[:, 1:].flatten())
        (loss if out.aux_loss is None else loss + 0.01 * out.aux_loss).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    planned = footprint(model.config, ONE_PROCESS, workload(gradient_checkpointing=model.gradient_checkpointing))
    assert planned.total == pytest.approx(sum(v for k, v in measured.items() if str(k) == "Total"), rel=0.10)


@pytest.mark.parametrize("optimizer", ["adamw", "muon_adamw"])
def test_model_states_are_what_a_step_leaves(optimizer):
    """One process: the parameters, their gradients and the optimizer's state after a real step, to 1% (AdamW
    keeps a one-element ``step`` per parameter that the footprint leaves out)."""
    model = build("moe")
    optimizer_object = build_optimizer(model, OptimArgs(optimizer, ns_dtype=torch.float32))
    ids = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(0))
    out = model(ids[:, :-1])
    (F.cross_entropy(out.logits.flatten(0, 1).float(), ids[:, 1:].flatten()) + 0.01 * out.aux_loss).backward()
    optimizer_object.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    state = sum(tensor.numel() * tensor.element_size() for tensor in tensors_in(optimizer_object.state_dict()))
    planned = model_state_bytes(
        model.config, parameter_counts(model.config), ONE_PROCESS, workload(optimizer=optimizer)
    )
    assert planned[:2] == (params, grads)
    assert planned[2] == pytest.approx(state, rel=0.01)


def test_adamws_step_on_cpu_holds_two_of_its_largest_tensor():
    """Over DTensor parameters (FSDP, tensor parallelism) torch's AdamW takes its per-tensor path on CPU, which has
    no foreach kernels, as it does over plain tensors unfused: measured here on what a 2-stage pipeline's last stage
    trains (the second block, the final norm and the untied head, the largest tensor), the step's own allocations
    beyond the state it keeps, against that stage's plan (the foreach path's count, one per entry of the largest
    group, was 12% low in bench/footprint.py's pipeline rows, which measure the same through FSDP)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = AutoRegressiveLM(tiny_config(**SHAPE | dict(tie_word_embeddings=False))).train()
    last_stage = [p for name, p in model.named_parameters() if not name.startswith(("embed", "layers.0."))]
    optimizer = torch.optim.AdamW(last_stage, foreach=False)
    for parameter in last_stage:
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()  # the state, made once
    tracker = MemTracker()
    tracker.track_external(*last_stage, optimizer)
    with tracker:
        optimizer.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    temporaries = next(v for k, v in peak.items() if str(k).endswith("OPT")) - sum(
        t.numel() * t.element_size() for t in tensors_in(optimizer.state_dict()["state"])
    )
    pipeline = Layout("fsdp", mesh_layout(2, pp_size=2), ranks_per_node=2)
    planned = footprint(model.config, pipeline, workload(pp_schedule="gpipe"))
    # Within 1%: torch's loop still holds the tensor before the head's denominator (a norm's, 256 bytes here).
    assert planned.stage == 1 and planned.step_temporaries == 2 * model.lm_head.weight.numel() * 4
    assert planned.step_temporaries == pytest.approx(temporaries, rel=0.01)


def tensors_in(value: object) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state dict (a composite's parts nest theirs), each step counter included."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in tensors_in(item)]
    if isinstance(value, list | tuple):
        return [tensor for item in value for tensor in tensors_in(item)]
    return []


def test_sharding_divides_the_model_states_and_the_plan_names_each_collective():
    config = tiny_config(**SHAPE | MOE)
    fsdp = Layout("fsdp", MeshLayout(replicas=2, shards=4, cp=2), ranks_per_node=8)
    whole = footprint(config, ONE_PROCESS, workload())
    sharded = footprint(config, fsdp, workload(grad_accum_steps=2))
    assert sharded.parameters == pytest.approx(whole.parameters / 8, rel=1e-6)  # over 4 shards x 2 context
    assert sharded.activations < whole.activations / 1.9  # half the positions
    names = {c.name: c for c in sharded.collectives}
    assert list(names) == [
        "FSDP all-gather",
        "FSDP reduce-scatter",
        "HSDP all-reduce",
        "CP all-to-all",
        "CP all-gather (logits)",
        "CP all-reduce (logits' gradient)",
    ]
    total = parameter_counts(config).total * 4
    assert names["FSDP all-gather"].handed_bytes == 2 * total  # gathered once per micro-batch, whole
    assert names["FSDP reduce-scatter"].handed_bytes == total  # reduced once per step (gated)
    assert names["FSDP all-gather"].link == "intra-node" and names["HSDP all-reduce"].link == "inter-node"
    assert names["FSDP all-gather"].link_bytes == int(2 * total * 7 / 8)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("141GiB", 141 * 2**30), ("80GB", 80 * 10**9), ("80 gb", 80 * 10**9), ("1.5TiB", int(1.5 * 2**40)),
     ("h100", DEVICES["h100"]), ("H200", DEVICES["h200"])],
)  # fmt: skip
def test_device_memory_reads_units_and_device_names(value, expected):
    assert parse_device_memory(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [("80", "expected an amount with a unit"), ("0GiB", "is not a device's memory"),
     ("-8GiB", "is not a device's memory"), ("100TiB", "is not a device's memory"),
     ("h1000", "h100, h200"), ("nanGiB", "expected an amount")],
)  # fmt: skip
def test_bad_device_memory_is_one_line(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_device_memory(value)


# --- the command line ---------------------------------------------------------------------------------------------

TINY_SFT = ["sft", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/sft", "--window_size", "64"]


def test_the_dry_run_plans_a_64_rank_cluster_with_context_parallelism_on_this_machine(tmp_path, capsys):
    """CUDA devices this machine lacks, 8 nodes of 8: the plan's memory per rank against each device's and each
    collective's bytes per step, on the link its group crosses; nothing is written."""
    from astrai_fabric.cli import main

    flags = [
        "--device_type",
        "cuda",
        "--nprocs",
        "8",
        "--num_nodes",
        "8",
        "--parallel_mode",
        "fsdp",
        "--cp_size",
        "2",
        "--fsdp_shard_size",
        "4",
        "--device_memory",
        "80GB",
    ]
    assert main([*TINY_SFT, *flags, "--ckpt_dir", str(tmp_path / "out"), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "64 (8 per node x 8 node(s)), parallel_mode fsdp (8 replica(s) x 4 shard(s) x 2 context" in out
    assert "of 74.5 GiB per device: fits" in out  # 80 GB = 80 x 10^9 bytes
    assert "largest micro-batch that fits: --batch_per_device" in out
    assert "FSDP all-gather over 8:" in out and "on intra-node links" in out  # 4 shards x 2 context: one node
    assert "HSDP all-reduce over 8:" in out and "on inter-node links" in out
    assert "CP all-to-all over 2:" in out
    assert not (tmp_path / "out").exists()


def config_only_model(directory: Path) -> Path:
    """A 97M-parameter model's directory: its config.json alone (a run initialises it; a dry run builds nothing)."""
    directory.mkdir()
    config = tiny_config(
        vocab_size=2048,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    return directory


def test_a_run_whose_model_states_alone_exceed_the_device_is_refused(tmp_path, capsys):
    """A 97M-parameter model under AdamW in float32 (parameters, gradients and two moments: 16 bytes each, 1.45 GiB)
    on a device said to hold 1 GiB is refused before anything is built or written; on 1.4 GiB, where only the whole
    estimate is over, the plan says it does not fit and what to change, and the run may start."""
    from astrai_fabric.cli import main

    model = config_only_model(tmp_path / "model")
    args = [
        "seq",
        "--param_path",
        str(model),
        "--tokenizer_path",
        "bundled:tiny",
        "--data_root_path",
        "bundled:data/seq",
        "--window_size",
        "64",
        "--optimizer",
        "adamw",
        "--device_type",
        "cuda",
        "--precision",
        "32-true",
        "--batch_per_device",
        "64",
        "--ckpt_dir",
        str(tmp_path / "out"),
        "--dry_run",
    ]
    assert main([*args, "--device_memory", "1GiB"]) == 2
    out = capsys.readouterr().out
    assert "parameters, gradients and optimizer state alone take 1.4 GiB per rank in this layout" in out
    assert main([*args, "--device_memory", "1.6GiB"]) == 0
    out = capsys.readouterr().out
    assert "of 1.6 GiB per device: DOES NOT FIT" in out and "to fit, try: --gradient_checkpointing true" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [("80", "expected an amount with a unit"), ("h1000", "or a device name: h100, h200")],
)
def test_a_bad_device_memory_flag_is_one_line_and_exit_2(tmp_path, capsys, value, message):
    from astrai_fabric.cli import main

    code = main([*TINY_SFT, "--ckpt_dir", str(tmp_path / "out"), "--device_memory", value, "--dry_run"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_a_run_over_only_by_the_whole_estimate_starts_with_a_warning(tmp_path):
    """The preflight of a real run (not a dry one) whose model states fit each device and whose whole estimate does
    not: a warning naming both figures, no problem (an estimate that runs high must never stop a run that fits)."""
    from astrai_fabric.config.train import TrainArgs
    from astrai_fabric.train.checks import Placement, preflight
    from astrai_fabric.train.plan import step_plan
    from astrai_fabric.train.start import read_start

    model = config_only_model(tmp_path / "model")
    args = TrainArgs(
        train_type="seq",
        param_path=str(model),
        tokenizer_path="bundled:tiny",
        window_size=64,
        data_root_path="bundled:data/seq",
        optimizer="adamw",
        device_type="cpu",
        precision="32-true",
        batch_per_device=64,
        device_memory="1.6GiB",
        ckpt_dir=str(tmp_path / "out"),
    )
    args.validate()
    start = read_start(args)
    with pytest.warns(
        UserWarning, match=r"the footprint estimate, [\d.]+ GiB per rank, is over each device's 1\.6 GiB"
    ):
        problems = preflight(args, start, step_plan(args, 640, 1), Placement("cpu", "32-true", 1, 1, 1))
    assert problems == []


def test_a_window_past_the_models_positions_still_gets_its_memory_planned(tmp_path, capsys):
    """A refused --window_size (past max_position_embeddings, 256 here) is listed, and the plan's memory and comms
    are made at the model's longest window, which the list names (before, the plan had none)."""
    from astrai_fabric.cli import main

    argv = ["sft", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/sft", "--window_size", "300"]
    argv += ["--device_type", "cuda", "--device_memory", "h100", "--nprocs", "8", "--parallel_mode", "fsdp"]
    assert main([*argv, "--ckpt_dir", str(tmp_path / "out"), "--dry_run"]) == 2
    out = capsys.readouterr().out
    assert "window_size 300 exceeds max_position_embeddings 256" in out
    assert "(the plan above is for --window_size 256, its longest)" in out
    assert "  memory       per rank at its peak" in out and "  comms        FSDP" in out
    assert "1 x 256 positions" in out and not (tmp_path / "out").exists()


def test_grpo_plans_each_prompts_group_and_says_what_it_leaves_out(tmp_path, capsys):
    """A GRPO micro-batch runs ``--group_size`` responses per prompt: groups of 2 and 8 plan 2 and 8 sequences;
    the frozen reference model is named as not counted (dpo's reference-free losses hold none)."""
    from astrai_fabric.cli import main

    argv = ["grpo", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/grpo", "--window_size", "64"]
    argv += ["--device_type", "cuda", "--device_memory", "h100", "--ckpt_dir", str(tmp_path / "out"), "--dry_run"]
    for group in (2, 8):
        assert main([*argv, "--group_size", str(group)]) == 0
        out = capsys.readouterr().out
        assert f"({group} x 64 positions, checkpointing off)" in out
        assert "not counted: the frozen reference model (the weights once more" in out
    dpo = ["dpo", "--param_path", "bundled:tiny", "--data_root_path", "bundled:data/dpo", "--window_size", "64"]
    assert main([*dpo, *argv[7:], "--dpo_loss", "simpo"]) == 0
    assert "not counted" not in capsys.readouterr().out


TP_CASES = {"gqa": dict(), "gated_attention": dict(use_gated_attention=True), "moe": MOE, "mla": CONFIGS["mla"]}
"""The tensor-parallel cases: each kind of column-parallel linear (q, k, v, the attention gate; MLA's; an MoE layer's
experts whole) and row-parallel output."""


def tp_all_reduce_worker(out: str) -> None:
    """One of 2 tensor-parallel ranks: each case's model, through ``parallelize``, a forward and backward (and one
    with each block recomputed), the activation-sized all-reduces counted where every collective passes, torch's
    dispatcher (``_c10d_functional`` and ``c10d`` ops)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from astrai_fabric.parallel.parallelize import parallelize

    class AllReduces(TorchDispatchMode):
        """Elements handed to all-reduces, the step's scalars (the loss's) left out."""

        def __init__(self) -> None:
            super().__init__()
            self.elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if "all_reduce" in str(func) or "allreduce" in str(func):
                tensors = args[0] if isinstance(args[0], list | tuple) else [args[0]]
                self.elements += sum(t.numel() for t in tensors if t.numel() > 1)
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo")
    counts = {}
    ids = IDS[:, :-1]
    for name, extra in TP_CASES.items():
        for checkpointing in (False, True):
            torch.manual_seed(0)
            model = AutoRegressiveLM(tiny_config(**SHAPE | extra)).train()
            model.gradient_checkpointing = checkpointing
            mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
            model = parallelize(model, mesh)
            counter = AllReduces()
            with counter:
                output = model(ids)
                F.cross_entropy(output.logits.flatten(0, 1).float(), IDS[:, 1:].flatten()).backward()
            counts[f"{name}_{checkpointing}"] = counter.elements / ids.numel()  # per position
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(counts))
    dist.destroy_process_group()


def test_tensor_parallels_all_reduces_are_the_plans(tmp_path):
    """``tp_all_reduce_width``: the elements all-reduced per position of one micro-batch under tensor parallelism,
    counted on 2 real gloo ranks for each kind of layer, with and without recomputation (each block's forward again
    in the backward, stopping early)."""
    from spawn import run_ranks

    from astrai_fabric.footprint import tp_all_reduce_width

    run_ranks(tp_all_reduce_worker, 2, str(tmp_path / "counts.json"))
    counts = json.loads((tmp_path / "counts.json").read_text())
    planned = {
        f"{name}_{checkpointing}": tp_all_reduce_width(tiny_config(**SHAPE | extra), 2 if checkpointing else 1)
        for name, extra in TP_CASES.items()
        for checkpointing in (False, True)
    }
    assert counts == planned
