"""LoRA: the adapter's math, frozen base weights on every strategy (one spawn of 2 gloo ranks runs ddp and fsdp),
2 ranks against 1 process, exact resume, adapter checkpoints pointing to their base, dpo/grpo with the reference
as the adapters-off network, and AstrAI's own inject_lora/load_lora/save_lora as the oracle.

References: the base model's own forward (exact), ``W + (B A) * alpha / r`` computed here in float32, the single
process run (2 ranks: the adapters' difference against their update, tests/equality.py), and AstrAI's LoRALinear
in its own interpreter (logits within 1e-5, float32).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from astrai_oracle import needs_astrai, run_astrai
from conftest import tiny_config
from equality import assert_same_training, initial_weights
from safetensors.torch import load_file, save_file
from spawn import run_ranks

from astrai_fabric import assets, lora
from astrai_fabric.checkpoint import load_checkpoint, load_model, read_adapter, read_model_config, save_checkpoint
from astrai_fabric.checkpoint.adapter import MAX_BASE_CHAIN, lora_base_entry, weight_digests
from astrai_fabric.cli import main
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.data.records import GroupDataset, PreferenceDataset, collate_groups, collate_preferences
from astrai_fabric.data.storage import read_jsonl
from astrai_fabric.errors import CheckpointError
from astrai_fabric.losses import dpo_loss, token_logprobs
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.policy_losses import group_advantages, grpo_loss
from astrai_fabric.tokenizer import Tokenizer
from astrai_fabric.train import run
from astrai_fabric.train.dpo import response_logprobs

SPEC = lora.LoRASpec(r=4, alpha=8, targets=("q_proj", "v_proj", "down"))


def injected(seed: int = 0, spec: lora.LoRASpec = SPEC, **config) -> tuple[AutoRegressiveLM, AutoRegressiveLM]:
    """A base model and a copy of it with adapters, B random so the adapter changes the output."""
    torch.manual_seed(seed)
    base = AutoRegressiveLM(tiny_config(**config))
    model = AutoRegressiveLM(tiny_config(**config))
    model.load_state_dict(base.state_dict())
    lora.inject(model, spec, seed=seed)
    for _, layer in lora.lora_layers(model):
        torch.nn.init.normal_(layer.lora_B, std=0.5)
    return base, model


def test_merged_weights_are_base_plus_scaled_product_and_compute_the_same():
    base, model = injected()
    ids = torch.randint(0, 32, (2, 7))
    expected = model(ids)["logits"]
    layers = dict(lora.lora_layers(model))
    lora.merge(model)
    assert not lora.lora_layers(model)
    for name, layer in layers.items():
        wanted = base.get_submodule(name).weight + (layer.lora_B @ layer.lora_A) * (SPEC.alpha / SPEC.r)
        torch.testing.assert_close(model.get_submodule(name).weight, wanted, atol=1e-6, rtol=0)
    torch.testing.assert_close(model(ids)["logits"], expected, atol=1e-5, rtol=0)


def test_zero_b_and_adapters_off_give_the_base_exactly():
    base, model = injected()
    ids = torch.randint(0, 32, (2, 7))
    with lora.adapters_off(model):
        assert torch.equal(model(ids)["logits"], base(ids)["logits"])
        assert not model.training
    assert model.training  # restored
    fresh = AutoRegressiveLM(tiny_config())
    fresh.load_state_dict(base.state_dict())
    lora.inject(fresh, SPEC, seed=1)  # B = 0 as initialised
    assert torch.equal(fresh(ids)["logits"], base(ids)["logits"])
    # The reference log-probabilities of dpo with LoRA are the base model's.
    mask = torch.ones_like(ids)
    with torch.no_grad(), lora.reference_context(model, None):
        ref, _ = response_logprobs(model, ids, mask)
    assert torch.equal(ref, response_logprobs(base, ids, mask)[0].detach())


def test_base_frozen_adapters_float32_under_a_bf16_cast_and_targets_by_name():
    _, model = injected(n_routed_experts=2, n_activated_experts=1, n_shared_experts=0, ffn_type="moe")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_key(n) for n in trainable)
    assert not any("router" in n for n in trainable)
    assert any("routed_experts.0.down" in n for n in trainable)  # AstrAI's rule: every layer of that name
    model.to(torch.bfloat16)
    layer = dict(lora.lora_layers(model))["layers.0.attention.q_proj"]
    assert (layer.weight.dtype, layer.lora_A.dtype, layer.lora_B.dtype) == (torch.bfloat16,) + (torch.float32,) * 2
    assert model(torch.randint(0, 32, (1, 5)))["logits"].dtype == torch.bfloat16
    with pytest.raises(Exception, match="lora_targets \\['k_proj'\\]: this model has no such linear layer"):
        mla = AutoRegressiveLM(tiny_config(attn_type="mla", kv_lora_rank=8, qk_nope_head_dim=2, qk_rope_head_dim=2))
        lora.inject(mla, lora.LoRASpec(2, targets=("k_proj",)), 0)


def test_inits():
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4))
    lora.inject(model, lora.LoRASpec(r=8, init="kaiming"), seed=0)
    a = dict(lora.lora_layers(model))["layers.0.attention.q_proj"].lora_A
    assert a.abs().max() <= 1 / math.sqrt(64) and a.abs().max() > 0.9 / math.sqrt(64)  # U(-1/sqrt(in), 1/sqrt(in))
    model = AutoRegressiveLM(tiny_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4))
    lora.inject(model, lora.LoRASpec(r=8), seed=0)
    a = dict(lora.lora_layers(model))["layers.0.attention.q_proj"].lora_A
    assert abs(a.std().item() - 1 / 8) < 0.02  # AstrAI's randn / r
    assert all(torch.equal(m.lora_B, torch.zeros_like(m.lora_B)) for _, m in lora.lora_layers(model))


def test_dropout_is_repeatable_under_gradient_checkpointing():
    """The recomputed forward must drop what the first forward dropped: gradients equal those without recompute."""
    grads = []
    for recompute in (False, True):
        _, model = injected(spec=lora.LoRASpec(r=4, dropout=0.5))
        for _, layer in lora.lora_layers(model):
            layer.generator = torch.Generator().manual_seed(7)
        model.gradient_checkpointing = recompute
        model(torch.arange(10).view(1, 10) % 32)["logits"].square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


# --- training runs -----------------------------------------------------------------------------------------------


def make_base(path: Path) -> Path:
    """A trained-looking base model: the bundled tiny model, seeded, with weights and the tokenizer."""
    source = assets.resolve("bundled:tiny")
    config = read_model_config(source)
    torch.manual_seed(0)
    model = AutoRegressiveLM(config)
    files = {name: source / name for name in ("tokenizer.json", "tokenizer_config.json")}
    return save_checkpoint(path, model.state_dict(), config.to_dict(), files=files)


def lora_args(root: Path, name: str, **overrides) -> TrainArgs:
    values = dict(
        param_path=str(root / "base"),
        data_root_path="bundled:data/seq",
        train_type="seq",
        ckpt_dir=str(root / name),
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
        lora_targets=["q_proj", "v_proj", "o_proj", "up"],
        lora_save_full=True,
        loggers=[],
    )
    values.update(overrides)
    return TrainArgs(**values)


def rank_one_fails(prompts, responses, records):
    """An online grpo reward that raises on rank 1 only."""
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 cannot score")
    return [[0.0] * len(group) for group in responses]


def two_rank_worker(root: str) -> None:
    root = Path(root)
    for mode in ("ddp", "fsdp"):
        run(lora_args(root, mode, parallel_mode=mode, nprocs=2, batch_per_device=1))
    # Last (the refusal leaves the process group), in this spawn (another costs ~15 s): a LoRA online grpo run whose
    # reward fails on one fsdp rank, right before the sharded forward every rank takes part in.
    argv = [
        "grpo",
        "--param_path",
        str(root / "base"),
        "--data_root_path",
        "bundled:data/grpo_online",
        "--lora_r",
        "4",
        "--window_size",
        "64",
        "--batch_per_device",
        "1",
        "--group_size",
        "2",
        "--rollout_max_tokens",
        "2",
        "--parallel_mode",
        "fsdp",
        "--nprocs",
        "2",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--ckpt_dir",
        str(root / "reward_fails"),
        "--reward",
        "test_lora.rank_one_fails",
        "--trust_code",
    ]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(argv)
    (root / f"reward_fails_rank{os.environ['RANK']}.txt").write_text(f"{code}\n{err.getvalue()}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    make_base(root / "base")
    run_ranks(two_rank_worker, 2, str(root))
    run(lora_args(root, "none"))
    return root


def step_dir(run_dir: Path, step: int) -> Path:
    (path,) = run_dir.glob(f"epoch_*_step_{step}")
    return path


def adapter(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(step_dir(run_dir, step) / "adapter_model.safetensors")


@pytest.mark.parametrize("mode", ["none", "ddp", "fsdp"])
def test_base_weights_stay_bit_identical_and_only_adapters_have_optimizer_state(runs, mode):
    base = load_file(runs / "base" / "model.safetensors")
    path = step_dir(runs / mode, 4)
    trained = adapter(runs / mode, 4)
    merged = load_file(path / "model.safetensors")  # --lora_save_full: the live base with the adapter merged
    # Bit for bit: the same float32 merge of the *original* base gives the live merge, so the live base is it.
    assert merged.keys() == base.keys()
    for key, tensor in lora.merge_state_dict(base, trained, 32 / 4).items():
        assert torch.equal(merged[key], tensor), key
    assert not torch.equal(merged["layers.0.attention.q_proj.weight"], base["layers.0.attention.q_proj.weight"])
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    shapes = sorted(tuple(v["exp_avg"].shape) for v in optimizer["state"].values())
    assert shapes == sorted(tuple(t.shape) for t in trained.values())  # adapters only: no base entry
    meta = json.loads((path / "meta.json").read_text())
    assert meta["lora_base"]["path"] == "../../base" and set(meta["lora_base"]["sha256"]) == {"model.safetensors"}
    entries = [json.loads(line) for line in (path / "metric.jsonl").read_text().splitlines()]
    (counts,) = [e for e in entries if e["type"] == "parameters"]
    assert counts["trainable_parameters"] == sum(t.numel() for t in trained.values())
    assert counts["optimizer_state_bytes"] == 2 * 4 * counts["trainable_parameters"]  # AdamW, float32


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(runs, mode):
    initial = initial_weights(lora_args(runs, "none"))
    assert_same_training(adapter(runs / mode, 4), adapter(runs / "none", 4), initial)


def test_a_reward_failing_on_one_rank_stops_every_rank_with_one_line_each(runs):
    outcomes = [(runs / f"reward_fails_rank{rank}.txt").read_text().split("\n", 1) for rank in (0, 1)]
    assert [code for code, _ in outcomes] == ["2", "2"]  # neither hangs nor is left to find the other gone (exit 1)
    lines = [[line for line in err.splitlines() if line.startswith("astrai-fabric: error:")] for _, err in outcomes]
    assert lines[0] == ["astrai-fabric: error: the reward was refused on 1 other rank(s) (their messages say why)"]
    raised = "your reward function test_lora.rank_one_fails raised ValueError: rank 1 cannot score (its traceback: "
    assert len(lines[1]) == 1 and raised in lines[1][0]


def test_two_rank_fsdp_checkpoint_resumes_on_one_rank(runs, tmp_path):
    run(lora_args(runs, "fsdp_on_one", resume=str(step_dir(runs / "fsdp", 2))))
    resumed, reference = adapter(runs / "fsdp_on_one", 4), adapter(runs / "fsdp", 4)
    assert_same_training(resumed, reference, adapter(runs / "fsdp", 2))


def test_resume_is_bit_exact_with_dropout_and_gradient_checkpointing(runs, capsys):
    options = dict(lora_dropout=0.3, gradient_checkpointing=True, lora_save_full=False)
    run(lora_args(runs, "dropout", **options))
    run(lora_args(runs, "dropout_resumed", resume=str(step_dir(runs / "dropout", 2)), **options))
    full, resumed = adapter(runs / "dropout", 4), adapter(runs / "dropout_resumed", 4)
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert not (step_dir(runs / "dropout", 4) / "model.safetensors").exists()  # the base is pointed to, not copied
    # The checkpoint loads as the model it computes: the adapter merged into the base it points to.
    model = load_model(step_dir(runs / "dropout", 4))
    expected = lora.merge_state_dict(load_file(runs / "base" / "model.safetensors"), full, 32 / 4)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert main(["export", str(step_dir(runs / "dropout", 4)), "--merge_lora", "--out", str(runs / "merged")]) == 0
    assert all(torch.equal(load_model(runs / "merged").state_dict()[k], v) for k, v in expected.items())
    assert main(["export", str(runs / "base"), "--merge_lora", "--out", str(runs / "unused")]) == 2
    assert not (runs / "unused").exists()  # not a LoRA checkpoint (nothing to merge)
    # A tokenizer file linking out of the checkpoint is refused, never copied into the merged model.
    linked = runs / "linked"
    shutil.copytree(step_dir(runs / "dropout", 4), linked)
    (runs / "secret.json").write_text("{}")
    (linked / "tokenizer_config.json").unlink()
    (linked / "tokenizer_config.json").symlink_to(runs / "secret.json")
    assert main(["export", str(linked), "--merge_lora", "--out", str(runs / "leaked")]) == 2
    assert f"links to {runs / 'secret.json'}, outside the model directory" in capsys.readouterr().err
    assert not (runs / "leaked").exists()
    # The base an adapter points to is hashed only once its weight files are known to be inside it: a base whose
    # model.safetensors links to /dev/zero is refused at once (its sha256 never ended).
    endless = runs / "endless_base"
    shutil.copytree(runs / "base", endless)
    (endless / "model.safetensors").unlink()
    (endless / "model.safetensors").symlink_to("/dev/zero")
    pointing = runs / "pointing"
    shutil.copytree(step_dir(runs / "dropout", 4), pointing)
    meta = json.loads((pointing / "meta.json").read_text())
    meta["lora_base"].update(path=str(endless), absolute=str(endless))
    (pointing / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="links to /dev/zero, a character device, not a file"):
        load_model(pointing)


def step_2_batch(dataset, collate, pad_id: int, seed: int) -> dict[str, torch.Tensor]:
    """The one sample optimizer step 2 trains on (1 rank, 1 sample, no accumulation): position 1 of epoch 0 in
    AstrAI's order, ``randperm(N, seed + epoch)`` (``data/sampler.py``)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    return collate([dataset[order[1]]], pad_id=pad_id)


