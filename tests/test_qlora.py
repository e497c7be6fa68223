"""QLoRA (``--quantize nf4``): LoRA adapters over a base whose block linear weights are torchao's NF4.

References: the same LoRA model over the dequantised base, i.e. the float weights torchao's
``NF4Tensor.get_original_weight()`` gives for the codes (float32, within 1e-5: the two compute the same products in
another order); torchao's ``to_nf4`` called here directly for what a checkpoint must load; transformers and PEFT
(their own forward) for the exports; the 1-process run for 2 DDP ranks and 2 FSDP ranks (the adapters' difference
against their update, tests/equality.py).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from equality import assert_same_training, initial_weights
from safetensors.torch import load_file
from spawn import run_ranks

from astrai_fabric import assets, lora, quantize
from astrai_fabric.checkpoint import load_model, read_model_config, save_checkpoint
from astrai_fabric.cli import main
from astrai_fabric.config import ModelConfig
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.errors import CheckpointError
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.train import run

nf4 = quantize._nf4()  # torchao's module: the oracle of what the codes stand for
SPEC = lora.LoRASpec(r=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "up"))
TARGETS = ["q_proj", "v_proj", "o_proj", "up"]


def tiny_config() -> ModelConfig:
    """The bundled tiny model's shape with two layers and an MLP of 256: q/o (128 x 128) and the MLP's three
    (256 x 128) fit NF4's 64 x 256 blocks; k/v (64 x 128, 2 KV heads) do not and stay float32."""
    raw = read_model_config(assets.resolve("bundled:tiny")).to_dict()
    return ModelConfig.from_dict({**raw, "intermediate_size": 256, "num_hidden_layers": 2})


def wide_config() -> ModelConfig:
    """Every block weight (256 x 256, and k/v 128 x 256 with 2 KV heads) splits into 2 FSDP shards of whole NF4
    blocks, so one process and 2 fsdp ranks quantise the same weights."""
    return ModelConfig.from_dict({**tiny_config().to_dict(), "hidden_size": 256, "num_attention_heads": 4})


def wide_moe_config() -> ModelConfig:
    """``wide_config`` with MoE layers: 4 routed experts (top-2) and a shared one, each projection 128 x 256, whole
    NF4 blocks in 2 FSDP shards as every other block weight."""
    moe = dict(ffn_type="moe", n_routed_experts=4, n_shared_experts=1, n_activated_experts=2, moe_intermediate_size=128)
    return ModelConfig.from_dict({**wide_config().to_dict(), **moe})


def quantized_pair(seed: int = 0) -> tuple[AutoRegressiveLM, AutoRegressiveLM, AutoRegressiveLM]:
    """(the float model, the same model with its base quantised, a float model holding the dequantised base), the
    two last with the same adapters, B random so the adapters change the output."""
    torch.manual_seed(seed)
    model = AutoRegressiveLM(tiny_config())
    quantized, dequantized = copy.deepcopy(model), copy.deepcopy(model)
    for key in quantize.plan_quantization(model).quantized:
        quantize.quantize_weight(quantized, key)
        dequantized.get_parameter(key).data.copy_(quantized.get_parameter(key).get_original_weight())
    for adapted in (quantized, dequantized):
        lora.inject(adapted, SPEC, seed=seed)
        for _, layer in lora.lora_layers(adapted):
            torch.nn.init.normal_(layer.lora_B, std=0.5, generator=torch.Generator().manual_seed(7))
    return model, quantized, dequantized


