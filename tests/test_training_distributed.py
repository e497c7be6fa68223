"""DDP and FSDP on 2 real CPU processes (gloo) against one process, and exact resume across world sizes.

One spawn of 2 ranks runs every 2-rank training below in sequence (each process pays Lightning's import once);
the single-process references run in the test process. Global batch is the same everywhere: 2 ranks x 1 sample x
2 micro-batches = 1 rank x 2 samples x 2 micro-batches, and the sampler gives both the same samples per step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from equality import assert_bit_equal, assert_same_training, initial_weights
from safetensors.torch import load_file
from spawn import run_ranks

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.checkpoint import load_checkpoint
from astrai_fabric.cli import main
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.train import run

pytestmark = pytest.mark.slow


def base_args(ckpt_dir: Path, **overrides) -> TrainArgs:
    """3 optimizer steps of the bundled tiny model, with accumulation and clipping that is active (norms ~1-5)."""
    values = dict(
        param_path="bundled:tiny",
        data_root_path="bundled:data/seq",
        train_type="seq",
        ckpt_dir=str(ckpt_dir),
        window_size=32,
        batch_per_device=2,
        grad_accum_steps=2,
        max_steps=3,
        max_lr=2e-3,
        max_grad_norm=0.5,
        warmup_ratio=0.0,
        num_workers=0,
        parallel_mode="none",
        optimizer="adamw",
        muon_ns_dtype="float32",
        random_seed=11,
        ckpt_interval=1000,
    )
    values.update(overrides)
    return TrainArgs(**values)


PARITY_RUNS = {
    f"{mode}_{optimizer}": dict(parallel_mode=mode, optimizer=optimizer)
    for mode in ("ddp", "fsdp")
    for optimizer in ("adamw", "muon_adamw")
}
# FSDP reducing after every micro-batch instead of only at the window's end (less memory, more communication),
# or freeing parameters after each forward, trains the same model.
PARITY_RUNS["fsdp_sync_each_micro_batch"] = dict(
    parallel_mode="fsdp", optimizer="adamw", fsdp_sync_each_micro_batch=True
)
PARITY_RUNS["fsdp_reshard_after_forward"] = dict(
    parallel_mode="fsdp", optimizer="adamw", fsdp_reshard_after_forward=True
)
# The head fused with the loss (--loss_chunk_size): inside the root's forward, so FSDP gathers the head once.
PARITY_RUNS["fsdp_loss_fused"] = dict(parallel_mode="fsdp", optimizer="adamw", loss_chunk_size=7)
BF16_COMPUTE = dict(parallel_mode="fsdp", optimizer="adamw", fsdp_param_dtype="bfloat16", fsdp_reduce_dtype="float32")
# dpo and grpo average per-micro-batch losses (grpo a token mean), so the single process takes the same 1-sample
# micro-batches in sequence: 2 ranks x 1 sample = 1 rank x 1 sample x 2 accumulation.
RL_RUNS = {
    f"{mode}_{train_type}": dict(parallel_mode=mode, train_type=train_type, data_root_path=f"bundled:data/{train_type}")
    for mode in ("ddp", "fsdp")
    for train_type in ("dpo", "grpo")
}
RL_RUNS["fsdp_dpo_loss_fused"] = dict(RL_RUNS["fsdp_dpo"], loss_chunk_size=7)
# Issue 61's methods, each a per-micro-batch mean as grpo's: GSPO with two-sided clipping, SAPO, and RLOO (its
# advantages normalised over the micro-batch, rewards clipped).
GRPO_METHODS = {
    "gspo": dict(grpo_loss="grpo", grpo_importance_sampling_level="sequence", grpo_delta=1.5),
    "sapo": dict(grpo_loss="sapo", grpo_sapo_temperature_pos=1.3),
    "rloo": dict(grpo_advantage="rloo", rloo_normalize_advantages=True, reward_clip_range=(0.0, 0.8)),
}
RL_RUNS |= {
    f"{mode}_grpo_{name}": dict(RL_RUNS[f"{mode}_grpo"], **flags)
    for mode in ("ddp", "fsdp")
    for name, flags in GRPO_METHODS.items()
}
# A reference-free preference loss with an NLL term (a token mean per micro-batch, as the 1-sample ones agree).
RL_RUNS["fsdp_dpo_orpo"] = dict(RL_RUNS["fsdp_dpo"], dpo_loss="orpo")
# A reward model's Bradley-Terry loss is a mean over the micro-batch's pairs, as dpo's; its score head is part of
# the root FSDP unit with the embedding.
RL_RUNS["fsdp_reward_model"] = dict(parallel_mode="fsdp", train_type="reward_model", data_root_path="bundled:data/dpo")
# kto's KL baseline is the mean over every rank's samples (one all-reduce): 2 ranks x 1 sample then equal one
# process's micro-batch of 2 (a per-rank baseline would not).
KTO_RUN = dict(parallel_mode="fsdp", train_type="kto", data_root_path="bundled:data/kto")
# grpo's top-entropy tokens: the entropy quantile is taken over every rank's response tokens (one gather), so 2
# ranks x 1 group equal one process's micro-batch of 2 groups, as kto's baseline (a per-rank quantile would not).
TOP_ENTROPY_RUNS = {
    f"{mode}_grpo_top_entropy": dict(RL_RUNS[f"{mode}_grpo"], grpo_loss="grpo", grpo_top_entropy_quantile=0.5)
    for mode in ("ddp", "fsdp")
}
RL_RUNS |= TOP_ENTROPY_RUNS
ONLINE = dict(train_type="grpo", data_root_path="bundled:data/grpo_online", reward="astrai_fabric.rewards.LengthReward",
              group_size=2, rollout_interval=1, rollout_max_tokens=6, max_steps=2)  # fmt: skip
TP2 = dict(parallel_mode="fsdp", tp_size=2, optimizer="muon_adamw")
TP_RUNS = {"tp2": TP2, "tp2_loss_fused": dict(TP2, loss_chunk_size=7)}  # the head stays whole on the tensor axis
RESUME = dict(max_steps=6, ckpt_interval=3, optimizer="muon_adamw")
SFT = dict(train_type="sft", data_root_path="bundled:data/sft")
# Context parallelism over both ranks (one data-parallel rank: each takes the single process's batch): seq with the
# fused loss (CPU's default) and Muon, sft's packed documents (masks at their boundaries, prompt tokens untrained)
# with the logits path; and the train types whose samples are padded to their batch's longest, which the model pads
# on to an even length: sft without packing, dpo (with its frozen reference, sharded alike), kto, a reward model,
# offline grpo.
CP2 = dict(parallel_mode="fsdp", cp_size=2, optimizer="muon_adamw")
CP_RUNS = {
    "cp2_seq": CP2,
    "cp2_sft": dict(CP2, **SFT, loss_chunk_size=0),
    "cp2_sft_unpacked": dict(CP2, **SFT, packing=False),
    **{
        f"cp2_{kind}": dict(CP2, train_type=kind, data_root_path=f"bundled:data/{kind}")
        for kind in ("dpo", "kto", "grpo")
    },
    "cp2_reward_model": dict(CP2, train_type="reward_model", data_root_path="bundled:data/dpo"),
}
FOUR_RANK_CP_RUNS = ("cp2_seq", "cp2_sft", "cp2_dpo")
"""The train types run on 4 ranks, FSDP 2 x context 2 (``tp_and_fsdp_worker``)."""
# Hugging Face directories (built with transformers in the fixture): Qwen3 (q/k norm before RoPE, heads x head_dim
# != hidden) under FSDP, Qwen2 (q/k/v biases) under tensor parallelism, and the MoE families with their routers'
# aux loss under FSDP: Qwen2-MoE (gated shared expert, a dense layer between MoE layers) and Qwen3-MoE, which also
# runs tensor parallel (experts whole, dense layers split, q/k norms whole with their gradients summed over the
# ranks' heads); OLMo 2 (output norms, a q/k norm over the whole projection) under FSDP, Phi-3 (fused projections
# split on load, partial rotary) under FSDP and tensor parallel, Gemma 2 (soft-capping, sliding-window layers, norms
# around each sublayer) tensor parallel and Gemma 3 (per-head q/k norms, the sliding layers' own RoPE) under FSDP;
# DeepSeek-V3 (latent attention with a
# shared RoPE key, sigmoid group-limited routing whose score-correction bias is a buffer, a dense first layer) under
# FSDP and tensor parallel (heads split in q_proj, kv_b_proj and o_proj; the shared key and the compressed query
# whole). sft averages per-micro-batch token means, so the single process takes the same 1-sample micro-batches in
# sequence (as RL_RUNS do).
FSDP_HF = dict(parallel_mode="fsdp", batch_per_device=1, grad_accum_steps=1)
TP2_HF = dict(parallel_mode="fsdp", tp_size=2, batch_per_device=1, grad_accum_steps=1)
# Expert parallelism over both ranks (each holds half of every MoE layer's experts) for each MoE family: Mixtral,
# Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (sigmoid group-limited routing); each rank's balance loss its own, as under
# FSDP alone, so the single process takes the same 1-sample micro-batches in sequence.
EP2_HF = dict(FSDP_HF, ep_size=2)
# Context parallelism on an MoE family: the balance loss and routing statistics are the whole window's (summed over
# the context group), so the single process takes the same batches (one data rank).
CP2_HF = dict(FSDP_HF, cp_size=2)
HF_RUNS = {"hf_qwen3_fsdp": FSDP_HF, "hf_qwen2_tp2": TP2_HF, "hf_qwen2_moe_fsdp": FSDP_HF,
           "hf_qwen3_moe_fsdp": FSDP_HF, "hf_qwen3_moe_tp2": TP2_HF, "hf_olmo2_fsdp": FSDP_HF,
           "hf_phi3_fsdp": FSDP_HF, "hf_phi3_tp2": TP2_HF, "hf_gemma2_tp2": TP2_HF,
           "hf_gemma3_text_fsdp": FSDP_HF, "hf_deepseek_v3_fsdp": FSDP_HF,
           "hf_deepseek_v3_tp2": TP2_HF, "hf_mixtral_ep2": EP2_HF, "hf_qwen2_moe_ep2": EP2_HF,
           "hf_qwen3_moe_ep2": EP2_HF, "hf_deepseek_v3_ep2": EP2_HF, "hf_qwen3_moe_cp2": CP2_HF}  # fmt: skip
HF_REFERENCES = {"fsdp": dict(batch_per_device=1, grad_accum_steps=2),
                 "tp2": dict(batch_per_device=1, grad_accum_steps=1),
                 "ep2": dict(batch_per_device=1, grad_accum_steps=2),
                 "cp2": dict(batch_per_device=1, grad_accum_steps=1)}  # fmt: skip
EP_TRAIN_TYPES = ("seq", "dpo")
"""The other train types under expert parallelism (Qwen3-MoE; sft is among ``HF_RUNS``)."""
EP_LORA = dict(EP2_HF, lora_r=4, lora_targets=["up", "gate", "down", "q_proj"])
"""LoRA under expert parallelism: adapters on every expert's projections travel with their expert."""
EP_RESUME = dict(EP2_HF, grad_accum_steps=2, max_steps=4, ckpt_interval=2, optimizer="muon_adamw")
"""An expert-parallel run whose step-2 checkpoint is resumed at ep 1 (one process) and ep 4 (4 ranks): 4 samples a
step in each layout; Muon orthogonalises each rank's experts, the rest spread over the ranks."""
"""The single process's batches for a 2-rank run, by its layout (the run's name ends with it)."""


