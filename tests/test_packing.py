"""sft's two modes (``--packing``): AstrAI's windows over the records run together (the default) and one sample per
record (``--packing false``, ``data.datasets.RecordDataset``), what each cuts and leaves out as the plan counts it,
the flag refused where it means nothing, a Hugging Face model's default window capped, and the preference plan's
beta and reference.

Oracle: TRL 1.16's ``SFTTrainer(packing=False)`` trains the same tiny random Qwen3 (transformers, built here and
saved with ``save_pretrained``) on the same prompt/completion records for 4 optimizer steps; its loss at each step
(read where ``compute_loss`` returns it, before the update) equals ours within ``TRL_TOLERANCE`` (float32).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from astrai_fabric.cli import main
from astrai_fabric.data.datasets import RecordDataset, TokenStream, WindowDataset, collate_records

ROOT = Path(__file__).parents[1]


def stream_of(records: list[tuple[int, list[int]]]) -> TokenStream:
    """An sft stream of records given as (length, indices of the trained tokens): token ids count up from 1 across
    the stream, positions restart at 0 at each record (AstrAI's doc_reset)."""
    lengths = [length for length, _ in records]
    mask = np.zeros(sum(lengths), dtype=np.bool_)
    offset = 0
    for length, trained in records:
        mask[[offset + i for i in trained]] = True
        offset += length
    positions = np.concatenate([np.arange(length) for length in lengths]).astype(np.int32)
    sequence = np.arange(1, sum(lengths) + 1, dtype=np.int32)
    return TokenStream({"sequence": [sequence], "loss_mask": [mask], "position_ids": [positions]})


# --- what each mode reads, cuts and leaves out --------------------------------------------------------------------


def test_each_record_is_one_sample_cut_after_window_plus_one_tokens():
    """Records of 5, 12, 3 and 2 tokens at window 8: the 12-token one cut after 9 (3 past the cut), the 2-token one
    (its one trained token is its first, which nothing predicts) dropped, every other token in exactly one sample."""
    records = [(5, [3, 4]), (12, [2, 10, 11]), (3, [1]), (2, [0])]
    dataset = RecordDataset(stream_of(records), window_size=8)
    assert len(dataset) == 3 and dataset.num_records == 4
    assert (dataset.num_cut, dataset.tokens_past_cuts, dataset.num_dropped) == (1, 3, 1)
    samples = [dataset[i] for i in range(len(dataset))]
    assert [s["input_ids"].tolist() for s in samples] == [[1, 2, 3, 4], list(range(6, 14)), [18, 19]]
    assert [s["target_ids"].tolist() for s in samples] == [[2, 3, 4, 5], list(range(7, 15)), [19, 20]]
    # The mask rides with the targets: record 2's token 2 (id 8) trains, 10 and 11 lie past the cut (ids 7..14 read).
    assert samples[1]["loss_mask"].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
    assert (dataset.num_trained_tokens, dataset.num_trained_in_samples) == (7, 4)  # 2 past the cut, 1 first
    batch = collate_records(samples)
    assert batch["input_ids"].shape == (3, 8) and batch["attention_mask"].sum().item() == 4 + 8 + 2
    assert not batch["loss_mask"][~batch["attention_mask"]].any()  # padding never trains


def test_packing_counts_the_tail_it_leaves_out_and_the_records_it_splits():
    """286 tokens in windows of 256: one window, the stream's last 29 tokens predicted by none (token 256 is the
    window's last target; AstrAI's windows keep no partial one), as the issue's user found."""
    stream = TokenStream({"sequence": [np.arange(286, dtype=np.int32)]})
    assert WindowDataset(stream, "seq", 256).count_left_over() == (29, None)
    records = [(6, [5]), (6, [4, 5]), (6, [5]), (5, [4])]  # 23 tokens, windows of 8: [0, 9) and [8, 17)
    dataset = WindowDataset(stream_of(records), "sft", 8)
    assert len(dataset) == 2
    assert dataset.count_left_over() == (23 - 1 - 16, 1 + 1)  # tokens 17..22: record 3's last two, record 4
    assert dataset.count_split_records() == (2, 4)  # records 2 and 3 run across a window boundary
    half = WindowDataset(stream_of(records), "sft", 8, stride=4)  # overlapping windows hold more records whole
    assert half.count_split_records() == (1, 4) and half.count_left_over() == (23 - 1 - 20, 1)


# --- the oracle: TRL's SFTTrainer(packing=False), 4 steps ---------------------------------------------------------

NO_GENERATION_PROMPT = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
)
"""ChatML without a generation prompt. TRL's completion is what the whole conversation adds to the prompt rendered
with its generation prompt; sft here trains each assistant message whole, its header included. With no generation
prompt the two are the same tokens, so both train the same mask; with one (ChatML's ``<|im_start|>assistant``) TRL
leaves that header out of the loss and we train it (tests/test_data_shapes.py shows the difference)."""
WINDOW = 48
RECORDS = [
    {"prompt": [{"role": "user", "content": "What is two plus two?"}],
     "completion": [{"role": "assistant", "content": "Two plus two is four."}]},
    {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "The weather?"}],
     "completion": [{"role": "assistant", "content": "Sunny and warm."}]},
    {"prompt": [{"role": "user", "content": "Tell me about the weather today."}],
     "completion": [{"role": "assistant", "content": "It is sunny and warm, with a light breeze. " * 3}]},  # cut
    {"prompt": [{"role": "user", "content": "héllo wörld, answers and questions and more text " * 5}],
     "completion": [{"role": "assistant", "content": "Four."}]},  # its prompt fills the cut: dropped
    {"prompt": [{"role": "user", "content": "héllo"}], "completion": [{"role": "assistant", "content": "✓ 漢字"}]},
]  # fmt: skip
TRL_TOLERANCE = 2e-6
"""Float32 (seen: 4.8e-7 at losses near 6); both run torch's AdamW on gradients that differ only in the order of
float sums."""


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """A random tiny Qwen3 and a byte-level BPE tokenizer (ChatML tokens, the template above), saved by
    transformers."""
    pytest.importorskip("transformers")
    from test_hf_tokenizer import build_tokenizer
    from test_huggingface import build_hf, save_hf

    tokenizer = build_tokenizer("chatml")
    tokenizer.chat_template = NO_GENERATION_PROMPT
    directory = tmp_path_factory.mktemp("qwen3") / "model"
    model = build_hf("Qwen3Config", head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=64)
    save_hf(model, directory)
    tokenizer.save_pretrained(directory)
    return directory


