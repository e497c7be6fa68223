"""Checkpoints cross between AstrAI and astrai_fabric in both directions, checked with AstrAI's own code.

Runs where AstrAI is available (tests/astrai_oracle.py says how it is found; `.ci/run` builds it on every CI run
from the snapshot in ../shared/astrai), skips with the reason elsewhere.

AstrAI runs in real subprocesses with its own interpreter, on real files, three in all (each start costs seconds of
imports): one per module fixture below. Model files both ways (`model_files`); training checkpoints of every train
type both ways through both trainers' CLIs, and a seq parity run (`crossed`); bin shards both ways (`shards`).
docs/astrai-compat.md lists what is checked.
"""

import copy
import dataclasses
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from astrai_oracle import ASTRAI_SRC, needs_astrai, run_astrai, run_astrai_cli
from conftest import tiny_config
from equality import assert_same_training
from torch import Tensor, nn

from astrai_fabric.checkpoint import load_checkpoint, load_model, save_checkpoint
from astrai_fabric.config.command_line import ALIASES, TRAIN_FLAGS
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.optim import OptimArgs, build_optimizer

pytestmark = needs_astrai


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> Path:
    """Model files both ways, in one AstrAI process: our checkpoints (tied and untied) loaded by AstrAI's
    `Checkpoint.load` and strict `AutoModel.from_pretrained`, which computes their logits; and a bf16 checkpoint
    written by AstrAI's `Checkpoint.save`."""
    root = tmp_path_factory.mktemp("model_files")
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 5))
    torch.save(ids, root / "ids.pt")
    for tied in (True, False):
        torch.manual_seed(0)
        model = AutoRegressiveLM(tiny_config(tie_word_embeddings=tied))
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randint(0, 32, (2, 5)))["logits"].sum().backward()
        optimizer.step()
        path = save_checkpoint(
            root / f"tied_{tied}" / "epoch_0_step_1",
            model.state_dict(),
            model.config.to_dict(),
            epoch=0,
            consumed_samples=2,
            meta={"strategy": "seq"},
            extra={"optimizer": optimizer.state_dict()},
        )
        torch.save(model(ids)["logits"].detach(), path.parent / "expected_logits.pt")
    (root / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    run_astrai(f"""
        import torch
        from astrai.config.model_config import AutoRegressiveLMConfig
        from astrai.model.automodel import AutoModel
        from astrai.model.transformer import AutoRegressiveLM
        from astrai.serialization import Checkpoint
        for tied in (True, False):
            path = "{root}/tied_" + str(tied) + "/epoch_0_step_1"
            ckpt = Checkpoint.load(path)
            model = AutoModel.from_pretrained(path)  # strict load
            logits = model(torch.load("{root / "ids.pt"}"))["logits"].detach()
            torch.save({{"counters": [ckpt.epoch, ckpt.consumed_samples], "extra": sorted(ckpt.extra),
                        "class": type(model).__name__, "tied": model.lm_head.weight is model.embed_tokens.weight,
                        "logits": logits}}, "{root}/tied_" + str(tied) + "/astrai_loaded.pt")
        torch.manual_seed(0)
        config = AutoRegressiveLMConfig.from_file("{root / "config.json"}")
        model = AutoRegressiveLM(config).to(torch.bfloat16)  # AstrAI's CLI trains and saves in bf16
        opt = torch.optim.AdamW(model.parameters())
        Checkpoint(state_dict=model.state_dict(), epoch=1, consumed_samples=8, config=config.to_dict(),
                   meta={{"strategy": "sft"}}, extra={{"optimizer": opt.state_dict()}}).save("{root / "astrai_ckpt"}")
    """)
    return root


@pytest.mark.skipif(ASTRAI_SRC is None, reason="AstrAI's source not found (ASTRAI_SRC)")
def test_astrai_command_lines_mean_what_they_meant():
    """``--max_steps`` plans the schedule over the run and ``--stop_after_steps`` stops it: AstrAI's training CLI
    (``scripts/tools/train.py``, read from the snapshot) has neither, so no AstrAI command line changes meaning, and
    every flag it has is one of ours."""
    source = (Path(ASTRAI_SRC) / "scripts" / "tools" / "train.py").read_text()
    astrai_flags = set(re.findall(r"^@opt\(\n\s+\"--([a-z_-]+)\"", source, re.M))  # its click options
    assert len(astrai_flags) > 40  # the parser was found
    assert not astrai_flags & {"max_steps", "stop_after_steps", "max_tokens"}
    assert {ALIASES.get(flag, flag) for flag in astrai_flags} <= TRAIN_FLAGS.names | {"config", "train_type"}


@pytest.mark.parametrize("tied", [True, False])
def test_our_checkpoint_loads_in_astrai(model_files, tied):
    loaded = torch.load(model_files / f"tied_{tied}" / "astrai_loaded.pt", weights_only=True)
    assert (loaded["counters"], loaded["extra"]) == ([0, 2], ["optimizer"])
    assert (loaded["class"], loaded["tied"]) == ("AutoRegressiveLM", tied)
    expected = torch.load(model_files / f"tied_{tied}" / "expected_logits.pt")
    torch.testing.assert_close(loaded["logits"], expected, atol=1e-5, rtol=0)


def test_astrai_checkpoint_loads_here(model_files):
    out_dir = model_files / "astrai_ckpt"
    ckpt = load_checkpoint(out_dir)  # weights_only .pt loading accepts AstrAI's optimizer.pt
    assert (ckpt.epoch, ckpt.consumed_samples, ckpt.format_version) == (1, 8, None)
    model = load_model(out_dir)
    torch.manual_seed(0)
    reference = AutoRegressiveLM(tiny_config()).to(torch.bfloat16)  # same seed, same init as AstrAI
    for key, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key


# --- Training checkpoints cross both ways, checked by what each trainer loaded ----------------------------------
#
# One AstrAI process (tests/astrai_cli_driver.py: AstrAI's own CLI, float32) runs every AstrAI job below; our runs
# call our CLI in-process. Each train type: our run writes a checkpoint; AstrAI's CLI resumes it (--resume) and
# trains on, dumping what its own resume code loaded; our CLI resumes one of AstrAI's checkpoints and trains on,
# and a spy on `fit` records what our resume code loaded. What each side loaded is compared with the files the
# other wrote (exactly: float32 on both sides), and the data position with AstrAI's checkpoint semantics
# (docs/astrai-compat.md): AstrAI's `step_N` holds the state before step N's update but counts N steps of samples
# (B1); AstrAI derives its position from `consumed_samples`, which skips samples after a short batch (B2).

SEED = 7
PEEK = 4  # sample indices compared after each resume
COMMON_FLAGS = [
    "--batch_per_device", "2", "--max_lr", "1e-3", "--random_seed", str(SEED), "--parallel_mode", "none",
    "--nprocs", "1", "--device_type", "cpu", "--backend", "gloo", "--num_workers", "0", "--no-pin_memory",
    "--no-persistent_workers",
]  # fmt: skip
# AstrAI's CLI is patched by the driver. Ours fuses the head with the loss, 5 positions at a time (a ragged last
# chunk in every window): the routes then check the chunked loss against AstrAI's whole-logits one.
OURS_ONLY = ["--precision", "32-true", "--muon_ns_dtype", "float32", "--loss_chunk_size", "5"]


@dataclass(frozen=True)
class Crossing:
    """One route: a train type and optimizer (checkpoint names worked out by hand from the flags; bpd 2, 1 rank)."""

    train_type: str
    num_samples: int
    """Samples an epoch: windows (seq, sft) or records (dpo, grpo)."""
    flags: tuple[str, ...]
    """AstrAI's flags, the same for every run of this type, in both trainers."""
    ours_flags: tuple[str, ...]
    """Our first run's own flags (from the model directory)."""
    ours_checkpoint: str
    """The checkpoint of our first run that AstrAI's CLI resumes."""
    astrai_after: tuple[str, ...]
    """What AstrAI's continuation writes (interval checkpoints hold the state before their step's update, B1)."""
    astrai_source: str
    """The AstrAI checkpoint our CLI resumes."""
    ours_after: tuple[str, ...]
    """What our continuation writes."""
    optimizer: str = "muon_adamw"


CROSSINGS = {
    # 8 windows, 2 steps an epoch: both trainers run 4 steps from the same weights (the parity run below);
    # AstrAI's own step_3 then holds 2 updates (B1).
    "seq": Crossing(
        train_type="seq",
        num_samples=8,
        flags=("--window_size", "32", "--grad_accum_steps", "2", "--n_epoch", "2", "--ckpt_interval", "3"),
        ours_flags=(),
        ours_checkpoint="epoch_1_step_3",
        astrai_after=("epoch_1_step_4",),
        astrai_source="astrai_fresh/epoch_1_step_3",
        ours_after=("epoch_1_step_4",),
    ),
    # Untied model; AstrAI resumes mid-epoch and crosses into epoch 1; we resume AstrAI's step_4 (3 updates).
    "sft": Crossing(
        train_type="sft",
        num_samples=6,
        flags=("--window_size", "16", "--n_epoch", "2", "--ckpt_interval", "2"),
        ours_flags=("--stop_after_steps", "2"),
        ours_checkpoint="epoch_0_step_2",
        astrai_after=("epoch_1_step_4", "epoch_1_step_6"),
        astrai_source="astrai/sft/epoch_1_step_4",
        ours_after=("epoch_1_step_6",),
    ),
    # 5 pairs: epoch 0 ends with a 1-sample batch, so our step_3 (epoch 1, sample 0, AstrAI's consumed_samples 6)
    # resumes in AstrAI one sample into epoch 1 (B2).
    "dpo": Crossing(
        train_type="dpo",
        num_samples=5,
        flags=("--window_size", "64", "--n_epoch", "3", "--ckpt_interval", "3"),
        ours_flags=("--stop_after_steps", "3"),
        ours_checkpoint="epoch_0_step_3",
        astrai_after=("epoch_2_step_6", "epoch_2_step_8"),
        astrai_source="astrai/dpo/epoch_2_step_6",
        ours_after=("epoch_2_step_8",),
    ),
    # 5 groups of 4: AstrAI's step_4 follows the short batch, so we resume it by AstrAI's rule, as AstrAI does (B2).
    "grpo": Crossing(
        train_type="grpo",
        num_samples=5,
        flags=("--window_size", "64", "--n_epoch", "2", "--ckpt_interval", "2"),
        ours_flags=("--stop_after_steps", "2"),
        ours_checkpoint="epoch_0_step_2",
        astrai_after=("epoch_1_step_4", "epoch_1_step_6"),
        astrai_source="astrai/grpo/epoch_1_step_4",
        ours_after=("epoch_1_step_5",),
    ),
}


# AstrAI's other optimizers cross as sft does (untied: lm_head joins the embeddings and norms in the rest's group),
# with the flags both trainers read the same way (not --mano_*/--muon_momentum: AstrAI's Mano reads Muon's, B17).
OPTIMIZER_FLAGS = {
    "nora_nadamw": ("--nora_lr", "2e-3", "--nora_weight_decay", "0.05", "--nora_beta", "0.9"),
    "mano_adamw": ("--weight_decay", "0.05"),
}
for _optimizer, _flags in OPTIMIZER_FLAGS.items():
    CROSSINGS[f"sft_{_optimizer}"] = dataclasses.replace(
        CROSSINGS["sft"],
        flags=(*CROSSINGS["sft"].flags, "--optimizer", _optimizer, *_flags),
        optimizer=_optimizer,
        astrai_source=f"astrai/sft_{_optimizer}/epoch_1_step_4",
    )


def write_model_dir(directory: Path, tied: bool) -> Path:
    """A small model (the bundled tokenizer, a narrower config) with seeded weights, as AstrAI's model dirs are."""
    from safetensors.torch import save_file

    from astrai_fabric.assets import TINY_MODEL_DIR
    from astrai_fabric.config import ModelConfig

    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    config.update(hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    config["tie_word_embeddings"] = tied
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL_DIR / name, directory / name)
    torch.manual_seed(0)
    save_file(AutoRegressiveLM(ModelConfig(**config)).state_dict(), str(directory / "model.safetensors"))
    return directory


def write_crossing_data(root: Path, tokenizer_dir: Path) -> None:
    """seq and sft: bin shards (`prepare`) both trainers read; dpo and grpo: the bundled JSONL (AstrAI's grpo route
    needs a dataset_config.json, which we keep out of our copy)."""
    from astrai_fabric.assets import ASSETS_DIR, SEQ_DATA_DIR
    from astrai_fabric.data.prepare import PipelineConfig, prepare
    from astrai_fabric.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    text = json.loads((SEQ_DATA_DIR / "kjv.jsonl").read_text().splitlines()[0])["text"][:1000]
    chats = [{"prompt": f"Question {i}?", "answer": f"Answer {i}." * (1 + i % 3)} for i in range(9)]
    sources = {
        "seq": ([{"text": text}], [{"field": "text", "action": "train"}]),
        "sft": (chats, [{"field": "prompt", "action": "mask"}, {"field": "answer", "action": "train"}]),
    }
    for train_type, (records, sections) in sources.items():
        (root / f"{train_type}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        config = PipelineConfig.from_dict({"input": {"sections": sections}, "preprocessing": {"min_chars": 0}}, "cfg")
        prepare([root / f"{train_type}.jsonl"], root / train_type, config, tokenizer)
    for train_type, name in [("dpo", "pairs"), ("grpo", "groups")]:
        lines = (ASSETS_DIR / "data" / train_type / f"{name}.jsonl").read_text().splitlines()[:5]
        for folder in {train_type, f"{train_type}_astrai"}:
            (root / folder).mkdir(exist_ok=True)
            (root / folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    sources = {
        "prompts": {"sections": [{"field": "prompt", "action": "mask"}]},
        "responses": {"sections": [{"field": "responses", "action": "train"}], "list_field": True, "mask_key": "masks"},
        "rewards": {"sections": [{"field": "rewards", "action": "value"}]},
    }  # AstrAI's documented grpo config; position ids "none", or its store holds one record (B10)
    dataset_config = {
        "input": {"sources": sources},
        "mask_default": "mask",
        "tokenizer_path": str(tokenizer_dir),
        "output": {"position_ids_mode": "none"},
    }
    (root / "grpo_astrai" / "dataset_config.json").write_text(json.dumps(dataset_config))


def crossing_argv(root: Path, route: str, param_path: Path, ckpt_dir: Path, astrai: bool, *extra: str) -> list:
    train_type = CROSSINGS[route].train_type
    data = root / "data" / (f"{train_type}_astrai" if astrai and train_type == "grpo" else train_type)
    return [
        "--train_type",
        train_type,
        "--data_root_path",
        str(data),
        "--param_path",
        str(param_path),
        "--ckpt_dir",
        str(ckpt_dir),
        *COMMON_FLAGS,
        *CROSSINGS[route].flags,
        *([] if astrai else OURS_ONLY),
        *extra,
    ]


def model_dir(root: Path, route: str) -> Path:
    return root / ("model_untied" if CROSSINGS[route].train_type == "sft" else "model")


@pytest.fixture(scope="module")
def crossed(tmp_path_factory) -> Path:
    """Our first runs, then one AstrAI process: its fresh seq run, its continuation of each of our checkpoints
    (dumping what it loaded), and a probe of its own resume of the checkpoint our CLI will resume."""
    from astrai_fabric.cli import main

    root = tmp_path_factory.mktemp("crossed")
    write_model_dir(root / "model", tied=True)
    write_model_dir(root / "model_untied", tied=False)
    (root / "data").mkdir()
    write_crossing_data(root / "data", root / "model")
    for route, crossing in CROSSINGS.items():
        argv = crossing_argv(root, route, model_dir(root, route), root / "ours" / route, False)
        assert main([*argv, *crossing.ours_flags]) == 0
    jobs = [{"argv": crossing_argv(root, "seq", root / "model", root / "astrai_fresh", True)}]
    for route, crossing in CROSSINGS.items():
        ours = root / "ours" / route / crossing.ours_checkpoint
        argv = crossing_argv(root, route, ours, root / "astrai" / route, True, "--resume")
        jobs.append({"argv": argv, "dump": str(root / f"astrai_loaded_{route}.pt"), "peek": PEEK})
    for route, crossing in CROSSINGS.items():
        copy = root / "probe" / route  # with a tokenizer, which AstrAI's own checkpoints lack (B22)
        argv = crossing_argv(root, route, copy, root / "probe" / f"{route}_run", True, "--resume")
        dump = str(root / f"astrai_probe_{route}.pt")
        copying = [str(root / crossing.astrai_source), str(copy), str(root / "model")]
        jobs.append({"argv": argv, "dump": dump, "peek": PEEK, "probe": True, "copy": copying})
    run_astrai_cli(jobs, root / "jobs.json")
    return root


def assert_same(loaded: Any, saved: Any, where: str = "") -> None:
    """Equal structure and values; tensors bit-equal with the same dtype."""
    if isinstance(saved, Tensor):
        assert isinstance(loaded, Tensor) and loaded.dtype == saved.dtype, where
        assert torch.equal(loaded, saved), where
    elif isinstance(saved, dict):
        assert isinstance(loaded, dict) and sorted(loaded, key=str) == sorted(saved, key=str), (where, loaded, saved)
        for key, value in saved.items():
            assert_same(loaded[key], value, f"{where}.{key}")
    elif isinstance(saved, list | tuple):
        assert isinstance(loaded, list | tuple) and len(loaded) == len(saved), where
        for index, (a, b) in enumerate(zip(loaded, saved, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert loaded == saved, (where, loaded, saved)


def assert_loaded_checkpoint(loaded: dict, checkpoint: Path) -> None:
    """What a trainer loaded equals the files of ``checkpoint`` (read here with safetensors and torch.load)."""
    from safetensors.torch import load_file

    assert_same(loaded["model"], load_file(checkpoint / "model.safetensors"), "model")
    for name in ("optimizer", "scheduler"):
        assert_same(loaded[name], torch.load(checkpoint / f"{name}.pt", weights_only=True), name)


def optimizer_params(model: nn.Module, optimizer: Any) -> dict[str, list[str]]:
    """Our sub-optimizers' parameter names, in their order (the driver dumps AstrAI's the same way)."""
    from astrai_fabric.checkpoint.state import optimizer_parts

    names = {id(param): name for name, param in getattr(model, "module", model).named_parameters()}
    parts = optimizer_parts(getattr(optimizer, "optimizer", optimizer))  # under Fabric's optimizer wrapper
    return {
        part: None if sub is None else [names[id(p)] for group in sub.param_groups for p in group["params"]]
        for part, sub in parts.items()
    }


def checkpoint_names(directory: Path) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in directory.glob("epoch_*_step_*")))


def test_seq_updates_match_astrai(crossed):
    """Parity: 4 optimizer steps of seq (accumulation 2, clipping, Muon + AdamW, cosine), same weights, data and
    flags, both float32: every tensor moved, and ours trained the model AstrAI trained (tests/equality.py)."""
    from safetensors.torch import load_file

    start = load_file(crossed / "model" / "model.safetensors")
    astrai = load_file(crossed / "astrai_fresh" / "epoch_1_step_4" / "model.safetensors")
    ours = load_file(crossed / "ours" / "seq" / "epoch_1_step_4" / "model.safetensors")
    assert sorted(astrai) == sorted(ours) == sorted(start)
    assert [key for key in start if torch.equal(ours[key], start[key])] == []
    assert_same_training(ours, astrai, start)


@pytest.mark.parametrize("route", CROSSINGS)
def test_astrai_trainer_resumes_our_checkpoint(crossed, route):
    """AstrAI's CLI resumes our checkpoint: it loads our weights, optimizer and scheduler states as saved, and its
    position is AstrAI's rule applied to our `consumed_samples` (where we stopped, but after a short batch, B2)."""
    from astrai_fabric.data import ResumableSampler

    crossing = CROSSINGS[route]
    ours = crossed / "ours" / route / crossing.ours_checkpoint
    loaded = torch.load(crossed / f"astrai_loaded_{route}.pt", weights_only=True)
    assert_loaded_checkpoint(loaded, ours)
    # optimizer.pt indexes parameters by position in each sub-optimizer: AstrAI's order must be the one ours saved in.
    model = load_model(ours)
    optimizer = build_optimizer(model, OptimArgs(crossing.optimizer, 1e-3, 0.1))
    assert loaded["optimizer_params"] == optimizer_params(model, optimizer)

    meta = json.loads((ours / "meta.json").read_text())
    saved = meta["resume_position"]
    assert loaded["num_samples"] == crossing.num_samples
    assert (loaded["consumed_samples"], loaded["optimizer_step"]) == (meta["consumed_samples"], saved["optimizer_step"])
    epoch, index = divmod(meta["consumed_samples"], crossing.num_samples)  # AstrAI's rule, 1 rank
    assert (loaded["sampler_epoch"], loaded["sampler_iter"]) == (epoch, index)
    order = ResumableSampler(crossing.num_samples, seed=SEED).epoch_indices(epoch)
    assert loaded["next_indices"] == order[index:][:PEEK]
    exact = (epoch, index) == (saved["epoch"], saved["sample_index"])
    assert exact is (crossing.train_type != "dpo")  # dpo's checkpoint follows a short batch: AstrAI skips a sample (B2)

    assert checkpoint_names(crossed / "astrai" / route) == crossing.astrai_after  # and it trained on


@pytest.mark.parametrize("route", CROSSINGS)
def test_we_resume_astrai_trainer_checkpoint(crossed, route, monkeypatch):
    """Our CLI resumes AstrAI's checkpoint: our real resume path (the CLI, a spy on `fit` records the loaded state
    before training) loads AstrAI's weights, optimizer and scheduler states as saved, and starts at the position
    AstrAI's own resume of that checkpoint starts at (its probe), B1's off-by-one included."""
    import astrai_fabric.train.common as common
    from astrai_fabric.cli import main

    crossing = CROSSINGS[route]
    source = crossed / crossing.astrai_source
    loaded = {}
    real_fit = common.fit

    def recording_fit(fabric, *, state, sampler, **rest):
        model, optimizer, position = state.model, state.optimizer, state.position
        loaded.update(
            model={k: v.detach().clone() for k, v in model.state_dict().items()},
            optimizer=copy.deepcopy(optimizer.state_dict()),
            scheduler=copy.deepcopy(state.scheduler.state_dict()),
            position=dataclasses.replace(position),
            next_indices=sampler.epoch_indices(position.epoch)[position.sample_index :][:PEEK],
            optimizer_params=optimizer_params(model, optimizer),
        )
        return real_fit(fabric, state=state, sampler=sampler, **rest)

    monkeypatch.setattr(common, "fit", recording_fit)
    back = crossed / "back" / route
    tokenizer = ("--tokenizer_path", str(crossed / "model"))  # AstrAI's checkpoints hold none (B22)
    argv = crossing_argv(crossed, route, source, back, False, "--resume", *tokenizer)
    assert main(argv) == 0
    assert_loaded_checkpoint(loaded, source)

    probe = torch.load(crossed / f"astrai_probe_{route}.pt", weights_only=True)
    position = loaded["position"]
    assert (position.epoch, position.sample_index) == (probe["sampler_epoch"], probe["sampler_iter"])
    assert (position.optimizer_step, position.consumed_samples) == (probe["optimizer_step"], probe["consumed_samples"])
    assert loaded["next_indices"] == probe["next_indices"]
    assert loaded["scheduler"]["last_epoch"] == position.optimizer_step - 1  # B1: AstrAI saved before the update
    # optimizer.pt indexes parameters by position in each sub-optimizer: the same order means the same parameter.
    assert loaded["optimizer_params"] == probe["optimizer_params"]

    assert checkpoint_names(back) == crossing.ours_after  # and we trained on


SHARD_RECORDS = [{"prompt": f"Question {i}?", "answer": f"Answer {i}." * (1 + i % 3)} for i in range(12)]
SHARD_TEXTS = [{"text": "In the beginning God created the heaven and the earth. " * 5},
               {"text": "And the earth was without form, and void. " * 4}]  # fmt: skip
SHARD_SECTIONS = {
    "sft": [{"field": "prompt", "action": "mask"}, {"field": "answer", "action": "train"}],
    "seq": [{"field": "text", "action": "train"}],
}
SHARD_WINDOWS = {"sft": (16, None), "seq": (16, 12)}  # (window_size, stride): seq windows overlap


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Bin shards both ways, in one AstrAI process: `astrai-fabric prepare` output (one shard and several) read by
    AstrAI's DatasetFactory/MmapStore; and AstrAI's own preprocessing (astrai.preprocessing.Pipeline, default
    options: int32 masks) of the same records, windowed by AstrAI's datasets."""
    from astrai_fabric.assets import TINY_MODEL_DIR
    from astrai_fabric.data.prepare import PipelineConfig, prepare
    from astrai_fabric.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("shards")
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SHARD_RECORDS))
    (root / "seq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SHARD_TEXTS))
    for name, max_tokens in [("one", 10_000), ("many", 40)]:
        config = {
            "input": {"sections": SHARD_SECTIONS["sft"]},
            "preprocessing": {"min_chars": 0},
            "output": {"max_tokens_per_shard": max_tokens},
        }
        prepare(
            [root / "sft.jsonl"],
            root / name,
            PipelineConfig.from_dict(config, "cfg"),
            Tokenizer.from_dir(TINY_MODEL_DIR),
        )
    assert len(list((root / "many").glob("*/shard_*"))) == 3
    run_astrai(f"""
        import glob, torch
        from astrai.config.preprocess_config import PipelineConfig
        from astrai.dataset.dataset import DatasetFactory
        from astrai.preprocessing.pipeline import Pipeline
        one = DatasetFactory.load("sft", "{root / "one"}", window_size=16, storage_type="bin")
        many = DatasetFactory.load("sft", "{root / "many"}", window_size=16, storage_type="bin").store
        order = [p.split("/")[-2] for p in glob.glob("{root / "many"}/**/meta.json", recursive=True)]
        streams = {{key: many.fetch(0, many.token_count, key) for key in many.keys}}
        torch.save([[one[i] for i in range(len(one))], order, streams], "{root / "astrai.pt"}")
        own = {{}}
        for train_type, sections in {SHARD_SECTIONS!r}.items():
            options = {{"input": {{"sections": sections}}, "preprocessing": {{"min_chars": 0}}}}
            config = PipelineConfig.from_dict(options)
            Pipeline(config=config, input_paths=["{root}/" + train_type + ".jsonl"],
                     output_dir="{root}/astrai_" + train_type, tokenizer_path="{TINY_MODEL_DIR}").run()
            window, stride = {SHARD_WINDOWS!r}[train_type]
            dataset = DatasetFactory.load(train_type, "{root}/astrai_" + train_type, window_size=window,
                                          stride=stride, storage_type="bin")
            own[train_type] = [dataset[i] for i in range(len(dataset))]
        torch.save(own, "{root / "astrai_own.pt"}")
    """)
    return root


def test_prepared_shards_load_in_astrai(shards):
    """`astrai-fabric prepare` output read by AstrAI's own DatasetFactory/MmapStore: one shard yields exactly our
    training windows; several shards yield the same streams, concatenated in AstrAI's (filesystem) order."""
    import numpy as np

    from astrai_fabric.data import load_window_dataset

    windows, order, streams = torch.load(shards / "astrai.pt")
    ours = load_window_dataset("sft", shards / "one", window_size=16, stride=None, tokenizer=None)
    assert len(windows) == len(ours) > 3
    for index, sample in enumerate(windows):
        for key, value in sample.items():
            assert ours[index][key].tolist() == value.tolist(), (index, key)
    assert sorted(streams) == ["loss_mask", "position_ids", "sequence"]
    for key, stream in streams.items():
        dtype = json.loads((shards / "many" / "__default__" / "shard_0000" / "meta.json").read_text())[key]["dtype"]
        files = [np.fromfile(shards / "many" / "__default__" / shard / f"{key}.bin", dtype=dtype) for shard in order]
        assert stream.tolist() == np.concatenate(files).tolist(), key


@pytest.mark.parametrize("train_type", SHARD_WINDOWS)
def test_astrai_preprocessed_shards_load_here(shards, train_type):
    """AstrAI's own preprocessing output (int32 loss masks, its layout) read by our datasets: the same windows,
    key by key, as AstrAI's datasets cut from it (seq with a stride shorter than the window)."""
    from astrai_fabric.data import load_window_dataset

    window, stride = SHARD_WINDOWS[train_type]
    theirs = torch.load(shards / "astrai_own.pt")[train_type]
    ours = load_window_dataset(train_type, shards / f"astrai_{train_type}", window, stride, tokenizer=None)
    assert len(ours) == len(theirs) > 3
    for index, sample in enumerate(theirs):
        assert sorted(ours[index]) == sorted(sample), index
        for key, value in sample.items():
            assert ours[index][key].tolist() == value.tolist(), (index, key)