def test_the_plan_quantises_block_linears_that_fit_and_keeps_the_rest():
    plan = quantize.plan_quantization(AutoRegressiveLM(tiny_config()))
    parts = ["attention.q_proj", "attention.o_proj", "mlp.gate", "mlp.up", "mlp.down"]
    assert sorted(plan.quantized) == sorted(f"layers.{i}.{p}.weight" for i in range(2) for p in parts)
    assert sorted(plan.kept) == sorted(
        f"layers.{i}.attention.{p}.weight" for i in range(2) for p in ("k_proj", "v_proj")
    )
    moe_fields = dict(
        ffn_type="moe",
        n_routed_experts=4,
        n_shared_experts=1,
        n_activated_experts=2,
        moe_intermediate_size=128,
        shared_expert_gate=True,
    )
    moe = AutoRegressiveLM(ModelConfig.from_dict({**tiny_config().to_dict(), **moe_fields}))
    moe_plan = quantize.plan_quantization(moe)
    assert not any("router" in key or "shared_expert_gate" in key for key in (*moe_plan.quantized, *moe_plan.kept))
    assert any("routed_experts" in key for key in moe_plan.quantized)


def test_nf4_model_computes_the_lora_model_over_its_dequantised_base_through_four_steps():
    model, quantized, dequantized = quantized_pair()
    ids = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(3))
    # Quantised for real: the codes are 0.26 x bfloat16's bytes, and the base moved by NF4's rounding.
    num_bytes, num_elements = quantize.quantized_bytes(quantized)
    assert num_elements == sum(quantized.get_parameter(k).numel() for k in quantize.plan_quantization(model).quantized)
    assert num_bytes <= 0.3 * 2 * num_elements
    with torch.no_grad():
        assert (model(ids)["logits"] - dequantized(ids)["logits"]).abs().max() > 1e-2
    adapters = {
        name: [p for p in m.parameters() if p.requires_grad] for name, m in (("nf4", quantized), ("float", dequantized))
    }
    optimizers = {name: torch.optim.AdamW(params, lr=1e-2) for name, params in adapters.items()}
    initial = {str(i): p.detach().clone() for i, p in enumerate(adapters["float"])}
    for _ in range(4):
        losses, grads = {}, {}
        for name, m in (("nf4", quantized), ("float", dequantized)):
            logits = m(ids[:, :-1])["logits"]
            loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            optimizers[name].zero_grad()
            loss.backward()
            losses[name], grads[name] = loss.item(), [p.grad.clone() for p in adapters[name]]
            optimizers[name].step()
        assert losses["nf4"] == pytest.approx(losses["float"], abs=1e-5)
        for ours, reference in zip(grads["nf4"], grads["float"], strict=True):
            torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    trained = {name: {str(i): p.detach() for i, p in enumerate(params)} for name, params in adapters.items()}
    assert_same_training(trained["nf4"], trained["float"], initial)
    assert all(p.grad is None for p in quantized.parameters() if quantize.is_quantized(p))


def test_a_bf16_cast_keeps_the_4bit_codes_and_float32_adapters():
    """Fabric's ``bf16-true`` casts the module (``module.to``): torchao's NF4 parameter takes the cast as its
    dtype and keeps its codes; LoRA keeps its adapters float32."""
    _, quantized, _ = quantized_pair()
    codes = quantized.layers[0].attention.q_proj.weight.quantized_data.clone()
    quantized.to(torch.bfloat16)
    layer = quantized.layers[0].attention.q_proj
    assert quantize.is_quantized(layer.weight) and torch.equal(layer.weight.quantized_data, codes)
    assert layer.lora_A.dtype == torch.float32
    assert quantized.layers[0].attention.k_proj.weight.dtype == torch.bfloat16  # kept: cast as any weight is


