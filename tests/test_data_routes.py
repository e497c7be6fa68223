"""AstrAI's two data routes the CLI must take unchanged: seq/sft from bin shards with a model directory that holds no
tokenizer (AstrAI's ``save_pretrained`` writes none), and a ``dataset_config.json`` beside JSONL records, whose token
ids are checked against AstrAI's own ``DatasetFactory`` (run by AstrAI's interpreter, the oracle) on the same
records."""

import json
import shutil
from pathlib import Path

import pytest

from astrai_fabric.assets import TINY_MODEL_DIR, resolve
from astrai_fabric.cli import main
from astrai_fabric.data.dataset_config import read_dataset_config, render_group, render_pair, render_stream
from astrai_fabric.data.prepare import PipelineConfig, prepare
from astrai_fabric.data.records import GroupDataset, PreferenceDataset, collate_preferences
from astrai_fabric.data.storage import read_jsonl
from astrai_fabric.tokenizer import Tokenizer
from tests.astrai_oracle import needs_astrai, run_astrai
from tests.test_hostile_input import DPO_CONFIG, GRPO_CONFIG, SFT_CONFIG

TOKENIZER = Tokenizer.from_dir(TINY_MODEL_DIR)
WARNING = "warning: no tokenizer ("


def test_seq_and_sft_on_bin_shards_train_and_resume_without_a_tokenizer(tmp_path, capsys):
    (tmp_path / "model").mkdir()  # what AstrAI's save_pretrained leaves: config.json (+ weights), no tokenizer
    shutil.copy(TINY_MODEL_DIR / "config.json", tmp_path / "model")
    chat = PipelineConfig.from_dict(SFT_CONFIG, "sft.json")
    prepare([resolve("bundled:data/sft") / "tasks.jsonl"], tmp_path / "shards", chat, TOKENIZER)
    run = [
        "sft",
        "--data_root_path",
        str(tmp_path / "shards"),
        "--window_size",
        "16",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--ckpt_dir",
        str(tmp_path / "run"),
    ]

    assert main([*run, "--param_path", str(tmp_path / "model"), "--max_steps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count(WARNING) == 1, out  # once, in the run's summary
    first = tmp_path / "run" / "epoch_0_step_1"
    assert (
        not list(first.glob("tokenizer*")) and (first / "model.safetensors").is_file()
    )  # a run without one writes none

    # The tokenizer-less checkpoint resumes (AstrAI's --resume: param_path is the checkpoint); the dry run says so.
    resume = [*run, "--param_path", str(first), "--resume", "--max_steps", "2"]
    assert main([*resume, "--dry_run"]) == 0
    assert "tokenizer    none (" in capsys.readouterr().out
    assert main(resume) == 0
    assert "  resume       from " in capsys.readouterr().out
    assert not list((tmp_path / "run" / "epoch_0_step_2").glob("tokenizer*"))


def sft_records() -> list[dict]:
    return [json.loads(line) for line in (resolve("bundled:data/sft") / "tasks.jsonl").read_text().splitlines()[:12]]


def pairs() -> list[dict]:
    records = [json.loads(line) for line in (resolve("bundled:data/dpo") / "pairs.jsonl").read_text().splitlines()]
    asked = [{"role": "user", "content": r["prompt"]} for r in records[:10]]
    return [
        {k: [q, {"role": "assistant", "content": r[k]}] for k in ("chosen", "rejected")}
        for q, r in zip(asked, records, strict=False)
    ]


def groups() -> list[dict]:
    records = [json.loads(line) for line in (resolve("bundled:data/grpo") / "groups.jsonl").read_text().splitlines()]
    return [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in records[:10]]


def data_dir(root: Path, name: str, config: dict, records: list[dict]) -> Path:
    """A JSONL directory with AstrAI's dataset_config.json and the tiny tokenizer inside (AstrAI's default)."""
    directory = root / name
    directory.mkdir()
    (directory / "dataset_config.json").write_text(json.dumps(config))
    (directory / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL_DIR / file, directory)
    return directory


@needs_astrai
def test_dataset_config_token_ids_equal_astrais(tmp_path):
    dirs = {
        "sft": data_dir(tmp_path, "sft", SFT_CONFIG, sft_records()),
        "dpo": data_dir(tmp_path, "dpo", DPO_CONFIG, pairs()),
        "grpo": data_dir(tmp_path, "grpo", GRPO_CONFIG, groups()),
        # AstrAI's default position_ids_mode with sources: the bug we refuse (one record trained)
        "dpo_default": data_dir(tmp_path, "dpo_default", {**DPO_CONFIG, "output": {}}, pairs()),
    }
    # The reference: AstrAI's DatasetFactory on the same directories, its dataset_config.json route (no
    # tokenizer_path argument, so the file and the tokenizer beside the records decide), every sample's ids and masks.
    reference = json.loads(
        run_astrai(f"""
        import json
        from astrai.dataset import DatasetFactory
        dirs = {json.dumps({k: str(v) for k, v in dirs.items()})}
        sft = DatasetFactory.load("sft", load_path=dirs["sft"], window_size=16)
        stream = {{k: sft.store.fetch(0, sft.store.token_count, k).tolist()
                   for k in ("sequence", "loss_mask", "position_ids")}}
        dpo = DatasetFactory.load("dpo", load_path=dirs["dpo"])
        grpo = DatasetFactory.load("grpo", load_path=dirs["grpo"])
        print(json.dumps({{
            "sft": stream,
            "dpo": [{{k: v.tolist() for k, v in dpo[i].items()}} for i in range(len(dpo))],
            "grpo": [{{"prompts": s["prompts"].tolist(), "responses": [r.tolist() for r in s["responses"]],
                       "masks": [m.tolist() for m in s["masks"]], "rewards": s["rewards"].tolist()}}
                      for s in (grpo[i] for i in range(len(grpo)))],
            "dpo_default_len": len(DatasetFactory.load("dpo", load_path=dirs["dpo_default"])),
        }}))
        """)
    )
    assert reference["dpo_default_len"] == 1  # AstrAI trains one of 10 pairs: why that config is refused here

    config = read_dataset_config(dirs["sft"], "sft")
    stream, dropped = render_stream(config, TOKENIZER, read_jsonl(dirs["sft"]))
    assert not dropped
    assert {k: v.tolist() for k, v in stream.items()} == {
        **reference["sft"],
        "loss_mask": [bool(m) for m in reference["sft"]["loss_mask"]],
    }

    config = read_dataset_config(dirs["dpo"], "dpo")
    dataset = PreferenceDataset(
        read_jsonl(dirs["dpo"]), TOKENIZER, 256, lambda r, w: render_pair(config, TOKENIZER, r, w)
    )
    assert len(dataset) == len(reference["dpo"]) == 10
    for ours, theirs in zip(dataset.samples, reference["dpo"], strict=True):
        assert ours.prompt_ids == []
        assert ours.response_ids == [theirs["chosen"], theirs["rejected"]]
        assert ours.masks() == [[int(m) for m in theirs[k]] for k in ("chosen_mask", "rejected_mask")]
    batch = collate_preferences(dataset.samples[:2], pad_id=0)  # what the loss sees: AstrAI's masks, padded
    first = reference["dpo"][0]
    assert batch["loss_mask"][0, 1, : len(first["rejected"])].tolist() == first["rejected_mask"]

    config = read_dataset_config(dirs["grpo"], "grpo")
    dataset = GroupDataset(read_jsonl(dirs["grpo"]), TOKENIZER, 256, lambda r, w: render_group(config, TOKENIZER, r, w))
    assert len(dataset) == len(reference["grpo"]) == 10
    for (ours, rewards), theirs in zip(dataset.samples, reference["grpo"], strict=True):
        assert ours.prompt_ids == theirs["prompts"] and ours.response_ids == theirs["responses"]
        assert ours.masks() == [[int(m) for m in mask] for mask in theirs["masks"]]
        assert rewards == pytest.approx(theirs["rewards"], rel=1e-7)  # AstrAI holds them in float32


def test_dpo_and_grpo_train_from_a_dataset_config_through_the_cli(tmp_path, capsys):
    common = [
        "--param_path",
        "bundled:tiny",
        "--window_size",
        "64",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--max_steps",
        "1",
    ]
    for kind, config, records in (("dpo", DPO_CONFIG, pairs()), ("grpo", GRPO_CONFIG, groups())):
        data = data_dir(tmp_path, kind, config, records)
        assert main([kind, *common, "--data_root_path", str(data), "--ckpt_dir", str(tmp_path / f"{kind}-run")]) == 0
        assert f"records rendered by {data / 'dataset_config.json'}" in capsys.readouterr().out
