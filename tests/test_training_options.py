"""Training options end to end: precision, gradient checkpointing, torch.compile, budgets, validation."""

import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from astrai_fabric.config.train import TrainArgs
from astrai_fabric.train import run


def args(tmp_path, **overrides) -> TrainArgs:
    values = dict(
        param_path="bundled:tiny",
        data_root_path="bundled:data/sft",
        train_type="sft",
        ckpt_dir=str(tmp_path),
        window_size=32,
        batch_per_device=2,
        max_steps=3,
        max_lr=1e-3,
        num_workers=0,
        parallel_mode="none",
        random_seed=1,
        ckpt_interval=1000,
    )
    values.update(overrides)
    return TrainArgs(**values)


def saved(tmp_path, step: int) -> dict[str, torch.Tensor]:
    (path,) = tmp_path.glob(f"epoch_*_step_{step}")
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no items()


def test_bf16_true_trains_and_saves_bf16_like_astrai(tmp_path):
    history = run(args(tmp_path, precision="bf16-true"))
    assert len(history) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    assert {t.dtype for t in saved(tmp_path, 3).values()} == {torch.bfloat16}


def test_gradient_checkpointing_changes_nothing_but_memory(tmp_path):
    plain = run(args(tmp_path / "plain"))
    recomputed = run(args(tmp_path / "recomputed", gradient_checkpointing=True))
    assert [r["loss"] for r in recomputed] == pytest.approx([r["loss"] for r in plain], abs=1e-6)


def test_budgets_stop_early_with_a_checkpoint(tmp_path):
    # 32-token windows, 2 per micro-batch: 64 tokens per step; a budget of 150 tokens stops after step 3.
    history = run(args(tmp_path, max_steps=None, max_tokens=150))
    assert [r["step"] for r in history] == [1, 2, 3]
    assert (tmp_path / "epoch_0_step_3").is_dir()


def test_keep_last_k_deletes_older_checkpoints_once_a_newer_one_is_complete(tmp_path):
    run(args(tmp_path, max_steps=5, ckpt_interval=1, keep_last_k=2))
    assert sorted(p.name for p in tmp_path.glob("epoch_*")) == ["epoch_0_step_4", "epoch_0_step_5"]


def test_validation_split_reports_val_loss(tmp_path):
    history = run(args(tmp_path, val_split=0.1, val_step=2, max_steps=4))
    assert [("val_loss" in r) for r in history] == [True, True, False, True]  # step 1, then every 2 steps