# --- training runs -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The tiny model, seeded, as a Hugging Face directory (what PEFT needs as the adapter's base); beside it, the
    wider model of ``wide_config`` in our layout (``wide``)."""
    root = tmp_path_factory.mktemp("qlora")
    source = assets.resolve("bundled:tiny")
    torch.manual_seed(0)
    files = {name: source / name for name in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(root / "ours", AutoRegressiveLM(tiny_config()).state_dict(), tiny_config().to_dict(), files=files)
    assert main(["export", str(root / "ours"), "--format", "hf", "--out", str(root / "base")]) == 0
    save_checkpoint(root / "wide", AutoRegressiveLM(wide_config()).state_dict(), wide_config().to_dict(), files=files)
    moe = wide_moe_config()
    save_checkpoint(root / "wide_moe", AutoRegressiveLM(moe).state_dict(), moe.to_dict(), files=files)
    return root / "base"


def qlora_args(base: Path, name: str, **overrides) -> TrainArgs:
    values = dict(
        param_path=str(base),
        data_root_path="bundled:data/seq",
        train_type="seq",
        ckpt_dir=str(base.parent / name),
        window_size=32,
        batch_per_device=2,
        grad_accum_steps=2,
        max_steps=4,
        ckpt_interval=2,
        max_lr=2e-3,
        max_grad_norm=0.05,
        warmup_ratio=0.0,
        num_workers=0,
        parallel_mode="none",
        random_seed=5,
        lora_r=4,
        lora_targets=TARGETS,
        quantize="nf4",
        loggers=[],
    )
    values.update(overrides)
    return TrainArgs(**values)


MOE_RUN = dict(batch_per_device=1, max_steps=3, lora_targets=["q_proj", "up", "down"])
"""The MoE model's runs: adapters on attention and on every expert (routed and shared); 1-sample micro-batches, so
each rank's balance loss is the single process's of the same sample."""


def initial_adapter(runs: Path, reference_run: str) -> dict[str, torch.Tensor]:
    """The adapters a single-process reference run of ``runs`` (its name) started from (tests/equality.py)."""
    model, overrides = {"none": ("base", {}), "moe_none": ("wide_moe", MOE_RUN)}.get(reference_run, ("wide", {}))
    return initial_weights(qlora_args(runs / model, reference_run, **overrides))


def two_rank_worker(base: str) -> None:
    run(qlora_args(Path(base), "ddp", parallel_mode="ddp", nprocs=2, batch_per_device=1))
    # FSDP: each rank reads the whole 4-bit base, then Fabric shards it (torchao's NF4 tensor splits by rows)
    wide = Path(base).parent / "wide"
    run(qlora_args(wide, "wide_fsdp", parallel_mode="fsdp", nprocs=2, batch_per_device=1, max_steps=3))
    # Expert parallelism: each rank holds 2 of the 4 experts of each MoE layer, in 4 bits, and their adapters.
    run(qlora_args(Path(base).parent / "wide_moe", "moe_ep2", **MOE_RUN, parallel_mode="fsdp", ep_size=2, nprocs=2))
    # Context parallelism: each rank holds half of every window's positions; the FSDP shards (over the context
    # group) as under wide_fsdp. One data rank, so each takes the single process's batches; the MoE model's balance
    # loss and routing statistics are the whole window's (the group's sums).
    run(qlora_args(wide, "wide_cp2", parallel_mode="fsdp", cp_size=2, nprocs=2, max_steps=3))
    run(qlora_args(wide, "wide_lora_cp2", parallel_mode="fsdp", cp_size=2, nprocs=2, max_steps=3, quantize=None))
    cp2 = dict(MOE_RUN, grad_accum_steps=4, parallel_mode="fsdp", cp_size=2, nprocs=2)
    run(qlora_args(Path(base).parent / "wide_moe", "moe_cp2", **cp2))


@pytest.fixture(scope="module")
def runs(base) -> Path:
    history = run(qlora_args(base, "none"))
    (base.parent / "history.json").write_text(json.dumps(history))
    run(qlora_args(base.parent / "wide", "wide_none", max_steps=3))
    run(qlora_args(base.parent / "wide", "wide_lora_none", max_steps=3, quantize=None))  # LoRA over float32 weights
    run(qlora_args(base.parent / "wide_moe", "moe_none", **MOE_RUN, grad_accum_steps=4))
    run_ranks(two_rank_worker, 2, str(base))
    return base.parent


def step_dir(run_dir: Path, step: int) -> Path:
    (path,) = run_dir.glob(f"epoch_*_step_{step}")
    return path


def last_metrics(run_dir: Path) -> dict:
    """Step 3's entry (the memory entry its checkpoint adds comes after it)."""
    entries = [json.loads(line) for line in (step_dir(run_dir, 3) / "metric.jsonl").read_text().splitlines()]
    return [entry for entry in entries if entry["type"] == "step"][-1]