OUR_FLAGS = [
    "--packing", "false", "--window_size", str(WINDOW), "--batch_per_device", str(len(RECORDS) - 1),
    "--grad_accum_steps", "1", "--n_epoch", "4", "--optimizer", "adamw", "--max_lr", "1e-3", "--weight_decay", "0",
    "--min_rate", "1", "--warmup_ratio", "0", "--max_grad_norm", "1.0", "--parallel_mode", "none",
    "--precision", "32-true", "--num_workers", "0", "--loggers", "[]",
]  # fmt: skip
"""The run ``trl_losses``'s config describes: the whole data set in one micro-batch for 4 epochs, AdamW (0.9, 0.95)
at a constant 1e-3 (``--min_rate 1``), no decay, clipping at 1."""


def our_losses(model_dir: Path, data: Path, out: Path, capsys) -> tuple[list[float], str]:
    argv = ["sft", "--param_path", str(model_dir), "--data_root_path", str(data), "--ckpt_dir", str(out), *OUR_FLAGS]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    (checkpoint,) = out.glob("epoch_*_step_4")
    entries = [json.loads(line) for line in (checkpoint / "metric.jsonl").read_text().splitlines()]
    return [e["loss"] for e in entries if e.get("type") == "step"], printed


def trl_losses(model_dir: Path, out: Path) -> list[float]:
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")

    losses = []

    class Recorded(trl.SFTTrainer):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notices, of no matter here
    config = trl.SFTConfig(
        output_dir=str(out),
        packing=False,
        max_length=WINDOW + 1,  # TRL's L tokens read L positions, predict L - 1: our window + 1
        completion_only_loss=True,
        per_device_train_batch_size=len(RECORDS) - 1,  # the whole data set, so the order cannot differ
        gradient_accumulation_steps=1,
        num_train_epochs=4,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,  # ours decays matrices only, HF every weight but biases and norms: none on both sides
        adam_beta1=0.9,
        adam_beta2=0.95,  # ours (HF's default is 0.999)
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = Recorded(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(RECORDS), processing_class=tokenizer
    )
    assert len(trainer.train_dataset) == len(RECORDS) - 1  # TRL drops the record whose prompt fills the cut
    trainer.train()
    return losses


def test_per_record_sft_equals_trls_sft_trainer_without_packing(qwen3, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    ours, printed = our_losses(qwen3, data, tmp_path / "ours", capsys)
    with warnings.catch_warnings():
        theirs = trl_losses(qwen3, tmp_path / "trl")
    print(f"ours {ours}\nTRL  {theirs}", file=sys.stderr)
    assert len(ours) == len(theirs) == 4
    assert ours == pytest.approx(theirs, abs=TRL_TOLERANCE, rel=0)
    assert "of 5 records 1 cut after 49 tokens (7 tokens past the cuts not read), 1 dropped" in printed


# --- the plan, through the CLI ------------------------------------------------------------------------------------


def plan_rows(printed: str) -> dict[str, str]:
    """The plan's rows by label (``  label   text``)."""
    rows = {}
    for line in printed.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            label, _, text = line.strip().partition(" ")
            rows[label] = text.strip()
    return rows


def dry_run(capsys, train_type: str, *flags: str) -> dict[str, str]:
    argv = [train_type, "--param_path", "bundled:tiny", "--parallel_mode", "none", "--dry_run", *flags]
    code, printed = main(argv), capsys.readouterr()
    assert code == 0, printed.out + printed.err
    return plan_rows(printed.out)


def test_the_plan_says_which_mode_runs_and_what_it_leaves_out(tmp_path, capsys):
    out = ["--ckpt_dir", str(tmp_path / "out")]
    rows = dry_run(capsys, "sft", "--data_root_path", "bundled:data/sft", "--window_size", "64", *out)
    assert rows["data"].startswith("1,187 samples: windows of 64 tokens from")  # AstrAI's default: unchanged
    assert rows["packing"] == (
        "on (AstrAI's sft: the records run on from one window into the next); 1,109 of 2,400 records not whole in one "
        "window; the last 34 tokens (18 trained) fall in no window; --packing false trains one sample per record, as "
        "TRL's SFTTrainer does by default"
    )  # messages records: TRL's own shape
    rows = dry_run(
        capsys, "sft", "--data_root_path", "bundled:data/sft", "--window_size", "64", "--packing", "false", *out
    )
    assert rows["data"].startswith("2,400 samples: one per record, at most 64 positions each, from")
    assert "of 2,400 records 1 cut after 65 tokens (4 tokens past the cuts not read), none dropped" in rows["packing"]
    rows = dry_run(capsys, "seq", "--data_root_path", "bundled:data/seq", "--window_size", "128", *out)
    # 145,881 tokens: 1,139 windows of 128 predict tokens 1 to 145,792, so 145,881 - 1 - 145,792 = 88 are left out.
    assert (
        rows["packing"] == "on (seq: the stream cut into windows, its only mode); the last 88 tokens fall in no window"
    )
    assert "window" not in rows  # AstrAI's model: the default window is its max_position_embeddings, as AstrAI's


def test_a_hugging_face_models_default_window_is_capped(tmp_path, capsys):
    """Qwen3's 40,960 positions would be the window of every sample; TRL's 1024 is, and the plan says why."""
    pytest.importorskip("transformers")
    from test_huggingface import build_hf, save_hf

    vocab = json.loads((ROOT / "astrai_fabric" / "assets" / "tiny" / "config.json").read_text())["vocab_size"]
    model = save_hf(
        build_hf("Qwen3Config", head_dim=16, vocab_size=vocab, max_position_embeddings=40960), tmp_path / "m"
    )
    flags = ["--data_root_path", "bundled:data/sft", "--tokenizer_path", "bundled:tiny", "--ckpt_dir", str(tmp_path)]
    rows = dry_run(capsys, "sft", "--param_path", str(model), "--packing", "false", *flags)
    assert rows["window"] == (
        "1024 tokens: the model's max_position_embeddings 40,960 capped at 1024 for a model from Hugging Face (TRL's "
        "max_length default); --window_size sets it"
    )
    assert "at most 1024 positions each" in rows["data"]
    rows = dry_run(capsys, "sft", "--param_path", str(model), "--window_size", "2048", *flags)
    assert "window" not in rows and rows["data"].startswith("37 samples: windows of 2048 tokens")


BAD = [  # (train type, flags, the error's text)
    ("seq", ["--packing", "false"],
     "packing false applies to sft: seq trains one token stream cut into windows, its only mode"),
    ("dpo", ["--packing", "false"],
     "packing false applies to sft: dpo trains one sample per record already (cut to window_size); drop --packing"),
    ("sft", ["--packing", "false", "--stride", "8"],
     "stride applies to packed windows; packing false reads each record from its start: drop --stride"),
    ("sft", ["--packing", "false", "--window_size", "8"],
     "no record trains a token in its first 9 tokens (loss_mask 0 there: sft trains the assistant turns"),
]  # fmt: skip


@pytest.mark.parametrize(("train_type", "flags", "message"), BAD, ids=["seq", "dpo", "stride", "nothing-trained"])
def test_packing_false_where_it_means_nothing_is_one_line(tmp_path, capsys, train_type, flags, message):
    data = tmp_path / "data.jsonl"  # every record's user turn is longer than 9 tokens: no assistant token in the cut
    turns = [
        {"role": "user", "content": "What is two plus two, and what is three plus three? " * 2},
        {"role": "assistant", "content": "Four and six."},
    ]
    data.write_text(json.dumps({"messages": turns}) + "\n")
    argv = [train_type, "--param_path", "bundled:tiny", "--data_root_path", str(data), "--parallel_mode", "none"]
    code = main([*argv, "--ckpt_dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("astrai-fabric: error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


# --- the preference plan: the beta as read and the reference -------------------------------------------------------


def test_the_preference_plan_names_the_beta_and_the_reference(tmp_path, capsys):
    """dpo's and kto's ``preference`` row; the reference it names is the one the run records in ``meta.json``."""
    dpo = ["--data_root_path", "bundled:data/dpo", "--window_size", "64", "--ckpt_dir", str(tmp_path / "dpo")]
    fresh = "AstrAI's init, seed 3407 (the policy's starting point, frozen)"
    rows = dry_run(capsys, "dpo", *dpo)
    assert rows["preference"] == f"dpo loss sigmoid, beta 0.1 (--dpo_beta); reference model: {fresh}"
    rows = dry_run(capsys, "dpo", *dpo, "--dpo_loss", "simpo", "--simpo_beta", "2")
    assert rows["preference"] == (
        "dpo loss simpo (gamma 0.5, label smoothing 0), beta 2 (--simpo_beta); no reference model (reference-free: "
        "chosen against rejected alone)"
    )
    rows = dry_run(capsys, "dpo", *dpo, "--dpo_loss", "orpo", "--reference_path", "bundled:tiny")
    assert rows["preference"].startswith("dpo loss orpo (lambda 0.1); no reference model")  # orpo has no beta
    rows = dry_run(capsys, "dpo", *dpo, "--reference_path", "bundled:tiny")
    assert rows["preference"].endswith("reference model: bundled:tiny (--reference_path)")
    kto = ["--data_root_path", "bundled:data/kto", "--window_size", "64", "--ckpt_dir", str(tmp_path / "kto")]
    rows = dry_run(capsys, "kto", *kto)
    assert rows["preference"] == (
        f"kto (desirable weight 1, undesirable 1), beta 0.1 (--dpo_beta, kto_beta unset); reference model: {fresh}"
    )

    assert main(["dpo", "--param_path", "bundled:tiny", "--parallel_mode", "none", *dpo, "--max_steps", "1"]) == 0
    capsys.readouterr()
    (checkpoint,) = (tmp_path / "dpo").glob("epoch_*_step_1")
    assert json.loads((checkpoint / "meta.json").read_text())["reference"] == {"param_path": None, "random_seed": 3407}
    rows = dry_run(capsys, "dpo", *dpo, "--resume", "auto", "--max_steps", "2")
    assert rows["preference"].endswith(
        f"reference model: AstrAI's init, seed 3407 (where the run started: {checkpoint.name}/meta.json records it)"
    )
