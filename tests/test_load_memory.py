"""Loading without a second copy: tensors read from memory maps, chunk by chunk, straight into their place.

The reference is the plain path (safetensors' ``load_file`` of every shard, ``hf.state_dict_from_hf``, a model
built and copied into); the streamed path must give bit-identical tensors, whole, in chunks, in the boxes a rank
of FSDP reads, and on two real gloo ranks. What memory it saves is checked in a fresh process against its RSS.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from spawn import run_ranks

from astrai_fabric import checkpoint
from astrai_fabric.checkpoint import (
    StoredStateDict,
    empty_model,
    files,
    hf,
    load_checkpoint,
    load_model,
    read_model_config,
)
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import CheckpointError
from astrai_fabric.model import AutoRegressiveLM

LLAMA = dict(
    model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
)  # fmt: skip


def write_hf_llama(directory, config=LLAMA, dtype=torch.bfloat16, shards=2):
    """A random Hugging Face llama directory, sharded, with ``dtype`` on disk: the tensors' names and shapes are
    transformers' (``modeling_llama.py``), written without transformers."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, inter = hidden // heads, config["intermediate_size"]
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config["vocab_size"], hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    generator = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=generator).to(dtype) for k, s in shapes.items()}
    directory.mkdir()
    keys, weight_map = list(tensors), {}
    for n in range(shards):
        file = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[n::shards]}
        save_file(part, str(directory / file))
        weight_map |= dict.fromkeys(part, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def plain_load(directory, dtype):
    """The plain path: every shard into memory, renamed and permuted, copied into a model of ``dtype``."""
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(file)))
    config = read_model_config(directory)
    state = hf.state_dict_from_hf(state, config)
    model = AutoRegressiveLM(config).to(dtype)
    model.load_state_dict(state)
    return model.state_dict()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_hf_llama(tmp_path_factory.mktemp("memory") / "llama")