def expected_model_state(base: Path, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The trained model, from torchao's own functions: each quantised weight through ``to_nf4`` (64, 256) and back,
    then ``W + B A * alpha / r`` in float32."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    state = load_model(base).state_dict()
    for key in meta["quantization"]["keys"]:
        state[key] = nf4.to_nf4(state[key], 64, 256).get_original_weight()
    return lora.merge_state_dict(state, load_file(checkpoint / "adapter_model.safetensors"), 32 / 4)


def test_checkpoints_hold_the_adapter_and_load_as_it_merged_into_the_dequantised_base(runs, base):
    checkpoint = step_dir(runs / "none", 4)
    assert not (checkpoint / "model.safetensors").exists()  # adapters and the pointer to the base, as LoRA
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["quantize"] == "nf4"
    assert meta["quantization"] == {
        "method": "nf4",
        "block_size": 64,
        "scaler_block_size": 256,
        "dtype": "float32",
        "keys": list(quantize.plan_quantization(AutoRegressiveLM(tiny_config())).quantized),
    }
    expected = expected_model_state(base, checkpoint)
    loaded = load_model(checkpoint).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    float_base = load_model(base).state_dict()
    q_proj = "layers.0.attention.q_proj.weight"
    assert not torch.equal(
        loaded[q_proj],
        lora.merge_state_dict(float_base, load_file(checkpoint / "adapter_model.safetensors"), 8)[q_proj],
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": "int4"}, "'quantization' dtype must be one of"),
        ({"block_size": 32}, "'quantization' has block_size 32 (expected 64)"),
        ({"keys": ["layers.0.attention.k_proj.weight"]}, "'quantization' names weights NF4 cannot hold"),
        ({"keys": ["layers.9.mlp.up.weight"]}, "'quantization' names weights the base lacks"),
        ({"keys": "all"}, "'quantization' keys must be a list of '<layer>.weight' names"),
    ],
)
def test_a_damaged_quantization_record_is_one_error(runs, tmp_path, change, message):
    damaged = tmp_path / "damaged"
    shutil.copytree(step_dir(runs / "none", 4), damaged)
    meta = json.loads((damaged / "meta.json").read_text())
    meta["quantization"].update(change)
    meta["lora_base"]["path"] = None  # the copy sits elsewhere: found by its absolute path
    (damaged / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(damaged)


def test_resume_is_bit_exact(runs, base):
    history = run(qlora_args(base, "resumed", resume=str(step_dir(runs / "none", 2))))
    full = load_file(step_dir(runs / "none", 4) / "adapter_model.safetensors")
    resumed = load_file(step_dir(runs / "resumed", 4) / "adapter_model.safetensors")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    uninterrupted = json.loads((runs / "history.json").read_text())
    assert [h["loss"] for h in history] == [h["loss"] for h in uninterrupted[2:]]


@pytest.mark.parametrize(
    ("mode", "step"), [("ddp", 4), ("wide_fsdp", 3), ("wide_cp2", 3), ("moe_cp2", 3), ("wide_lora_cp2", 3)]
)
def test_two_ddp_fsdp_or_context_ranks_match_one_process(runs, mode, step):
    """QLoRA (and, under context parallelism, LoRA over float32 weights too) on 2 ranks against one process."""
    reference_run = {"ddp": "none", "moe_cp2": "moe_none", "wide_lora_cp2": "wide_lora_none"}.get(mode, "wide_none")
    ours, reference = (
        load_file(step_dir(runs / name, step) / "adapter_model.safetensors") for name in (mode, reference_run)
    )
    assert_same_training(ours, reference, initial_adapter(runs, reference_run))
    meta, reference_meta = (
        json.loads((step_dir(runs / n, step) / "meta.json").read_text()) for n in (mode, reference_run)
    )
    assert meta.get("quantization") == reference_meta.get("quantization")
    assert ("quantization" in meta) == (mode != "wide_lora_cp2")
    if mode in ("wide_fsdp", "wide_cp2"):  # every block weight in 4 bits, k and v too
        assert len(meta["quantization"]["keys"]) == 14
    if mode == "moe_cp2":  # the balance loss over the whole window: one process's
        ours, reference = last_metrics(runs / mode), last_metrics(runs / reference_run)
        for key in ("loss", "moe_aux_loss", "router_entropy", "load_imbalance_max"):
            assert ours[key] == pytest.approx(reference[key], abs=1e-6), key


def test_expert_parallel_qlora_matches_one_process_and_resumes_there(runs):
    """ep 2 on 2 ranks against one process taking the same samples one by one: the adapters trained alike (the
    losses to 1e-6), the quantization record naming every rank's experts as one process's does; the ep 2 checkpoint
    resumes on one process to the ep 2 run's adapters and loads as any QLoRA checkpoint."""
    ep2, one = (last_metrics(runs / name) for name in ("moe_ep2", "moe_none"))
    assert ep2["loss"] == pytest.approx(one["loss"], abs=1e-6)
    ours, reference = (load_file(step_dir(runs / n, 3) / "adapter_model.safetensors") for n in ("moe_ep2", "moe_none"))
    assert sorted(ours) == sorted(reference) and sum(".routed_experts." in key for key in ours) == 2 * 4 * 2 * 2
    assert_same_training(ours, reference, initial_adapter(runs, "moe_none"))
    record = json.loads((step_dir(runs / "moe_ep2", 3) / "meta.json").read_text())["quantization"]
    assert record == json.loads((step_dir(runs / "moe_none", 3) / "meta.json").read_text())["quantization"]
    assert sum(".routed_experts." in key for key in record["keys"]) == 2 * 4 * 3  # every expert's gate, up, down
    resumed = runs / "moe_resumed"
    args = dict(MOE_RUN, grad_accum_steps=4, resume=str(step_dir(runs / "moe_ep2", 2)))
    run(qlora_args(runs / "wide_moe", "moe_resumed", **args))
    again = load_file(step_dir(resumed, 3) / "adapter_model.safetensors")
    assert_same_training(again, ours, load_file(step_dir(runs / "moe_ep2", 2) / "adapter_model.safetensors"))
    assert load_model(step_dir(runs / "moe_ep2", 3)).config.n_routed_experts == 4


@torch.no_grad()
def test_exports_merge_into_the_dequantised_base_and_say_so(runs, base, capsys):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    checkpoint = step_dir(runs / "none", 4)
    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(1))
    ours = load_model(checkpoint).eval()(ids)["logits"]
    assert main(["export", str(checkpoint), "--merge_lora", "--out", str(runs / "merged")]) == 0
    assert "merged into the dequantised base" in capsys.readouterr().err
    assert all(
        torch.equal(v, load_model(runs / "merged").state_dict()[k])
        for k, v in load_model(checkpoint).state_dict().items()
    )
    assert main(["export", str(checkpoint), "--format", "hf", "--out", str(runs / "hf")]) == 0
    assert "merged into the dequantised base" in capsys.readouterr().err
    theirs = transformers.AutoModelForCausalLM.from_pretrained(runs / "hf", dtype=torch.float32).eval()
    assert (theirs(ids).logits - ours).abs().max() <= 1e-5
    # PEFT applies the adapter to the full-precision base: our LoRA merge over that base, not the trained model.
    assert main(["export", str(checkpoint), "--format", "peft", "--out", str(runs / "peft")]) == 0
    assert "PEFT applies it to the full-precision base" in capsys.readouterr().err
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(hf_base, runs / "peft").eval()(ids).logits
    over_float = AutoRegressiveLM(tiny_config())
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    over_float.load_state_dict(lora.merge_state_dict(load_model(base).state_dict(), adapter, 8))
    assert (adapted - over_float.eval()(ids)["logits"]).abs().max() <= 1e-5
    quantisation_error = (adapted - ours).abs().max().item()
    print(
        f"qlora: PEFT on the float base vs the trained model, max |logit diff| {quantisation_error:.3f}",
        file=sys.stderr,
    )
    assert quantisation_error > 1e-3


