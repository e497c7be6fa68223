"""AstrAI checkpoint directories: exact round trips, atomic writes, strict and safe loads."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file, save_file

from astrai_fabric.checkpoint import (
    FORMAT_KEY,
    find_latest_checkpoint,
    load_checkpoint,
    load_model,
    load_model_weights,
    prune_checkpoints,
    remove_stale_staging,
    save_checkpoint,
)
from astrai_fabric.errors import CheckpointError, ConfigError
from astrai_fabric.model import AutoRegressiveLM


def save_tiny(path, model, **kwargs):
    return save_checkpoint(path, model.state_dict(), model.config.to_dict(), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, tiny_model, dtype):
    tiny_model.to(dtype)
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4)}}, "param_groups": [{"lr": 0.1}]}
    path = save_tiny(
        tmp_path / "epoch_0_step_3",
        tiny_model,
        epoch=0,
        consumed_samples=12,
        meta={"strategy": "seq"},
        extra={"optimizer": optimizer},
        files={"notes.txt": "hello", "raw.bin": b"\x00\x01"},
    )
    ckpt = load_checkpoint(path)
    assert set(ckpt.state_dict) == set(tiny_model.state_dict())
    for key, tensor in tiny_model.state_dict().items():
        assert ckpt.state_dict[key].dtype == dtype and torch.equal(ckpt.state_dict[key], tensor), key
    assert (ckpt.epoch, ckpt.consumed_samples, ckpt.format_version) == (0, 12, 1)
    assert torch.equal(ckpt.extra["optimizer"]["state"][0]["exp_avg"], optimizer["state"][0]["exp_avg"])
    assert ckpt.config == tiny_model.config.to_dict()
    assert (path / "notes.txt").read_text() == "hello\n" and (path / "raw.bin").read_bytes() == b"\x00\x01"


def test_meta_json_layout_is_astrai_first(tmp_path, tiny_model):
    path = save_tiny(tmp_path / "ckpt", tiny_model, epoch=2, consumed_samples=40, meta={"strategy": "sft"})
    meta = json.loads((path / "meta.json").read_text())
    assert list(meta)[:4] == ["epoch", "consumed_samples", "timestamp", "strategy"]
    assert list(meta)[-1] == FORMAT_KEY and meta[FORMAT_KEY]["format_version"] == 1
    assert len(meta["timestamp"]) == 19 and meta["timestamp"][10] == "T"  # %Y-%m-%dT%H:%M:%S
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "meta.json", "model.safetensors"]


def test_load_model_rebuilds_an_equal_tied_model(tmp_path, tiny_model):
    path = save_tiny(tmp_path / "ckpt", tiny_model)
    loaded = load_model(path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    ids = torch.randint(0, 32, (2, 5))
    torch.testing.assert_close(loaded(ids)["logits"], tiny_model(ids)["logits"], atol=0, rtol=0)


def test_existing_checkpoint_is_never_overwritten_by_default(tmp_path, tiny_model):
    path = save_tiny(tmp_path / "ckpt", tiny_model, consumed_samples=1)
    with pytest.raises(CheckpointError, match="already exists"):
        save_tiny(path, tiny_model, consumed_samples=2)
    assert load_checkpoint(path).consumed_samples == 1
    save_tiny(path, tiny_model, consumed_samples=3, overwrite=True)
    assert load_checkpoint(path).consumed_samples == 3
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging or retired directory left behind


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full")  # stands in for a failure half-way through a save


def test_interrupted_save_leaves_nothing_and_keeps_the_old_checkpoint(tmp_path, tiny_model):
    path = save_tiny(tmp_path / "ckpt", tiny_model, consumed_samples=1)
    with pytest.raises(RuntimeError, match="disk full"):
        save_tiny(path, tiny_model, consumed_samples=2, extra={"optimizer": Unpicklable()}, overwrite=True)
    with pytest.raises(RuntimeError, match="disk full"):
        save_tiny(tmp_path / "new", tiny_model, extra={"optimizer": Unpicklable()})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert load_checkpoint(path).consumed_samples == 1


def test_plain_model_directory_loads_like_astrai_load_any(tmp_path, tiny_model):
    (tmp_path / "config.json").write_text(json.dumps(tiny_model.config.to_dict()))
    save_file(tiny_model.state_dict(), str(tmp_path / "model.safetensors"))
    ckpt = load_checkpoint(tmp_path)
    assert not ckpt.is_training_checkpoint and (ckpt.epoch, ckpt.consumed_samples) == (0, 0)
    assert ckpt.format_version is None
    load_model(tmp_path)


SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def write_sharded(directory, model, weight_map_change=None) -> dict[str, str]:
    """``model`` saved as two shards and their index in ``directory`` (``weight_map_change(weight_map)`` applied
    before the index is written); returns the shards' keys."""
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    keys = sorted(state)
    shards = {SHARD_1: keys[:5], SHARD_2: keys[5:]}
    for name, shard_keys in shards.items():
        save_file({k: state[k] for k in shard_keys}, str(directory / name))
    weight_map = {k: name for name, shard_keys in shards.items() for k in shard_keys}
    if weight_map_change is not None:
        weight_map_change(weight_map)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))
    return weight_map