def expected_dpo_step_2(runs: Path, sft: Path, args: TrainArgs) -> dict[str, float]:
    """dpo's metrics at step 2, computed here: the policy is the step-1 checkpoint (its adapter merged), the
    reference the sft model it started from, loaded plain (no LoRA layer at all): the base with adapters off."""
    tokenizer = Tokenizer.from_dir(sft)
    data = PreferenceDataset(read_jsonl(assets.resolve(args.data_root_path)), tokenizer, args.window_size)
    batch = step_2_batch(data, collate_preferences, tokenizer.padding_id, args.random_seed)
    ids, mask = batch["input_ids"].flatten(0, 1), batch["loss_mask"].flatten(0, 1)
    policy, reference = load_model(step_dir(runs / "dpo", 1)), load_model(sft)
    assert not lora.lora_layers(policy) and not lora.lora_layers(reference)
    with torch.no_grad():
        pi, ref = (response_logprobs(m, ids, mask)[0].view(-1, 2) for m in (policy, reference))
    _, metrics = dpo_loss(pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], args.dpo_beta)
    return {name: float(value) for name, value in metrics.items()}


def expected_grpo_step_2(runs: Path, args: TrainArgs) -> dict[str, float]:
    """Offline grpo's metrics at step 2 the same way: policy = step-1 checkpoint, reference = the plain base."""
    tokenizer = Tokenizer.from_dir(runs / "base")
    data = GroupDataset(read_jsonl(assets.resolve(args.data_root_path)), tokenizer, args.window_size)
    batch = step_2_batch(data, collate_groups, tokenizer.padding_id, args.random_seed)
    ids, mask = batch["input_ids"].flatten(0, 1), batch["loss_mask"].flatten(0, 1)[:, 1:]
    policy, reference = load_model(step_dir(runs / "grpo", 1)), load_model(runs / "base")
    with torch.no_grad():
        logp, ref = (token_logprobs(m(ids)["logits"][:, :-1], ids[:, 1:]) for m in (policy, reference))
    advantages = group_advantages(batch["rewards"]).flatten()
    # Offline: the "old" log-probabilities are the live policy's (ratio 1).
    _, metrics = grpo_loss(logp, logp, ref, mask, advantages, args.grpo_clip_eps, args.grpo_kl_coef)
    return {name: float(value) for name, value in metrics.items()}