@pytest.mark.slow
def test_compiled_run_saves_clean_keys(tmp_path):
    command = [
        sys.executable,
        "-m",
        "astrai_fabric",
        "seq",
        "--param_path",
        "bundled:tiny",
        "--data_root_path",
        "bundled:data/seq",
        "--ckpt_dir",
        str(tmp_path),
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--window_size",
        "16",
        "--max_steps",
        "2",
        "--compile",
        "default",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    keys = list(saved(tmp_path, 2))
    assert "embed_tokens.weight" in keys and not any("_orig_mod" in k for k in keys)  # AstrAI's B3


def test_a_longer_resume_says_its_schedule_ends_early_and_can_rebuild_it(tmp_path, capsys):
    import json
    from pathlib import Path

    from astrai_fabric.assets import SEQ_DATA_DIR
    from astrai_fabric.cli import main
    from astrai_fabric.schedule import cosine_factor

    data = tmp_path / "verses.jsonl"  # 2 chapters: 65 windows of 32 tokens, 4 steps of 8 x 2 per epoch
    data.write_text("".join((SEQ_DATA_DIR / "kjv.jsonl").read_text().splitlines(keepends=True)[:2]))
    base = [
        "seq",
        "--config",
        str(Path(__file__).parents[1] / "recipes" / "tiny-seq.yaml"),
        "--data_root_path",
        str(data),
        "--window_size",
        "32",
        "--ckpt_dir",
        str(tmp_path / "run"),
        "--loggers",
        "[]",
    ]
    assert main([*base, "--stop_after_steps", "1"]) == 0  # the recipe's 3 epochs: a schedule of 12 steps
    assert main([*base, "--resume", "auto", "--n_epoch", "6", "--dry_run"]) == 0
    assert (
        "note: the checkpoint's schedule ends at step 12, before this run's 24 steps: steps 13-24 run at the floor "
        "(0.01 x max_lr); --resume_schedule false rebuilds the schedule for 24 steps"
    ) in capsys.readouterr().out
    assert main([*base, "--resume", "auto", "--max_steps", "5", "--dry_run"]) == 0  # shorter: the note says so too
    assert (
        "note: the checkpoint's schedule runs to step 12; max_steps 5 ends this run before it has decayed (the "
        "checkpoint's schedule wins on a resume); --resume_schedule false rebuilds it to end at step 5"
    ) in capsys.readouterr().out
    longer = [*base, "--resume", "auto", "--n_epoch", "6", "--resume_schedule", "false", "--stop_after_steps", "1"]
    assert main(longer) == 0
    assert "schedule: rebuilt for this run's 24 steps (--resume_schedule false), continuing at step 1" in (
        capsys.readouterr().out
    )
    entries = (tmp_path / "run" / "epoch_0_step_2" / "metric.jsonl").read_text().splitlines()
    lr = [json.loads(e)["lr"] for e in entries if json.loads(e)["type"] == "step"][-1]
    assert lr == pytest.approx(3e-3 * cosine_factor(1, int(0.05 * 24), 24 - int(0.05 * 24), 0.01))


@pytest.mark.parametrize(
    "optimizer, flags, expected, plan_line",
    [
        # Mano's own momentum, not Muon's (AstrAI's B17); Nora's decay follows --weight_decay (AstrAI's B18).
        ("mano_adamw", dict(muon_momentum=0.5, mano_momentum=0.8, mano_nesterov=False),
         {"mano": dict(momentum=0.8, nesterov=False, steps=2, weight_decay=0.1)},
         "optimizer mano_adamw: mano 28 tensors (lr 0.001, decay 0.1), adamw 10 tensors (lr 0.001, decay 0);"),
        ("nora_nadamw", dict(weight_decay=0.07, nora_lr=2e-3, nora_beta=0.9, nora_momentum=0.85),
         {"nora": dict(weight_decay=0.07, beta=0.9, momentum=0.85)},
         "optimizer nora_nadamw: nora 28 tensors (lr 0.002, decay 0.07), nadamw 10 tensors (lr 0.001, decay 0);"),
    ],
    ids=["mano_adamw", "nora_nadamw"],
)  # fmt: skip
def test_other_optimizers_train_with_their_own_flags(tmp_path, capsys, optimizer, flags, expected, plan_line):
    history = run(args(tmp_path, optimizer=optimizer, max_steps=2, **flags))
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
    (path,) = tmp_path.glob("epoch_*_step_2")
    state = torch.load(path / "optimizer.pt", weights_only=True)
    assert list(state) == [*expected, "nadamw" if optimizer == "nora_nadamw" else "adamw"]
    for part, values in expected.items():
        group = state[part]["param_groups"][0]
        assert {key: group[key] for key in values} == values
    assert plan_line in capsys.readouterr().out  # the plan names the groups


def test_max_steps_past_the_epochs_runs_as_many_as_it_takes_and_resumes_exactly(tmp_path, capsys):
    """TRL's names, ``--num_train_epochs 1 --max_steps 10`` over data of 9 micro-batches an epoch (2 to a step):
    the run takes 10 optimizer steps over 3 epochs, as transformers' ``max_steps`` overrides ``num_train_epochs``
    (it stopped at the epoch's 4 before). Stopped at step 5 (in the second epoch) and resumed, it ends with the
    weights of the run never stopped, bit for bit: each epoch reshuffled as the loop's own does."""
    import json
    from pathlib import Path

    from astrai_fabric.assets import SEQ_DATA_DIR
    from astrai_fabric.cli import main

    data = tmp_path / "verses.jsonl"  # 65 windows of 32 tokens: 9 micro-batches of 8 per epoch
    data.write_text("".join((SEQ_DATA_DIR / "kjv.jsonl").read_text().splitlines(keepends=True)[:2]))
    trl = ["--model_name_or_path", "bundled:tiny", "--dataset_name", str(data), "--max_seq_length", "32"]
    trl += ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--num_train_epochs", "1"]
    trl += ["--max_steps", "10", "--parallel_mode", "none", "--num_workers", "0", "--loggers", "[]"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(["seq", *trl, "--output_dir", str(whole), "--dry_run"]) == 0
    plan = capsys.readouterr().out
    assert "-> max_steps 10 optimizer steps over 3 epoch(s) (max_steps sets the length" in plan, plan
    assert "this run     steps 1 to 10" in plan
    assert main(["seq", *trl, "--output_dir", str(whole)]) == 0
    assert main(["seq", *trl, "--output_dir", str(split), "--stop_after_steps", "5"]) == 0
    assert main(["seq", *trl, "--output_dir", str(split), "--resume", "auto"]) == 0
    (last,) = whole.glob("epoch_*_step_10")
    assert last.name == "epoch_2_step_10"
    entries = [json.loads(line) for line in (last / "metric.jsonl").read_text().splitlines()]
    steps = [(e["epoch"], e["step"]) for e in entries if e["type"] == "step"]
    assert [s for _, s in steps] == list(range(1, 11)) and {e for e, _ in steps} == {0, 1, 2}
    assert Path(split / "epoch_2_step_10").is_dir()
    ours, uninterrupted = saved(split, 10), saved(whole, 10)
    assert all(torch.equal(ours[k], uninterrupted[k]) for k in uninterrupted)