def test_sharded_safetensors_index(tmp_path, tiny_model):
    write_sharded(tmp_path / "m", tiny_model)
    assert set(load_checkpoint(tmp_path / "m").state_dict) == set(tiny_model.state_dict())


def _move_out(m, name: str) -> None:
    """Shard ``name`` moved beside the model directory (a valid file, so only where it lies is wrong)."""
    (m / name).rename(m.parent / "outside.safetensors")


def _first_key(m) -> str:
    return sorted(json.loads((m / "model.safetensors.index.json").read_text())["weight_map"])[0]


def _edit_index(m, change) -> None:
    index = json.loads((m / "model.safetensors.index.json").read_text())
    change(index["weight_map"])
    (m / "model.safetensors.index.json").write_text(json.dumps(index))


INDEX_HAZARDS = [
    # id, change(model directory), message
    ("a-key-its-shard-lacks", lambda m: _edit_index(m, lambda w: w.update({"ghost.weight": SHARD_1})),
     f"model.safetensors.index.json: maps 'ghost.weight' to {SHARD_1}, which does not hold it"),
    ("a-key-in-another-shard", lambda m: _edit_index(m, lambda w: w.update({_first_key(m): SHARD_2})),
     f"{SHARD_1}: holds 'embed_tokens.weight', but model.safetensors.index.json maps it to {SHARD_2}"),
    ("a-tensor-not-listed", lambda m: _edit_index(m, lambda w: w.pop(_first_key(m))),
     "holds 'embed_tokens.weight', but model.safetensors.index.json does not list it"),
    ("a-parent-path", lambda m: (_move_out(m, SHARD_1), _edit_index(m, lambda w: w.update(
        {k: "../outside.safetensors" for k, v in w.items() if v == SHARD_1}))),
     "'weight_map' maps 'embed_tokens.weight' to '../outside.safetensors', expected the file name of a shard"),
    ("an-absolute-path", lambda m: (_move_out(m, SHARD_1), _edit_index(m, lambda w: w.update(
        {k: str(m.parent / "outside.safetensors") for k, v in w.items() if v == SHARD_1}))),
     "expected the file name of a shard beside the index (no path"),
    ("a-link-out", lambda m: (_move_out(m, SHARD_1), (m / SHARD_1).symlink_to(m.parent / "outside.safetensors")),
     "outside the model directory; its files are read only from inside it"),
    ("a-link-out-single", lambda m: (m / "model.safetensors.index.json").unlink() or (m / "model.safetensors")
     .symlink_to(m.parent / "elsewhere.safetensors") or save_file({}, str(m.parent / "elsewhere.safetensors")),
     "model.safetensors: links to "),
    ("a-value-not-a-string", lambda m: _edit_index(m, lambda w: w.update({_first_key(m): [SHARD_1]})),
     "'weight_map' maps 'embed_tokens.weight' to a list, expected the file name of a shard"),
    ("a-tensor-stored-twice", lambda m: save_file({_first_key(m): torch.zeros(32, 16),
                                                   **load_file(m / SHARD_2)}, str(m / SHARD_2)),
     f"{SHARD_2}: holds 'embed_tokens.weight', which {SHARD_1} holds too; each tensor is stored once"),
    ("beside-a-single-file", lambda m: save_file(load_file(m / SHARD_1), str(m / "model.safetensors")),
     "lists shards beside a model.safetensors, so which file holds the model is ambiguous"),
    ("a-fifo", lambda m: ((m / SHARD_2).unlink(), os.mkfifo(m / SHARD_2)), f"{SHARD_2}: is a FIFO, not a file"),
    ("a-link-loop", lambda m: ((m / SHARD_2).unlink(), (m / SHARD_2).symlink_to(SHARD_2)),
     f"{SHARD_2}: a link that cannot be followed"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", [c[1:] for c in INDEX_HAZARDS], ids=[c[0] for c in INDEX_HAZARDS])
def test_a_shard_index_is_read_exactly_or_refused_naming_file_and_key(tmp_path, tiny_model, change, message):
    write_sharded(tmp_path / "m", tiny_model)
    change(tmp_path / "m")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_checkpoint(tmp_path / "m")


def test_links_within_the_directory_or_the_hugging_face_cache_are_followed(tmp_path, tiny_model):
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    write_sharded(snapshot, tiny_model)
    blobs = snapshot.parents[1] / "blobs"
    blobs.mkdir()
    for name in (SHARD_1, SHARD_2, "model.safetensors.index.json"):  # huggingface_hub's layout: links to blobs
        (snapshot / name).rename(blobs / name)
        (snapshot / name).symlink_to(Path("../..") / "blobs" / name)
    (snapshot / "weights").mkdir()
    (snapshot / "weights" / SHARD_2).symlink_to(blobs / SHARD_2)  # a link inside the directory
    (snapshot / SHARD_2).unlink()
    (snapshot / SHARD_2).symlink_to(Path("weights") / SHARD_2)
    assert set(load_checkpoint(snapshot).state_dict) == set(tiny_model.state_dict())
    beside = tmp_path / "beside"  # an index that describes the single file beside it is no ambiguity
    beside.mkdir()
    save_tiny(beside / "ck", tiny_model)
    weight_map = {k: "model.safetensors" for k in tiny_model.state_dict() if k != "lm_head.weight"}
    (beside / "ck" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert set(load_checkpoint(beside / "ck").state_dict) == set(weight_map)


def test_compiled_checkpoint_prefix_is_removed(tmp_path, tiny_model):
    # AstrAI's --compile checkpoints name every key `_orig_mod.<name>` (its bug B3).
    state = {f"_orig_mod.{k}": v for k, v in tiny_model.state_dict().items()}
    save_checkpoint(tmp_path / "ckpt", state, tiny_model.config.to_dict())
    with pytest.warns(UserWarning, match="_orig_mod"):
        assert set(load_checkpoint(tmp_path / "ckpt").state_dict) == set(tiny_model.state_dict())


# --- bad inputs: each one clear error naming the file --------------------------------------------------------


def test_missing_directory_and_missing_config(tmp_path, tiny_model):
    with pytest.raises(CheckpointError, match="no such checkpoint or model directory"):
        load_checkpoint(tmp_path / "absent")
    path = save_tiny(tmp_path / "ckpt", tiny_model)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json: file not found \(expected AstrAI's model config\)"):
        load_checkpoint(path)


def test_config_with_a_wrong_type(tmp_path, tiny_model):
    path = save_tiny(tmp_path / "ckpt", tiny_model)
    config = tiny_model.config.to_dict() | {"num_hidden_layers": "2"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config.json: 'num_hidden_layers' must be int or null, got \"2\""):
        load_model(path)


def test_truncated_safetensors(tmp_path, tiny_model):
    path = save_tiny(tmp_path / "ckpt", tiny_model)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file, perhaps truncated"):
        load_checkpoint(path)


def test_no_weights_at_all(tmp_path, tiny_model):
    (tmp_path / "config.json").write_text(json.dumps(tiny_model.config.to_dict()))
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_checkpoint(tmp_path)


def test_state_dict_mismatches_are_listed_in_one_error(tiny_model):
    state = tiny_model.state_dict()
    del state["layers.0.attention.q_proj.weight"]
    state["layers.9.extra.weight"] = torch.zeros(1)
    state["norm.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as err:
        load_model_weights(AutoRegressiveLM(tiny_config()), state, source="ckpt/model.safetensors")
    message = str(err.value)
    assert message.startswith("ckpt/model.safetensors: does not match the model built from its config.json")
    assert "missing keys [layers.0.attention.q_proj.weight]" in message
    assert "unexpected keys [layers.9.extra.weight]" in message
    assert "wrong shapes [norm.weight (file [3], model [16])]" in message


def test_tied_model_refuses_a_different_lm_head(tiny_model):
    state = tiny_model.state_dict()
    state["lm_head.weight"] = state["embed_tokens.weight"].clone()
    load_model_weights(AutoRegressiveLM(tiny_config()), state, source="x")  # equal: accepted
    state["lm_head.weight"] += 1
    with pytest.raises(CheckpointError, match="differs from embed_tokens.weight"):
        load_model_weights(AutoRegressiveLM(tiny_config()), state, source="x")


def test_pickled_callable_is_refused(tmp_path, tiny_model):
    path = save_tiny(tmp_path / "ckpt", tiny_model)
    torch.save({"hook": print}, path / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"optimizer.pt: refused to load: .*could run code \(Unsupported global"):
        load_checkpoint(path)
    assert load_checkpoint(path, load_extra=False).state_dict  # the weights alone still load


def test_truncated_pt_and_bad_meta(tmp_path, tiny_model):
    path = save_tiny(tmp_path / "ckpt", tiny_model, extra={"scheduler": {"last_epoch": 3}})
    (path / "scheduler.pt").write_bytes((path / "scheduler.pt").read_bytes()[:20])
    with pytest.raises(CheckpointError, match=r"scheduler.pt: cannot be read, perhaps truncated"):
        load_checkpoint(path)
    (path / "scheduler.pt").unlink()
    meta = json.loads((path / "meta.json").read_text()) | {"consumed_samples": "12"}
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta.json: 'consumed_samples' must be a non-negative integer"):
        load_checkpoint(path)


def _cut_short(data: bytes) -> bytes:
    return data[:-10]  # as a copy interrupted by a full disk would be


DAMAGES = {
    "weights": ("model.safetensors", _cut_short),
    "optimizer": ("optimizer.pt", _cut_short),
    "meta": ("meta.json", _cut_short),
    # Hostile rather than cut short: a header that claims 2**62 bytes (reading it would first allocate them), and
    # nesting past the interpreter's recursion limit (Python's JSON parser raises RecursionError, not ValueError).
    "weights-header-size": ("model.safetensors", lambda data: (2**62).to_bytes(8, "little") + data[8:]),
    "meta-nested": ("meta.json", lambda data: b"[" * 100_000 + b"]" * 100_000),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_resume_auto_skips_a_damaged_newest_checkpoint(tmp_path, tiny_model, damage):
    extra = {"optimizer": {"state": {}, "param_groups": []}}
    for step in (2, 4):
        save_tiny(tmp_path / f"epoch_0_step_{step}", tiny_model, meta={"train_type": "seq"}, extra=extra)
    file, change = DAMAGES[damage]
    newest = tmp_path / "epoch_0_step_4" / file
    newest.write_bytes(change(newest.read_bytes()))
    with pytest.warns(UserWarning, match=rf"epoch_0_step_4: skipped, not a complete checkpoint \(.*{file}"):
        assert find_latest_checkpoint(tmp_path) == tmp_path / "epoch_0_step_2"


def test_prune_keeps_the_newest_and_stale_staging_is_cleared(tmp_path, tiny_model):
    for step in (1, 2, 10):
        save_tiny(tmp_path / f"epoch_0_step_{step}", tiny_model)
    (tmp_path / ".epoch_0_step_11.tmp-1234abcd").mkdir()  # a save killed half-way
    (tmp_path / ".epoch_0_step_2.old-1234abcd").mkdir()  # a replaced copy; the replacement is in place
    assert [p.name for p in prune_checkpoints(tmp_path, 2)] == ["epoch_0_step_1"]  # by step, not by name
    assert len(remove_stale_staging(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_0_step_10", "epoch_0_step_2"]