def hf_model_type(name: str) -> str:
    """The model_type (and directory) of an ``HF_RUNS`` entry: ``hf_<model_type>_<layout>``."""
    return name.removeprefix("hf_").rpartition("_")[0]


def hf_args(root: Path, name: str, ckpt_dir: Path, **overrides) -> TrainArgs:
    model = root / hf_model_type(name)
    return base_args(
        ckpt_dir, **SFT | dict(param_path=str(model), tokenizer_path="bundled:tiny", max_steps=2) | overrides
    )


def ep_train_type(train_type: str) -> dict:
    """A 2-rank expert-parallel run of ``train_type`` (``EP_TRAIN_TYPES``)."""
    return dict(EP2_HF, train_type=train_type, data_root_path=f"bundled:data/{train_type}")


def write_hf_models(root: Path) -> None:
    """Tiny random Qwen3, Qwen2, Qwen3-MoE, Qwen2-MoE, Mixtral, OLMo 2, Phi-3, Gemma 2, Gemma 3 and DeepSeek-V3
    directories, as transformers saves them (skipped without transformers)."""
    try:
        from test_huggingface import CASES, build_hf, save_hf
    except pytest.skip.Exception:
        return
    sizes = dict(
        vocab_size=json.loads((TINY_MODEL_DIR / "config.json").read_text())["vocab_size"], max_position_embeddings=256
    )
    save_hf(build_hf("Qwen3Config", head_dim=16, **sizes), root / "qwen3")
    save_hf(build_hf("Qwen2Config", **sizes), root / "qwen2")
    for model_type in ("qwen3_moe", "qwen2_moe", "mixtral", "olmo2", "phi3", "gemma2", "gemma3_text", "deepseek_v3"):
        config_class, fields, _, _ = CASES[model_type]
        save_hf(build_hf(config_class, **fields, **sizes), root / model_type)