def test_dpo_and_grpo_start_from_the_merged_sft_adapter_at_log_2_and_keep_the_base_as_reference(runs):
    """Step 1: B = 0, so the policy equals its reference (dpo's log 2, grpo's zero KL) whatever the reference is.
    Step 2: the metrics logged must equal ``expected_dpo_step_2`` / ``expected_grpo_step_2`` (float32, 1e-5; KL
    1e-6): a reference with the adapters left on (or the live policy) gives log 2 and zero KL instead."""
    sft = step_dir(runs / "none", 4)
    dpo_args = lora_args(
        runs,
        "dpo",
        train_type="dpo",
        data_root_path="bundled:data/dpo",
        param_path=str(sft),
        max_steps=2,
        ckpt_interval=1,
        batch_per_device=1,
        grad_accum_steps=1,
        window_size=64,
    )
    history = run(dpo_args)
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the policy at step 1
    expected = expected_dpo_step_2(runs, sft, dpo_args)
    assert abs(expected["dpo_loss"] - math.log(2)) > 1e-3  # step 1 moved the policy away from its reference
    assert history[1]["loss"] == pytest.approx(expected["dpo_loss"], abs=1e-5)
    for name in ("dpo_loss", "chosen_reward", "rejected_reward", "reward_margin"):
        assert history[1][name] == pytest.approx(expected[name], abs=1e-5), name
    dpo = load_checkpoint(step_dir(runs / "dpo", 1), merge_lora=False)
    assert dpo.lora.base.resolve() == sft.resolve()  # the new adapter sits on the sft model, merged
    merged_sft = load_checkpoint(sft).state_dict
    assert all(torch.equal(dpo.state_dict[k], v) for k, v in merged_sft.items())
    assert dpo.meta["reference"]["adapters_off"] is True
    grpo_args = lora_args(
        runs,
        "grpo",
        train_type="grpo",
        data_root_path="bundled:data/grpo",
        max_steps=2,
        ckpt_interval=1,
        batch_per_device=1,
        grad_accum_steps=1,
        window_size=64,
    )
    history = run(grpo_args)
    assert history[0]["kl_loss"] == pytest.approx(0.0, abs=1e-7)  # reference = policy before the first update
    expected = expected_grpo_step_2(runs, grpo_args)
    assert expected["kl_loss"] > 1e-4  # the adapter trained at step 1 makes the policy differ from the base
    assert history[1]["kl_loss"] == pytest.approx(expected["kl_loss"], abs=1e-6)
    assert history[1]["policy_loss"] == pytest.approx(expected["policy_loss"], abs=1e-5)
    # Online: the policy (adapters on) samples the groups, the reference is the same network with them off.
    reward = {"class_path": "astrai_fabric.rewards.LengthReward"}
    history = run(
        lora_args(
            runs,
            "grpo_online",
            train_type="grpo",
            data_root_path="bundled:data/grpo_online",
            max_steps=1,
            batch_per_device=2,
            grad_accum_steps=1,
            window_size=64,
            group_size=2,
            rollout_max_tokens=4,
            reward=reward,
        )
    )
    assert history[0]["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    online = load_checkpoint(step_dir(runs / "grpo_online", 1), merge_lora=False)
    assert online.lora is not None and online.meta["reference"]["adapters_off"] is True


def test_resume_refuses_a_changed_or_missing_base(runs, tmp_path, capsys):
    shutil.copytree(runs / "base", tmp_path / "base")
    shutil.copytree(step_dir(runs / "dropout", 2), tmp_path / "dropout" / "epoch_0_step_2")
    weights = load_file(tmp_path / "base" / "model.safetensors")
    weights["norm.weight"] = weights["norm.weight"] + 1
    save_file(weights, tmp_path / "base" / "model.safetensors")
    argv = [
        "seq",
        "--param_path",
        str(tmp_path / "base"),
        "--data_root_path",
        "bundled:data/seq",
        "--ckpt_dir",
        str(tmp_path / "out"),
        "--window_size",
        "32",
        "--lora_r",
        "4",
        "--lora_targets",
        "q_proj,v_proj,o_proj,up",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--resume",
        str(tmp_path / "dropout/epoch_0_step_2"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is not the one this adapter was trained on (sha256 of model.safetensors differs)" in err
    assert len(err.strip().splitlines()) == 1
    shutil.rmtree(tmp_path / "base")
    meta_file = tmp_path / "dropout" / "epoch_0_step_2" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["lora_base"]["absolute"] = str(tmp_path / "gone")
    meta_file.write_text(json.dumps(meta))
    argv[2] = str(runs / "base")
    assert main(argv) == 2
    assert "its LoRA base weights are missing" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("astrai-fabric: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_resume_refuses_a_param_path_that_is_not_the_adapters_base(runs, tmp_path, capsys):
    checkpoint = step_dir(runs / "none", 2)
    other = make_base(tmp_path / "other")  # the same architecture, other weights
    weights = load_file(other / "model.safetensors")
    save_file({k: v + 1 for k, v in weights.items()}, other / "model.safetensors")
    argv = [
        "seq",
        "--param_path",
        str(other),
        "--data_root_path",
        "bundled:data/seq",
        "--ckpt_dir",
        str(tmp_path / "out"),
        "--window_size",
        "32",
        "--lora_r",
        "4",
        "--lora_targets",
        "q_proj,v_proj,o_proj,up",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--resume",
        str(checkpoint),
    ]
    assert main(argv) == 2  # today's: trains on the checkpoint's base, param_path's weights silently unused
    base = (runs / "base").resolve()
    refusal = f"--resume: {checkpoint} is a LoRA adapter trained on the base {base}, but --param_path is {other}"
    assert f"{refusal}, whose weights differ; resume with --param_path {base}" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()
    shutil.copytree(runs / "base", tmp_path / "copy")  # the same weights elsewhere: the same base
    argv[argv.index(str(other))] = str(tmp_path / "copy")
    assert main([*argv, "--dry_run"]) == 0


def test_an_adapter_whose_base_pointer_loops_is_refused_at_once(runs, tmp_path, capsys):
    """Today's: each pointer followed and hashed again until the interpreter's recursion limit (about 30 s), then
    blamed on JSON nesting."""
    adapters = [tmp_path / f"a{i}" for i in range(MAX_BASE_CHAIN + 1)]
    for path in adapters:  # adapter-only checkpoints: loading one follows its pointer
        path.mkdir()
        for name in ("adapter_model.safetensors", "adapter_config.json", "config.json", "meta.json"):
            shutil.copy(step_dir(runs / "none", 2) / name, path / name)

    def point(adapter: Path, base: Path) -> None:
        meta = json.loads((adapter / "meta.json").read_text())
        meta["lora_base"] = lora_base_entry(base, adapter, weight_digests(base))  # hashes that match: a real loop
        (adapter / "meta.json").write_text(json.dumps(meta))

    first, second = adapters[:2]
    argv = ["generate", "--param_path", str(first), "--chat", "false", "--prompt", "a", "--max_new_tokens", "1"]
    point(first, first)
    assert main(argv) == 2
    loop = f"{first}: its LoRA base pointer (meta.json 'lora_base') loops back: {first} -> {first}; an adapter's"
    assert loop in one_error_line(capsys)
    point(second, first)
    point(first, second)
    assert main(argv) == 2
    assert f"loops back: {first} -> {second} -> {first}" in one_error_line(capsys)
    for adapter, base in reversed(list(zip(adapters, [*adapters[1:], runs / "base"], strict=True))):
        point(adapter, base)  # a chain, no loop, longer than any stack of adapters on adapters
    assert main(argv) == 2
    assert f"leads through more than {MAX_BASE_CHAIN} adapter checkpoints without weights" in one_error_line(capsys)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora_r", "-1"], "lora_r must be >= 0 (0 = off), got -1"),
        (["--lora_r", "4", "--lora_targets", "q_proj,router"], "lora_targets ['router'] are unknown"),
        (["--lora_r", "4", "--lora_dropout", "1"], "lora_dropout must be in [0, 1), got 1.0"),
        (["--lora_r", "4", "--lora_alpha", "0"], "lora_alpha must be positive, got 0"),
        (["--lora_r", "4", "--reference_path", "x"], "reference_path cannot be combined with lora_r"),
        (["--lora_r", "4", "--tp_size", "2"], "LoRA adapters are not tensor-parallel"),
        (["--lora_r", "4", "--sharded_checkpoint"], "sharded_checkpoint with lora_r"),
        (["--lora_r", "4"], "has no weights to adapt"),  # bundled:tiny ships a config only
    ],
)
def test_bad_lora_flags_are_one_line_exit_2(tmp_path, capsys, flags, message):
    argv = [
        "dpo",
        "--param_path",
        "bundled:tiny",
        "--data_root_path",
        "bundled:data/dpo",
        "--ckpt_dir",
        str(tmp_path / "out"),
        "--parallel_mode",
        "fsdp",
        "--num_workers",
        "0",
        *flags,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_trainable_parameters_and_optimizer_state(runs, capsys):
    argv = [
        "sft",
        "--param_path",
        str(runs / "base"),
        "--data_root_path",
        "bundled:data/sft",
        "--ckpt_dir",
        str(runs / "dry"),
        "--lora_r",
        "8",
        "--dry_run",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "1,029,248 parameters, 28,672 trainable (2.79%); optimizer adamw: adamw 32 tensors (lr 0.0003, decay 0.1); "
        "state 0.2 MiB" in out
    )
    assert "lora         r=8, alpha=32, dropout 0.0, init astrai, on q_proj,k_proj,v_proj,o_proj (16 linear" in out


@needs_astrai
def test_astrai_loads_our_adapter_and_we_load_astrais(runs, tmp_path):
    """AstrAI's inject_lora + load_lora on our checkpoint's adapter, and its save_lora's adapter here: same logits."""
    ours = step_dir(runs / "dropout", 4)
    ids = torch.randint(0, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    assert main(["export", str(ours), "--merge_lora", "--out", str(tmp_path / "merged")]) == 0
    run_astrai(f"""
        import torch
        from astrai.model.automodel import AutoModel
        from astrai.model.components.lora import inject_lora, load_lora, save_lora
        ids = torch.load("{tmp_path / "ids.pt"}")
        model = AutoModel.from_pretrained("{runs / "base"}")
        load_lora(model, "{ours}")  # injects from adapter_config.json, then loads adapter_model.safetensors
        torch.save(model(ids)["logits"].detach(), "{tmp_path / "astrai_on_ours.pt"}")
        model = AutoModel.from_pretrained("{runs / "base"}")
        config = inject_lora(model, r=2, alpha=6, target_modules={{"k_proj", "gate"}})
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                torch.nn.init.normal_(param, std=0.1)
        save_lora(model, "{tmp_path / "astrai_adapter"}", config)
        exported = AutoModel.from_pretrained("{tmp_path / "merged"}")  # export --merge_lora, read strictly
        torch.save(exported(ids)["logits"].detach(), "{tmp_path / "astrai_merged.pt"}")
        torch.save(model(ids)["logits"].detach(), "{tmp_path / "astrai_own.pt"}")
    """)
    with torch.no_grad():
        logits = load_model(ours).eval()(ids)["logits"]
        torch.testing.assert_close(torch.load(tmp_path / "astrai_on_ours.pt"), logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.load(tmp_path / "astrai_merged.pt"), logits, atol=1e-5, rtol=0)
        theirs = read_adapter(tmp_path / "astrai_adapter")
        model = load_model(runs / "base")
        lora.inject(model, theirs.spec, seed=0)
        lora.load_adapter(model, theirs.state_dict, "astrai_adapter")
        logits = model.eval()(ids)["logits"]
    torch.testing.assert_close(torch.load(tmp_path / "astrai_own.pt"), logits, atol=1e-5, rtol=0)
    assert os.path.exists(ours / "adapter_config.json")