def test_dpo_and_grpo_reference_is_the_same_quantised_base(runs, base):
    """Step 1: B = 0, so the policy is its base: dpo's loss is log 2 and grpo's KL 0 only when the reference is
    that same NF4 base (the float base differs from it by NF4's rounding)."""
    common = dict(max_steps=1, ckpt_interval=1, batch_per_device=1, grad_accum_steps=1, window_size=64)
    history = run(qlora_args(base, "dpo", train_type="dpo", data_root_path="bundled:data/dpo", **common))
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    ours = base.parent / "ours"  # the same model in AstrAI's layout: quantised while loading as well
    history = run(qlora_args(ours, "grpo", train_type="grpo", data_root_path="bundled:data/grpo", **common))
    assert history[0]["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    meta = json.loads((step_dir(runs / "dpo", 1) / "meta.json").read_text())
    assert meta["reference"]["adapters_off"] is True and meta["quantization"]["method"] == "nf4"


def test_the_plan_names_the_4bit_base_and_what_fsdp_shards_keep(base, capsys):
    argv = [
        "sft",
        "--param_path",
        str(base),
        "--data_root_path",
        "bundled:data/sft",
        "--ckpt_dir",
        str(base.parent / "dry"),
        "--lora_r",
        "8",
        "--quantize",
        "nf4",
        "--dry_run",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "quantize     nf4 (torchao): 10 linear weights in 4 bits, 0.1 MiB instead of 1.0 MiB" in out
    assert "4 kept unquantised (element count not a multiple of 16,384): layers.0.attention.k_proj.weight" in out
    assert main([*argv, "--parallel_mode", "fsdp", "--nprocs", "2"]) == 0  # q and o (16,384 values) split in halves
    out = capsys.readouterr().out
    assert "quantize     nf4 (torchao): 6 linear weights in 4 bits" in out
    assert "8 kept unquantised (element count not a multiple of 16,384 x 2 FSDP shards)" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--quantize", "nf4"], "quantize nf4 needs lora_r > 0: a 4-bit base is frozen"),
        (["--quantize", "nf8", "--lora_r", "4"], "quantize"),
    ],
)
def test_bad_quantize_flags_are_one_line_exit_2(base, tmp_path, capsys, flags, message):
    argv = [
        "sft",
        "--param_path",
        str(base),
        "--data_root_path",
        "bundled:data/sft",
        "--ckpt_dir",
        str(tmp_path / "out"),
        "--num_workers",
        "0",
        *flags,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_torchao_is_imported_without_a_word_on_the_users_screen():
    """torchao's import logs a warning per CUDA kernel library it cannot load on a CPU build of torch."""
    code = "from astrai_fabric import quantize; quantize.require_torchao(); print('imported')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "imported\n" and done.stderr == "", done.stderr


def test_without_torchao_the_run_says_which_extra_to_install(base, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # an import of it (or of a submodule) now fails
    monkeypatch.setitem(sys.modules, quantize._NF4_MODULE, None)
    quantize._nf4.cache_clear()
    try:
        argv = [
            "sft",
            "--param_path",
            str(base),
            "--data_root_path",
            "bundled:data/sft",
            "--ckpt_dir",
            str(tmp_path / "out"),
            "--num_workers",
            "0",
            "--lora_r",
            "4",
            "--quantize",
            "nf4",
        ]
        assert main(argv) == 2
    finally:
        quantize._nf4.cache_clear()
    err = capsys.readouterr().err
    assert "install it with: pip install 'astrai-fabric[qlora]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