def two_rank_worker(root: str) -> None:
    """Runs in each of the 2 processes: every 2-rank training of this module, one after another."""
    root = Path(root)
    for name, overrides in PARITY_RUNS.items():
        history = run(base_args(root / name, nprocs=2, batch_per_device=1, **overrides))
        if os.environ["RANK"] == "0":
            (root / f"{name}.json").write_text(json.dumps(history))
    for name, overrides in RL_RUNS.items():
        history = run(base_args(root / name, nprocs=2, batch_per_device=1, grad_accum_steps=1, **overrides))
        if os.environ["RANK"] == "0":
            (root / f"{name}.json").write_text(json.dumps(history))
    history = run(base_args(root / "fsdp_kto", nprocs=2, batch_per_device=1, grad_accum_steps=1, **KTO_RUN))
    if os.environ["RANK"] == "0":
        (root / "fsdp_kto.json").write_text(json.dumps(history))
    history = run(base_args(root / "bf16_compute", nprocs=2, batch_per_device=1, **BF16_COMPUTE))
    if os.environ["RANK"] == "0":
        (root / "bf16_compute.json").write_text(json.dumps(history))
    # Tensor parallelism over both ranks: one data-parallel rank, so each rank takes the single process's batch.
    for name, overrides in TP_RUNS.items():
        history = run(base_args(root / name, nprocs=2, **overrides))
        if os.environ["RANK"] == "0":
            (root / f"{name}.json").write_text(json.dumps(history))
    for name, overrides in CP_RUNS.items():
        history = run(base_args(root / name, nprocs=2, **overrides))
        if os.environ["RANK"] == "0":
            (root / f"{name}.json").write_text(json.dumps(history))
    # A sharded checkpoint written under context parallelism (resumed on one process by the test), and online grpo:
    # rollouts sampled with a KV cache (every position on each rank), trained on with the positions split.
    run(base_args(root / "cp2_sharded", nprocs=2, **dict(CP2, **RESUME), sharded_checkpoint=True))
    run(base_args(root / "cp2_grpo_online", nprocs=2, batch_per_device=1, **dict(CP2, **ONLINE)))
    # Hugging Face directories, after the runs above have warmed up FSDP's and DTensor's caches.
    for name, overrides in HF_RUNS.items():
        if (root / hf_model_type(name)).is_dir():
            history = run(hf_args(root, name, root / name, nprocs=2, **overrides))
            if os.environ["RANK"] == "0":
                (root / f"{name}.json").write_text(json.dumps(history))
    if (root / "qwen3_moe").is_dir():  # expert parallelism: the other train types, and a checkpoint to resume
        for train_type in EP_TRAIN_TYPES:
            history = run(
                hf_args(root, "hf_qwen3_moe_ep2", root / f"ep2_{train_type}", nprocs=2, **ep_train_type(train_type))
            )
            if os.environ["RANK"] == "0":
                (root / f"ep2_{train_type}.json").write_text(json.dumps(history))
        run(hf_args(root, "hf_qwen3_moe_ep2", root / "ep2_resume", nprocs=2, **EP_RESUME))
        run(hf_args(root, "hf_qwen3_moe_ep2", root / "ep2_sharded", nprocs=2, **EP_RESUME, sharded_checkpoint=True))
        run(hf_args(root, "hf_qwen3_moe_ep2", root / "ep2_lora", nprocs=2, **EP_LORA))
    # Ranks sample different prompts, stop at different lengths, and must still run the same forward passes.
    run(base_args(root / "fsdp_grpo_online", nprocs=2, batch_per_device=1, parallel_mode="fsdp", **ONLINE))
    # DAPO's normaliser and the batch-scaled rewards gather the whole rollout over both ranks; 2 passes per rollout.
    dapo = dict(ONLINE, grpo_loss="dapo", grpo_clip_eps_high=0.28, grpo_scale_rewards="batch", grpo_num_iterations=2)
    run(base_args(root / "fsdp_grpo_dapo", nprocs=2, batch_per_device=1, parallel_mode="fsdp", **dapo))
    # Online dpo on the same prompts, its pairs ranked by the reward model trained above (a whole copy per rank).
    reward_model = str(root / "fsdp_reward_model" / "epoch_0_step_3")
    online_dpo = dict(ONLINE, train_type="dpo", reward=None, reward_model=reward_model)
    run(base_args(root / "fsdp_dpo_online", nprocs=2, batch_per_device=1, parallel_mode="fsdp", **online_dpo))
    two_rank_fsdp = dict(nprocs=2, batch_per_device=1, parallel_mode="fsdp", **RESUME)
    run(base_args(root / "fsdp_seq", **two_rank_fsdp))
    full = root / "fsdp_sft_full"
    run(base_args(full, **two_rank_fsdp, **SFT))
    run(base_args(root / "fsdp_sft_resumed", **two_rank_fsdp, **SFT, resume=str(full / "epoch_0_step_3")))
    # The same resume without a shared filesystem: rank 1's working directory lacks the checkpoint, so rank 0 reads
    # it and sends it over (relative paths; rank 0 writes every file).
    (root / "elsewhere").mkdir(exist_ok=True)
    os.chdir(root if os.environ["RANK"] == "0" else root / "elsewhere")
    run(base_args(Path("fsdp_sft_unshared"), **two_rank_fsdp, **SFT, resume="fsdp_sft_full/epoch_0_step_3"))
    os.chdir(root)
    # Sharded resume state: written by both ranks, resumed by both (and by one, in the test process).
    sharded = dict(two_rank_fsdp, sharded_checkpoint=True)
    run(base_args(root / "fsdp_seq_sharded", **sharded))
    run(base_args(root / "sharded_resumed", **sharded, resume=str(root / "fsdp_seq_sharded" / "epoch_0_step_3")))


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("two_ranks")
    write_hf_models(root)
    run_ranks(two_rank_worker, 2, str(root))
    return root