@pytest.mark.parametrize("chunk", [None, 40], ids=["whole", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_load_equals_the_plain_path_bit_for_bit(llama_dir, monkeypatch, chunk, dtype):
    if chunk is not None:  # 40 elements: one row at a time, rotated q/k tensors one head (8 rows) at a time
        monkeypatch.setattr(files, "_CHUNK_ELEMENTS", chunk)
    streamed = load_model(llama_dir, dtype=dtype).state_dict()
    reference = plain_load(llama_dir, dtype)
    assert streamed.keys() == reference.keys()
    for key, tensor in reference.items():
        assert streamed[key].dtype == dtype and torch.equal(streamed[key], tensor), key


def test_the_default_dtype_is_the_files(llama_dir):
    model = load_model(llama_dir)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    reference = plain_load(llama_dir, torch.bfloat16)
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())


def test_a_box_reads_exactly_that_part_of_the_permuted_tensor(llama_dir, monkeypatch):
    """What one FSDP rank reads: rows not aligned to heads (so a chunk covers whole heads and keeps part)."""
    monkeypatch.setattr(files, "_CHUNK_ELEMENTS", 40)
    state = load_checkpoint(llama_dir, load_extra=False).state_dict
    assert isinstance(state, StoredStateDict)
    for key in ("layers.0.attention.q_proj.weight", "layers.1.attention.k_proj.weight", "embed_tokens.weight"):
        full = state[key]
        for box in (((3, 13), (0, 32)), ((5, 6), (7, 30)), ((0, full.shape[0]), (1, 2)), ((9, 9), (0, 32))):
            part = state.read(key, box=box)
            assert torch.equal(part, full[box[0][0] : box[0][1], box[1][0] : box[1][1]]), (key, box)


def test_a_file_cut_short_after_its_header_was_read_is_named(tmp_path):
    directory = write_hf_llama(tmp_path / "llama", shards=1)
    ckpt = load_checkpoint(directory, load_extra=False)  # headers only
    shard = directory / "model-00001-of-00001.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"safetensors: cannot read '.*', perhaps changed since it was opened"):
        checkpoint.load_model_weights(empty_model(ckpt.model_config()), ckpt.state_dict, source=directory)


def sharded_worker(directory: str, out: str) -> None:
    """On each of 2 FSDP ranks: the trained model and the DPO reference, as a run builds them from weights."""
    from pathlib import Path

    from astrai_fabric.config.train import TrainArgs
    from astrai_fabric.train import build_run_fabric
    from astrai_fabric.train.common import build_model
    from astrai_fabric.train.start import Start, reference_model

    files._CHUNK_ELEMENTS = 40  # chunks that straddle each rank's rows
    args = TrainArgs(param_path=directory, data_root_path="-", parallel_mode="fsdp", nprocs=2, device_type="cpu")
    fabric = build_run_fabric(args)
    fabric.launch()
    weights = load_checkpoint(directory, load_extra=False)
    start = Start(weights.model_config(), weights, None, None)
    trained = build_model(fabric, start, args).module
    reference, _ = reference_model(fabric, start, args)
    for name, model in (("trained", trained), ("reference", reference)):
        local = {k: v.to_local().numel() for k, v in model.state_dict().items()}
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert local["embed_tokens.weight"] < full["embed_tokens.weight"].numel()  # each rank holds a part only
        if fabric.global_rank == 0:
            save_file(full, str(Path(out) / f"{name}.safetensors"))


def test_two_fsdp_ranks_each_read_their_part_and_the_whole_equals_one_process(llama_dir, tmp_path):
    run_ranks(sharded_worker, 2, str(llama_dir), str(tmp_path))
    expected = load_model(llama_dir, dtype=torch.float32).state_dict()
    for name in ("trained", "reference"):
        gathered = load_file(str(tmp_path / f"{name}.safetensors"))
        assert gathered.keys() == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(gathered[key], tensor), (name, key)


MEASURE = r"""
import gc, json, sys, torch
from safetensors.torch import load_file
from astrai_fabric import checkpoint
from astrai_fabric.checkpoint import files

def status(field):
    return int([l for l in open("/proc/self/status") if l.startswith(field)][0].split()[1]) * 1024

small, big = sys.argv[1:3]
checkpoint.load_model(small)  # every import and first use paid before the baselines
results = {}
for how, chunk in (("streamed", 1 << 20), ("whole tensors", 1 << 30), ("plain", None)):
    files._CHUNK_ELEMENTS = chunk
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    base = status("VmRSS")
    if how == "plain":  # for contrast: the whole file mapped and read, then copied into a model
        model = checkpoint.empty_model(checkpoint.read_model_config(big))
        checkpoint.load_model_weights(model, load_file(big + "/model.safetensors"), source=big)
    else:
        model = checkpoint.load_model(big, dtype=torch.float32)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    results[how] = (status("VmHWM") - base) / size
    del model
print(json.dumps(results))
"""


def test_loading_holds_the_model_once_and_one_chunk_beside_it(llama_dir, tmp_path):
    """In a fresh process, peak RSS above the baseline while loading an AstrAI checkpoint (one fp32
    ``model.safetensors``, 150 MB, its embedding and head 64 MB each), as a multiple of the model's size: the
    model plus one 4 MB chunk. For contrast, in the same process: chunks as large as a tensor (the mapped
    embedding beside the model), and the plain path (the whole mapped file beside the model)."""
    config = dict(
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
    )
    model_config = ModelConfig.from_dict(config)
    big = tmp_path / "big"
    big.mkdir()
    shapes = {k: v.shape for k, v in empty_model(model_config).state_dict().items()}
    save_file({k: torch.full(s, 0.5) for k, s in shapes.items()}, str(big / "model.safetensors"))
    (big / "config.json").write_text(json.dumps(model_config.to_dict()))
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(llama_dir), str(big)], capture_output=True, text=True, check=True
    )
    extra = json.loads(out.stdout.splitlines()[-1])
    assert extra["streamed"] <= 1.1, extra
    assert extra["whole tensors"] > 1.3 and extra["plain"] > 1.7, extra
