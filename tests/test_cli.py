"""The command line: AstrAI spellings, recipes (flat and sectioned), overrides, and errors without tracebacks."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astrai_fabric.cli import main, parse_train_args

ROOT = Path(__file__).parents[1]


def test_flags_override_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("batch_per_device: 4\nmax_lr: 1.0e-3\nparam_path: m\ndata_root_path: d\n")
    args, print_config = parse_train_args("sft", ["--config", str(recipe), "--max_lr", "2e-4"])
    assert (args.batch_per_device, args.max_lr, args.train_type, print_config) == (4, 2e-4, "sft", False)


def test_several_recipes_merge_in_order_and_flags_win_over_all(tmp_path, capsys):
    base, paths = tmp_path / "base.yaml", tmp_path / "paths.yaml"
    base.write_text(
        "param_path: bundled:tiny\ndata_root_path: bundled:data/seq\nckpt_dir: first\nmax_lr: 1.0e-3\nn_epoch: 2\n"
    )
    paths.write_text(f"ckpt_dir: {tmp_path / 'second'}\nmax_lr: 2.0e-3\n")
    args = parse_train_args("seq", ["--config", str(base), "-c", str(paths)])[0]
    assert (args.ckpt_dir, args.max_lr, args.n_epoch) == (str(tmp_path / "second"), 2e-3, 2)  # the later file's keys
    assert args.config == [str(base), str(paths)]
    args = parse_train_args("seq", ["--max_lr", "3e-4", f"--config={paths}", "--config", str(base)])[0]
    assert (args.ckpt_dir, args.max_lr) == ("first", 3e-4)  # reversed: the base wins; a flag, wherever it is, over all
    assert main(["seq", "-c", str(base), "-c", str(paths), "--print_config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)  # the resolved recipe: one flat file, naming no recipe
    assert (printed["ckpt_dir"], printed["max_lr"], printed["n_epoch"]) == (str(tmp_path / "second"), 2e-3, 2)
    assert "config" not in printed
    assert main(["seq", "-c", str(base), "-c", str(paths), "--max_steps", "1", "--dry_run"]) == 0
    plan = capsys.readouterr().out.splitlines()
    merged = "(merged in this order: a later file's keys win; flags over all)"
    assert plan[1] == f"  recipes      {base}, then {paths} {merged}"
    assert any(line.startswith(f"  outputs      {tmp_path / 'second'}:") for line in plan)


def test_astrai_command_line_is_accepted_unchanged(tmp_path):
    recipe = tmp_path / "astrai.yaml"
    # AstrAI's sectioned YAML: sections only group keys; `runtime` belongs to AstrAI's Docker tooling.
    recipe.write_text(
        "model:\n  param_path: m\ndata:\n  data_root_path: d\n  window_size: 64\n"
        "training:\n  batch_per_device: 2\n  grad_accum_steps: 4\nparallel:\n  parallel_mode: ddp\n  nprocs: 2\n"
        "ckpt:\n  ckpt_interval: 10\nruntime:\n  gpus: 8\n"
    )
    argv = [
        "--train_type",
        "sft",
        "-c",
        str(recipe),
        "--resume",
        "--no-muon_nesterov",
        "--gradient_checkpointing",
        "--metrics",
        "loss",
        "--metrics",
        "lr",
        "--pin_memory",
        "false",
        "--devices",
        "3",
    ]
    args, _ = parse_train_args("sft", argv)
    assert (args.param_path, args.data_root_path, args.window_size) == ("m", "d", 64)
    assert (args.batch_per_device, args.grad_accum_steps, args.parallel_mode, args.ckpt_interval) == (2, 4, "ddp", 10)
    assert (args.resume, args.muon_nesterov, args.gradient_checkpointing, args.pin_memory) == (True, False, True, False)
    assert args.metrics == ["loss", "lr"] and args.nprocs == 3


def test_resume_takes_auto_or_a_path():
    assert parse_train_args("seq", ["--resume", "auto"])[0].resume == "auto"
    assert parse_train_args("seq", ["--resume", "ckpt/epoch_0_step_5"])[0].resume == "ckpt/epoch_0_step_5"
    assert parse_train_args("seq", ["--resume", "false"])[0].resume is False


def test_print_config_round_trips(tmp_path, capsys):
    assert main(["seq", "--param_path", "m", "--data_root_path", "d", "--max_steps", "7", "--print_config"]) == 0
    printed = capsys.readouterr().out
    recipe = tmp_path / "printed.yaml"
    recipe.write_text(printed)
    args, _ = parse_train_args("seq", ["--config", str(recipe)])
    assert (args.max_steps, args.param_path, args.train_type) == (7, "m", "seq")
    assert yaml.safe_load(printed)["max_steps"] == 7


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses_and_opens_with_its_command(recipe):
    first_lines = recipe.read_text().splitlines()[:3]
    command = next(line for line in first_lines if "astrai-fabric " in line)
    train_type = command.split("astrai-fabric ")[1].split()[0]
    assert f"--config recipes/{recipe.name}" in command
    args, _ = parse_train_args(train_type, ["--config", str(recipe)])
    args.validate()


def run_cli(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [
        ("batch_per_devic: 2\n", r"unknown key\(s\) batch_per_devic \(did you mean batch_per_device\?\)"),
        ("batch_per_device: two\n", r"batch_per_device.*Expected a <class 'int'>. Got value: two"),
        ("train_type: dpo\n", r"train_type is not 'seq'"),
        ("- just\n- a list\n", r"expected a mapping of flags to values"),
        ("a: [unclosed\n", r"not valid YAML"),
    ],
)
def test_recipe_mistakes_name_the_file(tmp_path, capsys, content, message):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(content)
    code, err = run_cli(["seq", "--config", str(recipe)], capsys)
    assert code == 2
    assert err.startswith(f"astrai-fabric: error: {recipe}: ")
    assert re.search(message, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["seq", "--batch_per_devic", "2"], "unknown flag --batch_per_devic (did you mean --batch_per_device?)"),
        # a suggestion is spelled as the flag was typed: a bare flag, a negation, and the commands jsonargparse checks
        (["seq", "--num_thread"], "unknown flag --num_thread (did you mean --num_threads?)"),
        (["seq", "--no-gradient_checkpointin"], "(did you mean --no-gradient_checkpointing?)"),
        (["generate", "--max_new_token", "3"], "unknown flag --max_new_token (did you mean --max_new_tokens?)"),
        (["export", "x", "--fromat", "hf"], "unrecognized arguments: --fromat (did you mean --format?) hf"),
        (["prepare", "x", "-o", "y", "-c", "z", "--tokenizer_pth=t"], "--tokenizer_pth=t (did you mean --tokenizer_"),
        (["plot", "x", "--outptu", "y"], "--outptu (did you mean --output?) y"),
        (["frobnicate"], "choose one of seq, sft, dpo, kto, grpo, reward_model, evaluate, generate, chat, serve, "),
        (["seq", "--n_epoch", "x"], "Parser key \"n_epoch\": Expected a <class 'int'>. Got value: x"),
        (["seq", "--config", "absent.yaml"], "--config absent.yaml: file not found"),
        (["sft", "--train_type", "seq"], "train_type=seq contradicts the command 'sft'"),
        (["frobnicate"], "unknown command 'frobnicate'"),
        (["seq", "--param_path", "m"], "data_root_path is required"),
        (["seq", "--param_path", "m", "--data_root_path", "d", "--batch_per_device", "0"], "batch_per_device must be"),
    ],
)
def test_flag_mistakes(capsys, argv, message):
    code, err = run_cli(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err


# --- mistakes found when the run starts: one message, exit 2, nothing written ---------------------------------


def tiny(tmp_path, *extra) -> list[str]:
    return [
        "seq",
        "--param_path",
        "bundled:tiny",
        "--data_root_path",
        "bundled:data/seq",
        "--ckpt_dir",
        str(tmp_path / "out"),
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        *extra,
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data_root_path", "absent"], "data_root_path absent: not found"),
        (["--window_size", "1000000"], "window_size 1000000 exceeds max_position_embeddings 256"),
        (["--nprocs", "2"], "parallel_mode none trains in one process, but 2 were requested"),
        (["--resume", "true"], "is not a training checkpoint (no meta.json)"),
        (["--param_path", "absent"], "param_path absent: not found (expected a model or checkpoint directory)"),
        (["--param_path", "."], "param_path .: no config.json"),
        (["--resume", "absent_dir"], "absent_dir is not a training checkpoint"),
    ],
)
def test_start_up_mistakes_write_nothing(tmp_path, capsys, extra, message):
    code, err = run_cli(tiny(tmp_path, *extra), capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_empty_dataset(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    code, err = run_cli(tiny(tmp_path, "--data_root_path", str(tmp_path / "empty.jsonl")), capsys)
    assert code == 2 and "the dataset is empty" in err and not (tmp_path / "out").exists()


def test_resuming_a_checkpoint_of_another_model_is_refused(tmp_path, capsys):
    assert main(tiny(tmp_path, "--max_steps", "1", "--window_size", "16")) == 0
    (checkpoint,) = (tmp_path / "out").glob("epoch_*")
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((checkpoint / "config.json").read_text()) | {"num_hidden_layers": 2}
    (other / "config.json").write_text(json.dumps(config))
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    code, err = run_cli(tiny(tmp_path, "--param_path", str(other), "--resume", str(checkpoint)), capsys)
    assert code == 2 and "holds a different model than param_path: num_hidden_layers: 4 there, 2 here" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before


# --- end to end, as a user runs it -------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_recipe_end_to_end_then_resume(tmp_path):
    base = [
        sys.executable,
        "-m",
        "astrai_fabric",
        "sft",
        "--config",
        str(ROOT / "recipes" / "tiny-sft.yaml"),
        "--ckpt_dir",
        str(tmp_path),
        "--max_steps",
        "4",
        "--ckpt_interval",
        "2",
    ]
    first = subprocess.run(base, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert first.returncode == 0, first.stderr
    assert "checkpoint: " in first.stdout and str(tmp_path) in first.stdout
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".astrai_fabric.json", "epoch_0_step_2", "epoch_0_step_4", "logs", "plot.png", "recipe.yaml"]
    files = sorted(p.name for p in (tmp_path / "epoch_0_step_4").iterdir())
    assert files == [
        "config.json",
        "meta.json",
        "metric.jsonl",
        "model.safetensors",
        "optimizer.pt",
        "recipe.yaml",
        "rng.pt",
        "scheduler.pt",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    meta = json.loads((tmp_path / "epoch_0_step_4" / "meta.json").read_text())
    assert (meta["epoch"], meta["consumed_samples"], meta["train_type"]) == (0, 4 * 2 * 8, "sft")
    # The peak memory measured beside the plan's figure: the run's last line, and each checkpoint's entry so far.
    (memory_line,) = [line for line in first.stdout.splitlines() if line.startswith("memory: ")]
    planned = re.search(r"memory +per rank at its peak \(the forward's end\), estimated: ([\d.]+ \w+)", first.stdout)
    assert re.fullmatch(rf"memory: [\d.]+ MiB per rank at its peak, measured \(.*\); planned {planned[1]}", memory_line)
    entries = [json.loads(line) for line in (tmp_path / "epoch_0_step_4" / "metric.jsonl").read_text().splitlines()]
    (counts,) = [e for e in entries if e["type"] == "parameters"]
    memory = [e for e in entries if e["type"] == "memory"]
    assert [e["step"] for e in memory] == [2, 4]
    assert all(e["measured_peak_bytes"] >= 4 * counts["total_parameters"] for e in memory)  # at least the weights
    assert memory[0]["planned_peak_bytes"] == memory[1]["planned_peak_bytes"] > 0

    second = subprocess.run(
        base[:-4] + ["--max_steps", "6", "--ckpt_interval", "2", "--resume", "auto"],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": ""},
    )
    assert second.returncode == 0, second.stderr
    assert f"  resume       from {tmp_path / 'epoch_0_step_4'} at step 4" in second.stdout
    assert "step 5/" in second.stdout and "step 1/" not in second.stdout
    assert sorted(p.name for p in tmp_path.glob("epoch_*"))[-1] == "epoch_0_step_6"


@pytest.mark.slow
def test_cli_launches_its_own_ranks(tmp_path):
    # `--nprocs 2`: Fabric re-executes `python -m astrai_fabric ...` for rank 1; both ranks train one FSDP model.
    command = [
        sys.executable,
        "-m",
        "astrai_fabric",
        "seq",
        "--config",
        str(ROOT / "recipes" / "tiny-seq.yaml"),
        "--ckpt_dir",
        str(tmp_path),
        "--max_steps",
        "2",
        "--nprocs",
        "2",
        "--parallel_mode",
        "fsdp",
        "--window_size",
        "32",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "  batch        2 rank(s) x 8 per device x 2 accumulation = 32 samples per optimizer step" in result.stdout
    assert result.stdout.count("done after step 2") == 1  # printed by rank 0 only
    assert (tmp_path / "epoch_0_step_2" / "optimizer.pt").is_file()


def test_generate_command(tmp_path, capsys):
    import shutil

    import torch

    from astrai_fabric.assets import TINY_MODEL_DIR
    from astrai_fabric.checkpoint import save_checkpoint
    from astrai_fabric.config import ModelConfig
    from astrai_fabric.model import AutoRegressiveLM

    torch.manual_seed(0)
    model = AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json"))
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    path = save_checkpoint(tmp_path / "model", model.state_dict(), model.config.to_dict(), files=files)
    argv = [
        "generate",
        "--param_path",
        str(path),
        "--prompt",
        "What is 2 + 2?",
        "--prompt",
        "Hi",
        "--temperature",
        "0",
        "--max_new_tokens",
        "4",
        "--num_samples",
        "2",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(">>> What is 2 + 2?") == 2 and out.count(">>> Hi") == 2
    # A JSONL of prompts in, a JSONL of completions out: greedy, each the static batch's for its prompt alone; sampled,
    # the same file again for the same seed
    from astrai_fabric.generate import generate
    from astrai_fabric.tokenizer import Tokenizer

    texts = ["Once upon", "The capital of", "2 + 2 ="]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts) + "\n")
    prompts_file = str(tmp_path / "prompts.jsonl")
    jsonl = ["generate", "--param_path", str(path), "--prompts_file", prompts_file, "--chat", "false"]
    out = tmp_path / "out.jsonl"
    assert main([*jsonl, "--temperature", "0", "--max_new_tokens", "6", "--output", str(out)]) == 0
    assert "3 prompt(s) x 1 completion(s) written to" in capsys.readouterr().out
    tokenizer = Tokenizer.from_dir(path)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["prompt"] for line in lines] == texts
    for line in lines:
        alone = generate(model.eval(), [tokenizer.encode(line["prompt"])], 6, temperature=0)[0]
        assert line["completions"] == [tokenizer.decode_whole_chars(alone)]
    sampled = [*jsonl, "--temperature", "1", "--num_samples", "3", "--max_num_seqs", "4", "--output", str(out)]
    assert main(sampled) == 0
    first = out.read_text()
    assert main(sampled) == 0 and out.read_text() == first
    assert all(len(json.loads(line)["completions"]) == 3 for line in first.splitlines())
    small = [*jsonl, "--max_new_tokens", "4", "--kv_cache_memory", "1MiB", "--output", str(out)]
    assert main(small) == 0  # 32 blocks of 16 positions: room enough
    for value, message in (("10kB", "kv_cache_memory '10kB': at least 1 MiB"), ("lots", "kv_cache_memory 'lots'")):
        code, err = run_cli([*jsonl, "--kv_cache_memory", value], capsys)
        assert code == 2 and message in err, err
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    bad = ["generate", "--param_path", str(path), "--prompts_file", str(tmp_path / "bad.jsonl")]
    code, err = run_cli(bad, capsys)
    assert code == 2 and 'bad.jsonl:2: expected an object with a "prompt" string' in err
    shutil.rmtree(path)
    code, err = run_cli(["generate", "--param_path", str(path), "--prompt", "x"], capsys)
    assert code == 2 and "no such checkpoint or model directory" in err
    code, err = run_cli(["generate", "--param_path", str(tmp_path)], capsys)
    assert code == 2 and "at least one --prompt" in err


def test_the_usage_line_lists_every_command(capsys):
    """The usage lines name the commands the help lists, and each of them is a command (its --help exits 0)."""
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    usage = text.split("\n\n")[0]
    named = [c for group in re.findall(r"\{([\w,]+)\}", usage) for c in group.split(",")]
    listed = re.findall(r"^  (\w+) ", text.split("commands:")[1], flags=re.MULTILINE)
    assert sorted(named) == sorted(listed) and len(listed) >= 9, usage
    for command in listed:
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0, command
    capsys.readouterr()


def test_export_of_a_complete_checkpoint_in_its_own_layout_says_so_and_writes_nothing(tmp_path, capsys):
    """The default --format astrai completes a sharded checkpoint or converts a Hugging Face directory; a directory
    in AstrAI's layout already is said to be (with the --format that does what was likely meant), exit 0, nothing
    written."""
    import torch

    from astrai_fabric import lora
    from astrai_fabric.assets import TINY_MODEL_DIR
    from astrai_fabric.checkpoint import save_checkpoint
    from astrai_fabric.checkpoint.adapter import lora_base_entry, weight_digests
    from astrai_fabric.config import ModelConfig
    from astrai_fabric.model import AutoRegressiveLM

    torch.manual_seed(0)
    model = AutoRegressiveLM(ModelConfig.from_file(TINY_MODEL_DIR / "config.json"))
    config = model.config.to_dict()
    ckpt = save_checkpoint(tmp_path / "ckpt", model.state_dict(), config, meta={"train_type": "seq"})
    spec = lora.LoRASpec(r=2, alpha=4)
    lora.inject(model, spec, seed=0)
    adapter = lora.adapter_state_dict(model.state_dict())
    meta = {"lora_base": lora_base_entry(ckpt, tmp_path / "lora", weight_digests(ckpt))}
    save_checkpoint(tmp_path / "lora", None, config, meta=meta, adapter=adapter, adapter_config=spec.adapter_config())
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    lora_formats = "--format peft writes its adapter for PEFT, --merge_lora"
    for source, formats in (
        (ckpt, "--format hf writes it for transformers, --dtype casts it"),
        (tmp_path / "lora", lora_formats),
    ):
        assert main(["export", str(source)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"nothing to export: {source}: already a complete checkpoint in AstrAI's layout"), out
        assert formats in out and "nothing written" in out
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_num_threads_is_set_by_the_command_line_only(tmp_path, monkeypatch, capsys):
    import os

    import torch

    from astrai_fabric.config.train import TrainArgs
    from astrai_fabric.train import run

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # restored afterwards, like the value the CLI sets
    plan = ["seq", "--config", str(ROOT / "recipes" / "tiny-seq.yaml"), "--ckpt_dir", str(tmp_path), "--dry_run"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # a program's own setting
        run(
            TrainArgs(
                param_path="bundled:tiny",
                data_root_path="bundled:data/seq",
                train_type="seq",
                ckpt_dir=str(tmp_path),
                num_threads=1,
                dry_run=True,
            )
        )
        assert torch.get_num_threads() == 3  # the library leaves it alone
        assert main(plan) == 0
        assert "  cpu threads  3 per rank (--num_threads 1 can be several times faster" in capsys.readouterr().out
        assert main([*plan, "--num_threads", "1"]) == 0
        assert (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]) == (1, "1")  # and the ranks it launches
        assert "  cpu threads  1 per rank\n" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


# --- other projects' flag names (config/aliases.py), suggestions by meaning, --help per train type ----------------


def test_hugging_face_and_trl_names_are_read_as_ours(tmp_path):
    """Each name of config.aliases sets our flag, with the value read as ours; in a flat recipe and in AstrAI's
    sectioned one alike."""
    argv = [
        *("--learning_rate", "1e-3", "--max_seq_length", "64", "--model_name_or_path", "m", "--seed", "7"),
        *("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4", "--num_train_epochs", "3.0"),
        *("--save_steps", "10", "--output_dir", "out", "--lr_scheduler_type", "cosine", "--bf16"),
        *("--dataset_name", "d", "--dataset_train_split", "train", "--save_total_limit", "2", "--ddp_timeout", "60"),
        *("--dataloader_num_workers", "0", "--no-dataloader_pin_memory", "--warmup_steps", "5.0"),
    ]
    args = parse_train_args("sft", argv)[0]
    assert (args.max_lr, args.window_size, args.param_path, args.random_seed) == (1e-3, 64, "m", 7)
    assert (args.batch_per_device, args.grad_accum_steps, args.n_epoch, args.ckpt_interval) == (2, 4, 3, 10)
    assert (args.ckpt_dir, args.schedule_type, args.precision, args.data_root_path) == (
        "out",
        "cosine",
        "bf16-mixed",
        "d",
    )
    assert (args.data_split, args.keep_last_k, args.dist_timeout, args.num_workers) == ("train", 2, 60.0, 0)
    assert (args.pin_memory, args.warmup_steps, args.warmup_ratio) == (False, 5, None)
    assert parse_train_args("sft", ["--lr", "2e-4", "--bf16", "false", "--max_length", "32"])[0].max_lr == 2e-4
    assert parse_train_args("sft", ["--bf16", "false"])[0].precision == "32-true"  # transformers' bf16=False: fp32
    flat, sectioned = tmp_path / "flat.yaml", tmp_path / "sectioned.yaml"
    flat.write_text("learning_rate: 2.0e-3\nnum_train_epochs: 2.0\nbf16: true\nmax_length: 48\n")
    sectioned.write_text(
        "model:\n  model_name_or_path: m\ndata:\n  max_seq_length: 32\n"
        "training:\n  per_device_train_batch_size: 3\n  lr_scheduler_type: cosine\n  learning_rate: 5.0e-4\n"
    )
    args = parse_train_args("sft", ["-c", str(flat)])[0]
    assert (args.max_lr, args.n_epoch, args.precision, args.window_size) == (2e-3, 2, "bf16-mixed", 48)
    args = parse_train_args("sft", ["-c", str(sectioned)])[0]
    assert (args.param_path, args.window_size, args.batch_per_device, args.max_lr) == ("m", 32, 3, 5e-4)
    args = parse_train_args("sft", ["-c", str(flat), "--max_lr", "1e-4"])[0]  # ours on the command line wins
    assert args.max_lr == 1e-4


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--learning_rate", "1", "--max_lr", "2"], "--learning_rate 1 and --max_lr 2 both set --max_lr: give one"),
        (["--lr", "1e-3", "--learning_rate", "1e-3"], "--lr 1e-3 and --learning_rate 1e-3 both set --max_lr: give one"),
        (["--bf16", "--precision", "32-true"], "--bf16 true and --precision 32-true both set --precision: give one"),
        (["--lr", "1e-3", "--lr", "2e-4"], "--lr given twice, 1e-3 and 2e-4: give one"),
        (["--warmup_steps", "3", "--warmup_ratio", "0.1"], "--warmup_ratio 0.1 both set the warmup: give one"),
        (["--num_train_epochs", "0.5"], "--num_train_epochs 0.5: a fraction; ours runs whole epochs (--n_epoch); for"),
        (["--save_steps", "0.25"], "--save_steps 0.25: a fraction; transformers reads a save_steps below 1 as a"),
        (["--warmup_steps", "0.1"], "--warmup_steps 0.1: a fraction; transformers 5 reads a warmup_steps below 1"),
        (["--lr_scheduler_type", "linear"], "linear: not one of ours: --schedule_type takes cosine (transformers'"),
        (["--lr_scheduler_type", "constant"], "constant: not one of ours; --min_rate 1 keeps any schedule at --max_lr"),
        (["--lr_scheduler_type", "warmup_stable_decay"], "ours; --schedule_type wsd: its decay is quadratic"),
        (["--bf16", "maybe"], "--bf16 maybe: expected true or false (--precision bf16-mixed or 32-true"),
        # by meaning first: another project's name we do not take, answered with ours
        (["--logging_steps", "10"], "unknown flag --logging_steps (every optimizer step is logged (stdout, metric"),
        (["--logging_dir", "x"], "unknown flag --logging_dir (logs are written under --ckpt_dir (ckpt_dir/logs))"),
        (["--dataset_text_field", "body"], "--dataset_text_field (seq reads the column text; another: --data_columns"),
        (["--assistant_only_loss", "true"], "--assistant_only_loss (sft trains every assistant turn whole, its role"),
        (["--torch_dtype", "bfloat16"], "--torch_dtype (the weights load in the run's dtype: --precision bf16-true"),
        (["--eval_steps", "5"], "unknown flag --eval_steps (--val_step, with --val_split holding out a fraction"),
        (["--optim", "adamw_torch"], "unknown flag --optim (--optimizer adamw, muon_adamw (the default), nora_nadamw"),
        (["--adam_beta2", "0.999"], "unknown flag --adam_beta2 (AdamW's betas are (0.9, 0.95) here, not a flag"),
        (["--fp16"], "unknown flag --fp16 (float16 is not offered: --precision bf16-mixed (or --bf16) or 32-true)"),
        # then by spelling, among our flags and the names we take
        (["--logging_step", "10"], "--logging_step (did you mean --logging_steps? Not taken here: every optimizer"),
        (["--learning_rat", "1e-3"], "unknown flag --learning_rat (did you mean --learning_rate?)"),
        (["--no-bf1"], "unknown flag --no-bf1 (did you mean --no-bf16?)"),
    ],
)  # fmt: skip
def test_other_names_mistakes_are_one_line(capsys, argv, message):
    code, err = run_cli(["sft", *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    "content, message",
    [
        ("max_lr: 1.0e-3\nlearning_rate: 1.0e-3\n", "max_lr and learning_rate both set max_lr: give one"),
        ("model:\n  lr: 1.0e-3\ntraining:\n  lr: 2.0e-3\n", "lr given twice, 0.001 and 0.002: give one"),
        ("training:\n  num_train_epochs: 0.5\n", "num_train_epochs 0.5: a fraction; ours runs whole epochs"),
        ("lr_scheduler_type: linear\n", "lr_scheduler_type linear: not one of ours: --schedule_type takes cosine"),
        ("warmup_steps: 3\nwarmup_ratio: 0.1\n", "warmup_steps and warmup_ratio both set the warmup: give one"),
        ("logging_dir: logs\n", "unknown key(s) logging_dir (logs are written under --ckpt_dir (ckpt_dir/logs))"),
        ("learning_rat: 1\n", "unknown key(s) learning_rat (did you mean learning_rate?)"),
    ],
)  # fmt: skip
def test_other_names_mistakes_in_a_recipe_name_the_file(tmp_path, capsys, content, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(content)
    code, err = run_cli(["sft", "-c", str(recipe)], capsys)
    assert code == 2 and err.startswith(f"astrai-fabric: error: {recipe}: ") and message in err, err


def test_a_later_warmup_replaces_the_other_kind_and_the_plan_shows_our_names(tmp_path, capsys):
    """--warmup_steps over a recipe's warmup_ratio replaces it (and the schedule takes it); other names are said
    once, and the plan speaks ours."""
    recipe = str(ROOT / "recipes" / "tiny-seq.yaml")  # warmup_ratio 0.05
    argv = ["seq", "-c", recipe, "--learning_rate", "2e-3", "--warmup_steps", "3", "--max_steps", "20"]
    assert parse_train_args("seq", argv[1:])[0].warmup_ratio is None
    assert main([*argv, "--output_dir", str(tmp_path / "out"), "--dry_run"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert (
        "read as ours: --learning_rate as --max_lr, --output_dir as --ckpt_dir (the plan uses our names)"
        in captured.err
    )
    plan = captured.out
    assert "-> max_steps 20 optimizer steps over 1 epoch(s) (max_steps sets the length" in plan, plan
    assert "n_epoch is not read), 3 of them warmup" in plan
    assert "schedule     cosine: 3 warmup steps, then decay over 17 to 0.01x, peak learning rate 0.002" in plan
    assert f"  outputs      {tmp_path / 'out'}:" in plan


def test_the_docs_list_every_name_taken_and_every_name_answered():
    from astrai_fabric.config.aliases import ALIASES, NOT_TAKEN

    page = (ROOT / "docs" / "coming-from-trl.md").read_text()
    assert [name for name in [*ALIASES, *NOT_TAKEN] if f"`--{name}`" not in page] == []


def test_each_train_type_s_help_lists_its_own_flags_and_the_names_taken(capsys):
    text, flags = {}, {}
    for train_type in ("sft", "dpo", "grpo"):
        with pytest.raises(SystemExit) as exit_:
            main([train_type, "--help"])
        assert exit_.value.code == 0
        text[train_type] = capsys.readouterr().out
        flags[train_type] = set(re.findall(r"^  (--\w+)", text[train_type], flags=re.MULTILINE))  # the options listed
    sft, dpo, grpo = flags["sft"], flags["dpo"], flags["grpo"]
    assert {"--packing", "--max_lr", "--window_size"} <= sft and not {
        "--dpo_beta",
        "--grpo_kl_coef",
        "--rollout_top_p",
    } & sft
    assert {"--dpo_beta", "--rollout_top_p", "--reward_model"} <= dpo and not {"--packing", "--grpo_kl_coef"} & dpo
    assert {"--grpo_kl_coef", "--rollout_top_p"} <= grpo and not {"--dpo_beta", "--kto_beta", "--packing"} & grpo
    assert all("--learning_rate, --lr (--max_lr)" in " ".join(shown.split()) for shown in text.values())
    parse_train_args("sft", ["--dpo_beta", "0.2"])  # accepted all the same: AstrAI takes every flag everywhere


def test_download_offline_says_it_found_the_model_in_the_cache(tmp_path, monkeypatch, capsys):
    """Offline, download fetches nothing: it says so rather than 'downloaded'. The cache is laid out as
    huggingface_hub writes one (blobs, a snapshot of links, refs/main); nothing is downloaded here."""
    import hashlib
    import os

    from astrai_fabric.assets import TINY_MODEL_DIR

    commit = "0123456789abcdef0123456789abcdef01234567"
    repository = tmp_path / "hub" / "models--org--tiny"
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text(commit)
    for path in TINY_MODEL_DIR.iterdir():
        data = path.read_bytes()
        blob = repository / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(data)
        link = repository / "snapshots" / commit / path.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["download", "org/tiny"]) == 0
    out = capsys.readouterr().out
    snapshot = repository / "snapshots" / commit
    assert out == f"found in the cache, nothing fetched (HF_HUB_OFFLINE=1): org/tiny@{commit} -> {snapshot}\n", out


@pytest.mark.parametrize(
    "spelled, value",
    [("True", True), ("TRUE", True), ("1", True), ("yes", True), ("t", True), ("False", False), ("0", False),
     ("no", False), ("F", False)],
)  # fmt: skip
def test_booleans_are_read_as_transformers_spells_them(tmp_path, spelled, value):
    """``--bf16 True`` as HF scripts write it, and every boolean flag and recipe value likewise (transformers'
    ``string_to_bool``, any case; a recipe's 0 and 1): the same flags as ``true`` and ``false``."""
    args = parse_train_args("sft", ["--packing", spelled, "--bf16", spelled])[0]
    assert args.packing is value and args.precision == ("bf16-mixed" if value else "32-true")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"packing: {int(value)}\nbf16: {spelled if spelled.isalpha() else int(value)}\n")
    args = parse_train_args("sft", ["--config", str(recipe)])[0]
    assert args.packing is value and args.precision == ("bf16-mixed" if value else "32-true")


def test_a_boolean_spelled_otherwise_is_refused(capsys):
    assert main(["sft", "--packing", "maybe", "--dry_run"]) == 2
    assert "packing" in capsys.readouterr().err