def weights(ckpt_dir: Path, step: int) -> dict[str, torch.Tensor]:
    (path,) = ckpt_dir.glob(f"epoch_*_step_{step}")
    return load_file(path / "model.safetensors")


def assert_trained_alike(ours: Path, theirs: Path, step: int, initial: dict[str, torch.Tensor]) -> None:
    """Step ``step``'s weights under the run directories ``ours`` and ``theirs`` (the reference) trained the same
    model from ``initial``: their difference against the update (tests/equality.py)."""
    assert_same_training(weights(ours, step), weights(theirs, step), initial)


def stored_state_bytes(optimizer_pt: Path) -> int:
    """Bytes of the per-parameter state an ``optimizer.pt`` holds (its moments and momenta; the scalar steps left
    out, as the plan leaves them out)."""
    stored = torch.load(optimizer_pt, weights_only=True)
    parts = stored.values() if "state" not in stored else [stored]
    return sum(
        value.numel() * value.element_size()
        for part in parts
        if part is not None
        for entries in part["state"].values()
        for value in entries.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


@pytest.mark.parametrize("name", ["fsdp_seq", "tp2", "cp2_seq", "ep2_resume"])
def test_each_layout_records_the_whole_models_counts(two_rank_runs, name):
    """Under FSDP, tensor, context and expert parallelism alike, the parameters a run records (metric.jsonl) are
    the whole model's, as its checkpoint holds them, and its optimizer state the whole state's, as optimizer.pt
    holds it (expert parallelism counted one rank's experts before)."""
    if not (two_rank_runs / name).is_dir():
        pytest.skip("transformers is not installed (the test extra)")
    last = max(two_rank_runs.joinpath(name).glob("epoch_*_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    entries = [json.loads(line) for line in (last / "metric.jsonl").read_text().splitlines()]
    (counts,) = [e for e in entries if e["type"] == "parameters"]
    stored = sum(t.numel() for t in load_file(last / "model.safetensors").values())
    assert counts["total_parameters"] == counts["trainable_parameters"] == stored
    assert counts["optimizer_state_bytes"] == stored_state_bytes(last / "optimizer.pt")


@pytest.mark.parametrize("name", list(PARITY_RUNS))
def test_two_ranks_match_one_process(two_rank_runs, tmp_path, name):
    reference_args = base_args(tmp_path / "ref", **PARITY_RUNS[name], nprocs=1)
    reference = run(reference_args)
    history = json.loads((two_rank_runs / f"{name}.json").read_text())
    assert [r["step"] for r in history] == [1, 2, 3]
    assert all(r["grad_norm"] > 0.5 for r in reference)  # clipping is active at every step
    for ours, ref in zip(history, reference, strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        # torch's float32 norm on CPU carries ~1e-5 relative error, differently per layout (float64 agrees to 1e-9)
        assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-5)
        assert ours["grad_snr"] == pytest.approx(ref["grad_snr"], rel=1e-4)  # sharded moments, one global value
    assert_trained_alike(two_rank_runs / name, tmp_path / "ref", 3, initial_weights(reference_args))


@pytest.mark.parametrize("name", list(RL_RUNS))
def test_two_rank_dpo_and_grpo_match_one_process(two_rank_runs, tmp_path, name):
    # 2 ranks x 1 sample: 1-sample micro-batches in sequence, or one of 2 samples where a quantile spans the ranks
    shape = (
        dict(batch_per_device=2, grad_accum_steps=1)
        if name in TOP_ENTROPY_RUNS
        else dict(batch_per_device=1, grad_accum_steps=2)
    )
    reference_args = base_args(tmp_path, **RL_RUNS[name], nprocs=1, **shape)
    reference = run(reference_args)
    history = json.loads((two_rank_runs / f"{name}.json").read_text())
    for ours, ref in zip(history, reference, strict=True):
        # the tokens kept, a fraction on each rank averaged over the ranks: not compared, but some and not all
        assert name not in TOP_ENTROPY_RUNS or 0 < ref["policy_token_fraction"] < 1
        for key in ("loss", "reward_accuracy", "reward_margin", "policy_loss", "kl_loss"):
            if key in ref:
                assert ours[key] == pytest.approx(ref[key], abs=1e-5), key
    assert_trained_alike(two_rank_runs / name, tmp_path, 3, initial_weights(reference_args))


def test_two_rank_kto_matches_one_process(two_rank_runs, tmp_path):
    reference_args = base_args(tmp_path, **KTO_RUN, nprocs=1, batch_per_device=2, grad_accum_steps=1)
    reference = run(reference_args)
    history = json.loads((two_rank_runs / "fsdp_kto.json").read_text())
    assert reference[1]["kl"] > 0  # the baseline is live from step 2 on
    for ours, ref in zip(history, reference, strict=True):
        for key in ("loss", "kl"):  # after Adam's steps: float32's relative precision (1.5e-6 seen on kl ~1.28)
            assert ours[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    assert_trained_alike(two_rank_runs / "fsdp_kto", tmp_path, 3, initial_weights(reference_args))


@pytest.mark.parametrize("name", list(HF_RUNS))
def test_two_ranks_train_a_huggingface_model_as_one_process(two_rank_runs, tmp_path, name):
    if not (two_rank_runs / f"{name}.json").exists():
        pytest.skip("transformers is not installed (the test extra)")
    reference_args = hf_args(two_rank_runs, name, tmp_path, nprocs=1, **HF_REFERENCES[name.rpartition("_")[2]])
    reference = run(reference_args)
    history = json.loads((two_rank_runs / f"{name}.json").read_text())
    assert [r["loss"] for r in history] == pytest.approx([r["loss"] for r in reference], abs=1e-5)
    if hf_model_type(name) in ("qwen2_moe", "qwen3_moe", "deepseek_v3"):  # the routers' aux loss: in the loss, logged
        assert [r["moe_aux_loss"] for r in history] == pytest.approx([r["moe_aux_loss"] for r in reference], abs=1e-5)
    assert_trained_alike(two_rank_runs / name, tmp_path, 2, initial_weights(reference_args))
    (saved,) = (two_rank_runs / name).glob("epoch_*_step_2")
    assert json.loads((saved / "meta.json").read_text())["source"]["model_type"] == hf_model_type(name)


@pytest.mark.parametrize("train_type", EP_TRAIN_TYPES)
def test_expert_parallel_seq_and_dpo_match_one_process(two_rank_runs, tmp_path, train_type):
    if not (two_rank_runs / f"ep2_{train_type}.json").exists():
        pytest.skip("transformers is not installed (the test extra)")
    overrides = dict(ep_train_type(train_type), **HF_REFERENCES["ep2"], parallel_mode="none", ep_size=None)
    reference_args = hf_args(two_rank_runs, "hf_qwen3_moe_ep2", tmp_path, nprocs=1, **overrides)
    reference = run(reference_args)
    history = json.loads((two_rank_runs / f"ep2_{train_type}.json").read_text())
    for key in ("loss", "moe_aux_loss", "reward_accuracy", "load_imbalance_max", "dead_expert_fraction"):
        if key in reference[0]:
            assert [r[key] for r in history] == pytest.approx([r[key] for r in reference], abs=1e-5), key
    assert_trained_alike(two_rank_runs / f"ep2_{train_type}", tmp_path, 2, initial_weights(reference_args))


def test_expert_parallel_lora_matches_one_process(two_rank_runs, tmp_path):
    if not (two_rank_runs / "ep2_lora").is_dir():
        pytest.skip("transformers is not installed (the test extra)")
    one = dict(EP_LORA, **HF_REFERENCES["ep2"], nprocs=1, parallel_mode="none", ep_size=None)
    reference_args = hf_args(two_rank_runs, "hf_qwen3_moe_ep2", tmp_path, **one)
    run(reference_args)
    (ours,), (theirs,) = (two_rank_runs / "ep2_lora").glob("epoch_*_step_2"), tmp_path.glob("epoch_*_step_2")
    adapters = load_file(ours / "adapter_model.safetensors")
    assert sum(".routed_experts." in key for key in adapters) == 4 * 3 * 2  # every expert's, both ranks'
    reference = load_file(theirs / "adapter_model.safetensors")
    assert_same_training(adapters, reference, initial_weights(reference_args))


def test_an_expert_parallel_checkpoint_is_one_processs_and_resumes_on_one_process(two_rank_runs, tmp_path):
    written = two_rank_runs / "ep2_resume"
    if not written.is_dir():
        pytest.skip("transformers is not installed (the test extra)")
    one_process = dict(EP_RESUME, nprocs=1, parallel_mode="none", ep_size=None, grad_accum_steps=4)
    whole = hf_args(two_rank_runs, "hf_qwen3_moe_ep2", tmp_path / "whole", **one_process)
    run(whole)
    # Gathered from both ranks' experts, optimizer.pt is numbered and filled as one process's.
    ours = torch.load(written / "epoch_0_step_2" / "optimizer.pt", weights_only=True)
    theirs = torch.load(tmp_path / "whole" / "epoch_0_step_2" / "optimizer.pt", weights_only=True)
    for part in ("muon", "adamw"):
        # AdamW is fused over plain tensors only (``optim.composite.fused_if_possible``): FSDP's are DTensors.
        groups = [
            [{k: v for k, v in g.items() if k != "fused"} for g in o[part]["param_groups"]] for o in (ours, theirs)
        ]
        assert groups[0] == groups[1]
        assert ours[part]["state"].keys() == theirs[part]["state"].keys()
        for index, entry in theirs[part]["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(ours[part]["state"][index][key], value, atol=1e-6, rtol=0)
    history = run(
        hf_args(two_rank_runs, "hf_qwen3_moe_ep2", tmp_path, **one_process, resume=str(written / "epoch_0_step_2"))
    )
    assert [r["step"] for r in history] == [3, 4]
    assert_trained_alike(tmp_path, written, 4, weights(written, 2))  # both went on from its step 2
    assert_trained_alike(written, tmp_path / "whole", 4, initial_weights(whole))


def test_a_sharded_expert_parallel_checkpoint_is_one_processs_state_and_resumes_on_one_process(two_rank_runs, tmp_path):
    """Each rank writes its own experts' optimizer entries numbered as the whole model's: exported, ``state/`` is the
    gathered ``optimizer.pt`` of the same run unsharded (bit for bit), and one process resumes it to that run's
    weights (1e-5)."""
    sharded, gathered = two_rank_runs / "ep2_sharded", two_rank_runs / "ep2_resume"
    if not sharded.is_dir():
        pytest.skip("transformers is not installed (the test extra)")
    assert main(["export", str(sharded / "epoch_0_step_2"), "--out", str(tmp_path / "exported")]) == 0
    ours = torch.load(tmp_path / "exported" / "optimizer.pt", weights_only=True)
    theirs = torch.load(gathered / "epoch_0_step_2" / "optimizer.pt", weights_only=True)
    for part in ("muon", "adamw"):
        assert ours[part]["param_groups"] == theirs[part]["param_groups"]
        assert ours[part]["state"].keys() == theirs[part]["state"].keys()
        for index, entry in theirs[part]["state"].items():
            assert all(torch.equal(ours[part]["state"][index][key], value) for key, value in entry.items())
    one_process = dict(EP_RESUME, nprocs=1, parallel_mode="none", ep_size=None, grad_accum_steps=4)
    resume = str(sharded / "epoch_0_step_2")
    run(hf_args(two_rank_runs, "hf_qwen3_moe_ep2", tmp_path / "resumed", **one_process, resume=resume))
    assert_trained_alike(tmp_path / "resumed", gathered, 4, weights(sharded, 2))


def test_fsdp_mixed_precision_computes_in_bf16_over_float32_weights(two_rank_runs, tmp_path):
    reference = run(base_args(tmp_path, optimizer="adamw"))
    history = json.loads((two_rank_runs / "bf16_compute.json").read_text())
    losses = [r["loss"] for r in history]
    assert losses != [r["loss"] for r in reference]  # bf16 matmuls do change the numbers ...
    assert losses == pytest.approx([r["loss"] for r in reference], abs=1e-2)  # ... by bf16's precision
    assert {t.dtype for t in weights(two_rank_runs / "bf16_compute", 3).values()} == {torch.float32}


@pytest.mark.parametrize("name", list(TP_RUNS))
def test_tensor_parallel_matches_one_process(two_rank_runs, tmp_path, name):
    reference_args = base_args(tmp_path, optimizer="muon_adamw", loss_chunk_size=TP_RUNS[name].get("loss_chunk_size"))
    reference = run(reference_args)
    history = json.loads((two_rank_runs / f"{name}.json").read_text())
    assert [r["loss"] for r in history] == pytest.approx([r["loss"] for r in reference], abs=1e-5)
    assert [r["grad_snr"] for r in history] == pytest.approx([r["grad_snr"] for r in reference], rel=1e-4)
    assert_trained_alike(two_rank_runs / name, tmp_path, 3, initial_weights(reference_args))


@pytest.mark.parametrize("name", list(CP_RUNS))
def test_context_parallel_matches_one_process(two_rank_runs, tmp_path, name):
    overrides = {key: value for key, value in CP_RUNS[name].items() if key not in ("parallel_mode", "cp_size")}
    reference_args = base_args(tmp_path, **overrides)
    reference = run(reference_args)
    history = json.loads((two_rank_runs / f"{name}.json").read_text())
    assert [r["loss"] for r in history] == pytest.approx([r["loss"] for r in reference], rel=1e-5, abs=1e-6)
    # torch's float32 norm on CPU carries ~1e-5 relative error, differently per layout
    assert [r["grad_norm"] for r in history] == pytest.approx([r["grad_norm"] for r in reference], rel=5e-5)
    assert_trained_alike(two_rank_runs / name, tmp_path, 3, initial_weights(reference_args))


def test_context_parallel_sharded_state_resumes_on_one_process_and_online_grpo_runs(two_rank_runs, tmp_path):
    sharded = two_rank_runs / "cp2_sharded" / "epoch_0_step_3"
    assert (sharded / "state" / ".metadata").is_file()
    history = run(base_args(tmp_path, **RESUME, resume=str(sharded)))  # cp 1: DCP reshards the state
    assert [r["step"] for r in history] == [4, 5, 6]
    assert_trained_alike(tmp_path, two_rank_runs / "cp2_sharded", 6, weights(two_rank_runs / "cp2_sharded", 3))
    assert (two_rank_runs / "cp2_grpo_online" / "epoch_0_step_2" / "model.safetensors").is_file()


def tp_and_fsdp_worker(root: str, hf_root: str) -> None:
    from test_muon_distributed import fsdp_tp_worker

    if (Path(hf_root) / "qwen3_moe").is_dir():
        # Experts over 2 expert ranks x 2 FSDP shards (1 sample per data rank), and the 2-rank expert-parallel
        # checkpoint resumed with each of the 4 ranks holding one expert (4 samples a step, as it was written).
        run(hf_args(Path(hf_root), "hf_qwen3_moe_ep2", Path(root) / "ep2x2", nprocs=4, **EP2_HF))
        ep4 = dict(EP_RESUME, ep_size=4, grad_accum_steps=1, resume=f"{hf_root}/ep2_resume/epoch_0_step_2")
        run(hf_args(Path(hf_root), "hf_qwen3_moe_ep2", Path(root) / "ep4_resumed", nprocs=4, **ep4))
        # The sharded one too: each rank reads its expert's entries, resharded by torch distributed checkpoint.
        ep4["resume"] = f"{hf_root}/ep2_sharded/epoch_0_step_2"
        run(hf_args(Path(hf_root), "hf_qwen3_moe_ep2", Path(root) / "ep4_from_sharded", nprocs=4, **ep4))

    history = run(base_args(Path(root), nprocs=4, batch_per_device=1, **TP2))
    if os.environ["RANK"] == "0":
        (Path(root) / "history.json").write_text(json.dumps(history))
    # FSDP over 2 data ranks x 2 context ranks, 1 sample per data rank: seq's windows (the fused loss), sft's packed
    # documents (the logits path), dpo's pairs padded on to an even length (with the frozen reference split alike).
    for name in FOUR_RANK_CP_RUNS:
        history = run(base_args(Path(root) / name, nprocs=4, batch_per_device=1, **CP_RUNS[name]))
        if os.environ["RANK"] == "0":
            (Path(root) / f"{name}.json").write_text(json.dumps(history))
    fsdp_tp_worker(str(Path(root) / "optimizers.pt"))  # the 4 processes, once more: Muon, Mano and Nora alone
    from test_context_parallel import tensor_and_context_parallel_worker

    tensor_and_context_parallel_worker(str(Path(root) / "tp_cp.pt"))  # and tensor x context parallelism
    from test_expert_parallel import four_rank_expert_worker

    four_rank_expert_worker(str(Path(root) / "experts.pt"))  # and expert parallelism's layouts, model alone


def test_tensor_parallel_with_fsdp_on_four_ranks(two_rank_runs, tmp_path):
    # 4 processes on 2 cores: a 2 x 2 mesh (data x tensor), 1 sample per data-parallel rank.
    from test_muon_distributed import check_fsdp_tp_optimizers

    run_ranks(tp_and_fsdp_worker, 4, str(tmp_path / "four"), str(two_rank_runs))
    if (two_rank_runs / "ep2_resume").is_dir():  # expert parallelism 2 x FSDP 2, and ep 4 resuming ep 2
        one = dict(EP2_HF, nprocs=1, parallel_mode="none", ep_size=None, grad_accum_steps=4)
        ep_one = hf_args(two_rank_runs, "hf_qwen3_moe_ep2", tmp_path / "ep_one", **one)
        run(ep_one)
        assert_trained_alike(tmp_path / "four" / "ep2x2", tmp_path / "ep_one", 2, initial_weights(ep_one))
        written = two_rank_runs / "ep2_resume"
        for name in ("ep4_resumed", "ep4_from_sharded"):  # from its step 2 (the sharded one's is the same state)
            assert_trained_alike(tmp_path / "four" / name, written, 4, weights(written, 2))
    check_fsdp_tp_optimizers(str(tmp_path / "four" / "optimizers.pt"))
    from test_context_parallel import check_against_one_process

    check_against_one_process(str(tmp_path / "four" / "tp_cp.pt"))  # tensor 2 x context 2: one process's gradients
    from test_expert_parallel import check_four_ranks_against_one_process

    check_four_ranks_against_one_process(str(tmp_path / "four" / "experts.pt"))
    one = base_args(tmp_path / "one", optimizer="muon_adamw")
    reference = run(one)
    history = json.loads((tmp_path / "four" / "history.json").read_text())
    assert [r["loss"] for r in history] == pytest.approx([r["loss"] for r in reference], abs=1e-5)
    assert_trained_alike(tmp_path / "four", tmp_path / "one", 3, initial_weights(one))
    # FSDP 2 x context 2 against one process taking the same 1-sample micro-batches in sequence (each averages
    # per-micro-batch means): 2 data ranks x 2 accumulation = 4.
    for name in FOUR_RANK_CP_RUNS:
        flags = {key: value for key, value in CP_RUNS[name].items() if key not in ("parallel_mode", "cp_size")}
        one = base_args(tmp_path / f"{name}_one", batch_per_device=1, grad_accum_steps=4, **flags)
        reference = run(one)
        history = json.loads((tmp_path / "four" / f"{name}.json").read_text())
        assert [r["loss"] for r in history] == pytest.approx([r["loss"] for r in reference], rel=1e-5), name
        assert_trained_alike(tmp_path / "four" / name, tmp_path / f"{name}_one", 3, initial_weights(one))


def test_online_grpo_runs_on_two_fsdp_ranks(two_rank_runs):
    assert (two_rank_runs / "fsdp_grpo_online" / "epoch_0_step_2" / "model.safetensors").is_file()


def test_online_dpo_ranked_by_a_reward_model_and_dapo_run_on_two_fsdp_ranks(two_rank_runs):
    assert (two_rank_runs / "fsdp_dpo_online" / "epoch_0_step_2" / "model.safetensors").is_file()
    meta = json.loads((two_rank_runs / "fsdp_grpo_dapo" / "epoch_0_step_2" / "meta.json").read_text())
    assert meta["resume_position"]["sample_index"] == 2  # 2 steps, 2 passes over one rollout of 2: its prompts once


def test_fsdp_resume_is_bit_exact(two_rank_runs):
    full, resumed = two_rank_runs / "fsdp_sft_full", two_rank_runs / "fsdp_sft_resumed"
    assert sorted(p.name for p in resumed.glob("epoch_*")) == ["epoch_0_step_6"]  # continued at step 4
    assert_bit_equal(weights(resumed, 6), weights(full, 6))


def test_resume_without_a_shared_filesystem(two_rank_runs):
    assert_bit_equal(weights(two_rank_runs / "fsdp_sft_unshared", 6), weights(two_rank_runs / "fsdp_sft_full", 6))


def test_sharded_state_resumes_on_two_ranks_and_on_one(two_rank_runs, tmp_path):
    sharded = two_rank_runs / "fsdp_seq_sharded" / "epoch_0_step_3"
    assert (sharded / "state" / ".metadata").is_file() and not (sharded / "optimizer.pt").exists()
    assert "optimizer_state" in json.loads((sharded / "meta.json").read_text())
    uninterrupted = weights(two_rank_runs / "fsdp_seq", 6)  # the same run, saved unsharded
    assert_bit_equal(weights(two_rank_runs / "fsdp_seq_sharded", 6), uninterrupted)
    assert_bit_equal(weights(two_rank_runs / "sharded_resumed", 6), uninterrupted)
    history = run(base_args(tmp_path, **RESUME, resume=str(sharded)))
    assert [r["step"] for r in history] == [4, 5, 6]
    assert_same_training(weights(tmp_path, 6), uninterrupted, weights(two_rank_runs / "fsdp_seq_sharded", 3))


def test_export_writes_the_gathered_optimizer_state(two_rank_runs, tmp_path):
    from astrai_fabric.cli import main

    out = tmp_path / "exported"
    assert main(["export", str(two_rank_runs / "fsdp_seq_sharded" / "epoch_0_step_3"), "--out", str(out)]) == 0
    exported = load_checkpoint(out)
    gathered = load_checkpoint(two_rank_runs / "fsdp_seq" / "epoch_0_step_3")  # the same state, saved unsharded
    for name in ("muon", "adamw"):
        ours, theirs = exported.extra["optimizer"][name], gathered.extra["optimizer"][name]
        assert ours["param_groups"] == theirs["param_groups"] and ours["state"].keys() == theirs["state"].keys()
        for index, entry in theirs["state"].items():
            for key, tensor in entry.items():
                assert torch.equal(ours["state"][index][key], tensor), (name, index, key)
    assert "optimizer_state" not in exported.meta and exported.meta["resume_position"]["optimizer_step"] == 3


def test_two_rank_fsdp_checkpoint_resumes_on_one_rank(two_rank_runs, tmp_path):
    # seq, not sft: sft's per-micro-batch token mean changes with the micro-batch split (see test_accumulation).
    history = run(base_args(tmp_path, **RESUME, resume=str(two_rank_runs / "fsdp_seq" / "epoch_0_step_3")))
    assert [r["step"] for r in history] == [4, 5, 6]
    # Same samples in the same steps; only the order of floating-point reductions differs.
    assert_trained_alike(tmp_path, two_rank_runs / "fsdp_seq", 6, weights(two_rank_runs / "fsdp_seq", 3))


def test_single_process_resume_is_bit_exact(tmp_path):
    full = run(base_args(tmp_path / "full", **RESUME, **SFT))
    resumed = run(base_args(tmp_path / "resumed", **RESUME, **SFT, resume=str(tmp_path / "full" / "epoch_0_step_3")))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]
    assert_bit_equal(weights(tmp_path / "resumed", 6), weights(tmp_path / "full", 6))


def write_astrai_fsdp_optimizer(path: str) -> None:
    """An optimizer.pt as AstrAI's FSDP writes it: rank 0's DTensor shards (B6)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    shard = distribute_tensor(torch.zeros(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
    torch.save({"muon": {"state": {0: {"momentum_buffer": shard}}, "param_groups": []}, "adamw": None}, path)
    dist.destroy_process_group()


def test_astrai_fsdp_checkpoint_says_why_and_resumes_with_a_fresh_optimizer(tmp_path, capsys):
    from astrai_fabric.cli import main

    run(base_args(tmp_path / "run", max_steps=2))
    (checkpoint,) = (tmp_path / "run").glob("epoch_*")
    meta = json.loads((checkpoint / "meta.json").read_text())
    for key in ("astrai_fabric", "resume_position", "train_type"):
        del meta[key]  # now it reads as AstrAI's
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    run_ranks(write_astrai_fsdp_optimizer, 1, str(checkpoint / "optimizer.pt"))
    argv = [
        "seq",
        "--param_path",
        str(checkpoint),
        "--resume",
        "--data_root_path",
        "bundled:data/seq",
        "--window_size",
        "32",
        "--batch_per_device",
        "2",
        "--grad_accum_steps",
        "2",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--ckpt_dir",
        str(tmp_path / "next"),
        "--max_steps",
        "3",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "optimizer.pt: holds sharded (DTensor) optimizer state" in err and "--resume_optimizer false" in err
    assert main([*argv, "--resume_optimizer", "false"]) == 0
    out = capsys.readouterr().out
    assert "optimizer: starting fresh" in out and "at step 2" in out  # AstrAI's position: consumed_samples
    assert (tmp_path / "next" / "epoch_0_step_3").is_dir()
