"""Reward models (``astrai-fabric reward_model``, ``--reward_model``): scores, loss and gradients against
transformers' ``*ForSequenceClassification`` and TRL 1.16's ``RewardTrainer``, the checkpoint and its export, the
recipe from log 2, online rollouts scored by one, resume, and the one-line refusals.

References: transformers 5's ``LlamaForSequenceClassification`` over our ``export --format hf`` (the score at each
row's last token that is not ``pad_token_id``: ``GenericForSequenceClassification``), and TRL's
``RewardTrainer.compute_loss`` over the same export, fed the very ids our collate makes (chosen rows, then rejected
rows, as TRL chunks them), with a margin per pair and ``center_rewards_coefficient``: float32, loss within 1e-6,
gradients within 1e-5 of their largest entry (tests/equality.py).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_resume_is_bit_exact
from equality import assert_same_gradient
from safetensors.torch import load_file

from astrai_fabric import assets
from astrai_fabric.checkpoint import load_model, read_model_config, save_checkpoint
from astrai_fabric.cli import main
from astrai_fabric.config import ModelConfig
from astrai_fabric.data.records import PreferenceDataset
from astrai_fabric.data.storage import read_records
from astrai_fabric.errors import ConfigError
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.reward_model import RewardModelScorer, last_token_index, reward_model_config, sequence_scores
from astrai_fabric.tokenizer import Tokenizer
from astrai_fabric.train.reward_model import MarginPairs, collate_margin_pairs, reward_model_batch_loss

transformers = pytest.importorskip("transformers")

from test_huggingface import build_hf, save_hf  # noqa: E402

ROOT = Path(__file__).parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A random 2-layer reward model (its score head random too, so scores differ) in our layout and exported as a
    transformers ``LlamaForSequenceClassification``; and a language model of the same tokenizer."""
    root = tmp_path_factory.mktemp("reward_model")
    source = assets.resolve("bundled:tiny")
    config = ModelConfig.from_dict({**read_model_config(source).to_dict(), "num_hidden_layers": 2})
    files = {name: source / name for name in TOKENIZER_FILES}
    torch.manual_seed(0)
    save_checkpoint(root / "lm", AutoRegressiveLM(config).state_dict(), config.to_dict(), files=files)
    rm_config = reward_model_config(config, Tokenizer.from_dir(source).padding_id)
    model = AutoRegressiveLM(rm_config)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    save_checkpoint(root / "rm", model.state_dict(), rm_config.to_dict(), files=files)
    assert main(["export", str(root / "rm"), "--format", "hf", "--out", str(root / "rm_hf")]) == 0
    return root


def pair_batch(root: Path, num_pairs: int = 3) -> dict[str, torch.Tensor]:
    """Bundled pairs as our collate makes them (``[B, 2, L]``, chosen then rejected, right-padded), with margins."""
    tokenizer = Tokenizer.from_dir(root / "rm")
    records = [
        (where, {**record, "margin": 0.25 * i})
        for i, (where, record) in enumerate(read_records(assets.resolve("bundled:data/dpo"))[:num_pairs])
    ]
    pairs = MarginPairs(PreferenceDataset(records, tokenizer, 64))
    return collate_margin_pairs([pairs[i] for i in range(len(pairs))], tokenizer.padding_id)


def test_checkpoint_is_ours_and_the_export_is_a_sequence_classifier(models):
    config = json.loads((models / "rm" / "config.json").read_text())
    assert config["model_type"] == "astrai_fabric_lm"  # AstrAI refuses it rather than drop the head
    assert config["score_head"] is True and config["pad_token_id"] == Tokenizer.from_dir(models / "rm").padding_id
    assert "lm_head.weight" not in load_file(models / "rm" / "model.safetensors")
    exported = json.loads((models / "rm_hf" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForSequenceClassification"] and len(exported["id2label"]) == 1
    assert exported["pad_token_id"] == config["pad_token_id"]
    assert set(load_file(models / "rm_hf" / "model.safetensors")) >= {"score.weight", "model.embed_tokens.weight"}


def test_scores_equal_transformers_and_survive_the_round_trip(models):
    ours = load_model(models / "rm").eval()
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(models / "rm_hf", dtype=torch.float32)
    back = load_model(models / "rm_hf").eval()  # the export read back: a transformers directory of one label
    ids = pair_batch(models)["input_ids"].flatten(0, 1)
    pad = ours.config.pad_token_id
    ids[0, -1] = pad  # a row whose last real token shares the padding id: read one token earlier, both sides
    with torch.no_grad():
        scores, _ = sequence_scores(ours, ids)
        reference = theirs.eval()(input_ids=ids).logits.squeeze(-1)
        again, _ = sequence_scores(back, ids)
    assert scores.std() > 0.1  # distinct scores: the comparison can fail
    assert torch.allclose(scores, reference, atol=1e-5, rtol=0), (scores - reference).abs().max()
    assert torch.equal(scores, again)
    assert last_token_index(ids, pad).tolist() == [int((row != pad).nonzero().max()) for row in ids]


def test_loss_and_gradients_equal_trls_reward_trainer(models):
    trl, datasets = pytest.importorskip("trl"), pytest.importorskip("datasets")
    batch = pair_batch(models)
    ours = load_model(models / "rm").train()
    loss, metrics = reward_model_batch_loss(ours, batch, center_coef=0.01, moe_aux_loss_coef=0.0)
    loss.backward()
    policy = transformers.AutoModelForSequenceClassification.from_pretrained(models / "rm_hf", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(models / "rm_hf")
    config = trl.RewardConfig(
        output_dir=str(models / "trl"), report_to=[], use_cpu=True, bf16=False, center_rewards_coefficient=0.01
    )
    with warnings.catch_warnings():  # its dataset preparation warns about our one-row placeholder
        warnings.simplefilter("ignore")
        trainer = trl.RewardTrainer(
            model=policy,
            args=config,
            processing_class=tokenizer,
            train_dataset=datasets.Dataset.from_list([{"chosen": "a", "rejected": "b"}]),
        )
    ids, attention = batch["input_ids"], batch["attention_mask"].long()
    inputs = {
        "input_ids": ids.transpose(0, 1).flatten(0, 1),
        "attention_mask": attention.transpose(0, 1).flatten(0, 1),
        "margin": batch["margin"],
    }
    trainer.model.train()
    their_loss = trainer.compute_loss(trainer.model, inputs)
    their_loss.backward()
    assert batch["margin"].tolist() == [0.0, 0.25, 0.5]
    assert loss.item() == pytest.approx(their_loss.item(), abs=1e-6)
    assert metrics["accuracy"].item() == pytest.approx(trainer._metrics["train"]["accuracy"][-1], abs=1e-6)
    for mine, hf_name in (
        ("score.weight", "score.weight"),
        ("layers.1.mlp.down.weight", "model.layers.1.mlp.down_proj.weight"),
    ):
        mine_grad = dict(ours.named_parameters())[mine].grad
        their_grad = dict(trainer.model.named_parameters())[hf_name].grad
        assert_same_gradient(mine_grad, their_grad, mine)


def test_the_scorer_pads_with_the_reward_models_id(models):
    scorer = RewardModelScorer(models / "rm", torch.device("cpu"), Tokenizer.from_dir(models / "lm"))
    assert scorer.tokenizer is None  # the policy's vocabulary: its ids are scored as sampled
    sequences = [[5, 6, 7, 8, 9], [5, 6], [11, 12, 13]]
    individually = torch.cat([scorer.score_ids([s]) for s in sequences])
    assert torch.allclose(scorer.score_ids(sequences), individually, atol=1e-5, rtol=0)  # batched sums differ in order
    prompts, responses = [[5, 6], [5], [11, 12]], [[7, 8, 9], [6], [13]]
    assert torch.equal(scorer(prompts, responses, [{}] * 3, [""] * 3), scorer.score_ids(sequences))


def test_a_reward_model_of_another_vocabulary_scores_each_conversation_rendered_again(models, tmp_path):
    """As TRL re-tokenises for a reward model of another tokenizer: the record's prompt and the response's text
    through the reward model's own chat template (here the bundled tokenizer with two ids swapped)."""
    other = tmp_path / "rm_other_vocabulary"
    shutil.copytree(models / "rm", other)
    vocabulary = json.loads((other / "tokenizer.json").read_text())
    vocab = vocabulary["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # the same size, other ids
    (other / "tokenizer.json").write_text(json.dumps(vocabulary))
    policy = Tokenizer.from_dir(models / "lm")
    scorer = RewardModelScorer(other, torch.device("cpu"), policy)
    assert scorer.tokenizer is not None
    records, texts = [{"prompt": f"Say {first}{second} twice."}, {"prompt": "What is 2 + 2?"}], [first + second, "4"]
    prompt_ids = [policy.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in records]
    response_ids = [policy.encode(t, add_special_tokens=False) for t in texts]
    theirs = [
        scorer.tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": t}], add_generation_prompt=False
        )
        for r, t in zip(records, texts, strict=True)
    ]
    assert theirs[0] != prompt_ids[0] + response_ids[0]  # the swapped tokens: other ids than the policy's
    assert torch.equal(scorer(prompt_ids, response_ids, records, texts), scorer.score_ids(theirs))


def test_recipe_starts_at_log_2_resumes_exactly_and_scores_online_rollouts(models, tmp_path, capsys):
    common = [
        "reward_model",
        "--config",
        str(ROOT / "recipes" / "tiny-reward-model.yaml"),
        "--param_path",
        str(models / "lm"),
        "--max_steps",
        "4",
        "--ckpt_interval",
        "2",
        "--batch_per_device",
        "2",
        "--grad_accum_steps",
        "1",
        "--window_size",
        "48",
        "--loggers",
        "[]",
    ]
    assert_resume_is_bit_exact(common, tmp_path, weights="model.safetensors")
    assert "score.weight" in load_file(tmp_path / "full" / "epoch_0_step_4" / "model.safetensors")
    metrics = (tmp_path / "full" / "epoch_0_step_4" / "metric.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in metrics if "reward_margin" in line]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the head starts at zeros: every pair level
    assert steps[-1]["reward_margin"] != 0
    fresh = [
        "reward_model",
        "--config",
        str(ROOT / "recipes" / "tiny-reward-model.yaml"),
        "--max_steps",
        "1",
        "--batch_per_device",
        "2",
        "--ckpt_dir",
        str(tmp_path / "fresh"),
        "--loggers",
        "[]",
    ]
    assert main(fresh) == 0  # the recipe as written: the bundled model has no weights, AstrAI's init, a zero head
    lines = (tmp_path / "fresh" / "epoch_0_step_1" / "metric.jsonl").read_text().splitlines()
    (first,) = [entry for entry in map(json.loads, lines) if entry["type"] == "step"]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7) and first["reward_margin"] == 0
    capsys.readouterr()
    # Online grpo scored by the reward model just trained; online dpo ranked by a transformers export of one.
    for train_type, rm in (("grpo", str(tmp_path / "full" / "epoch_0_step_4")), ("dpo", str(models / "rm_hf"))):
        out = tmp_path / f"online_{train_type}"
        argv = [
            train_type,
            "--config",
            str(ROOT / "recipes" / "tiny-grpo-online.yaml"),
            "--param_path",
            str(models / "lm"),
            "--reward",
            "null",
            "--reward_model",
            rm,
            "--ckpt_dir",
            str(out),
            "--max_steps",
            "1",
            "--batch_per_device",
            "2",
            "--rollout_max_tokens",
            "4",
            "--loggers",
            "[]",
        ]
        assert main(argv) == 0
        verb = "scored" if train_type == "grpo" else "ranked"
        assert f"{verb} by the reward model {rm}" in capsys.readouterr().out
        assert (out / "epoch_0_step_1" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--reward", "astrai_fabric.rewards.LengthReward", "--reward_model", "x"],
         "reward and reward_model both score rollouts"),
        (["--lora_r", "4"], "reward_model trains the whole network and its score head"),
        (["--reward_center_coef", "-1"], "reward_center_coef must be >= 0"),
        (["--data_root_path", "bundled:data/grpo_online"], "a reward model trains on preference pairs"),
    ],
)  # fmt: skip
def test_bad_reward_model_flags_are_one_line_exit_2(models, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    argv = [
        "reward_model",
        "--config",
        str(ROOT / "recipes" / "tiny-reward-model.yaml"),
        "--ckpt_dir",
        str(out),
        "--param_path",
        str(models / "lm"),
        *flags,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not out.exists()


def test_a_bad_margin_is_one_line_naming_the_record(models, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c", "margin": "high"}) + "\n")
    out = tmp_path / "run"
    argv = [
        "reward_model",
        "--config",
        str(ROOT / "recipes" / "tiny-reward-model.yaml"),
        "--ckpt_dir",
        str(out),
        "--param_path",
        str(models / "lm"),
        "--data_root_path",
        str(data),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"{data}:1: 'margin' must be a finite number" in err and not out.exists()


def test_models_of_the_wrong_kind_are_refused_in_one_line(models, tmp_path, capsys):
    online = [
        "grpo",
        "--config",
        str(ROOT / "recipes" / "tiny-grpo-online.yaml"),
        "--param_path",
        str(models / "lm"),
        "--reward",
        "null",
        "--ckpt_dir",
        str(tmp_path / "run"),
    ]
    small = tmp_path / "rm_small_vocabulary_no_tokenizer"  # its config alone is read before it is refused
    small.mkdir()
    config = json.loads((models / "rm" / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    cases = [
        ([*online, "--reward_model", str(models / "lm")], "a language model, not a reward model"),
        ([*online, "--reward_model", str(small)], "holds no tokenizer of its own to read the rollouts with"),
        (
            [
                "sft",
                "--config",
                str(ROOT / "recipes" / "tiny-sft.yaml"),
                "--param_path",
                str(models / "rm"),
                "--ckpt_dir",
                str(tmp_path / "run"),
            ],
            "(a score head, no LM head): it trains with reward_model, not sft",
        ),
        (
            ["generate", "--param_path", str(models / "rm"), "--prompt", "hi"],
            "a reward model (a score head, no LM head), which generate cannot run",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_classifier_of_two_labels_is_refused(models, tmp_path):

    shutil.copytree(models / "rm_hf", tmp_path / "two")
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    config["id2label"] = {"0": "no", "1": "yes"}
    (tmp_path / "two" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_labels 2 is not supported: a classifier of several labels"):
        read_model_config(tmp_path / "two")


def test_lora_online_dpo_ranked_by_a_reward_model_resumes_bit_exactly(models, tmp_path):
    """Rollouts are seeded by position and every step is a rollout boundary here (``rollout_interval`` 1), so the
    resumed run samples, scores and ranks what the first one did."""
    common = [
        "dpo",
        "--config",
        str(ROOT / "recipes" / "tiny-online-dpo.yaml"),
        "--param_path",
        str(models / "lm"),
        "--reward",
        "null",
        "--reward_model",
        str(models / "rm"),
        "--lora_r",
        "4",
        "--max_steps",
        "4",
        "--ckpt_interval",
        "2",
        "--batch_per_device",
        "2",
        "--grad_accum_steps",
        "1",
        "--rollout_interval",
        "1",
        "--rollout_max_tokens",
        "4",
        "--loggers",
        "[]",
    ]
    assert_resume_is_bit_exact(common, tmp_path)


# --- SFT -> reward model -> transformers -> online grpo, from a Hugging Face model -----------------------------------

SCORE_TOLERANCE = 2e-6
"""Max abs score difference from transformers' ``*ForSequenceClassification`` over our export, float32 (issue 40)."""


SHORT_RUN = "--window_size 32 --batch_per_device 2 --grad_accum_steps 1 --max_lr 1e-2 --parallel_mode none".split()
"""lr 1e-2: a score head grown from zeros in a step or two scores rows apart."""


def run_argv(train_type: str, param_path: Path, data: str, ckpt_dir: Path, steps: int = 2, *extra: str) -> list[str]:
    """A short in-process CLI run of ``steps`` steps, checkpointed at the last."""
    where = ["--param_path", str(param_path), "--data_root_path", data, "--ckpt_dir", str(ckpt_dir)]
    steps_flags = ["--max_steps", str(steps), "--ckpt_interval", str(steps), "--num_workers", "0", "--loggers", "[]"]
    return [train_type, *where, *steps_flags, *SHORT_RUN, *extra]


@pytest.fixture(scope="module")
def from_hf(tmp_path_factory) -> dict[str, Path]:
    """The starting points of a reward model a user coming from transformers has: a random Qwen3 built with
    transformers and saved with ``save_pretrained`` (the bundled tokenizer beside it, nothing downloaded), our sft
    checkpoint of it (2 steps), a LoRA sft checkpoint of it (the adapter and a pointer to the base) and that one
    merged by ``export --merge_lora``."""
    root = tmp_path_factory.mktemp("from_hf")
    vocab = read_model_config(assets.resolve("bundled:tiny")).vocab_size
    base = save_hf(build_hf("Qwen3Config", vocab_size=vocab, head_dim=8, max_position_embeddings=256), root / "base")
    for name in TOKENIZER_FILES:
        shutil.copy(assets.resolve("bundled:tiny") / name, base / name)
    assert main(run_argv("sft", base, "bundled:data/sft", root / "sft")) == 0
    assert main(run_argv("sft", base, "bundled:data/sft", root / "lora", 2, "--lora_r", "4")) == 0
    lora = root / "lora" / "epoch_0_step_2"
    assert main(["export", str(lora), "--merge_lora", "--out", str(root / "merged")]) == 0
    return {"hf_directory": base, "sft": root / "sft" / "epoch_0_step_2", "lora": lora, "merge_lora": root / "merged"}


def assert_export_scores_as_ours(reward_model: Path, out: Path, architecture: str) -> None:
    """``export --format hf`` of ``reward_model`` loads in transformers as ``architecture`` and scores right-padded
    rows as ours does. Reference: transformers' ``AutoModelForSequenceClassification`` over that export (its score at
    each row's last token that is not ``pad_token_id``), float32, within ``SCORE_TOLERANCE``."""
    assert main(["export", str(reward_model), "--format", "hf", "--out", str(out)]) == 0
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == architecture
    ours = load_model(reward_model).float().eval()
    pad = ours.config.pad_token_id
    ids = torch.randint(0, ours.config.vocab_size, (4, 20), generator=torch.Generator().manual_seed(1))
    ids[1, 12:], ids[2, 5:], ids[3, -1] = pad, pad, pad  # padded rows, and a last real token sharing the id
    with torch.no_grad():
        scores, _ = sequence_scores(ours, ids)
        reference = theirs(input_ids=ids).logits.squeeze(-1)
    diff = (scores - reference).abs().max().item()
    print(f"{reward_model}: scores {scores.tolist()}, max |diff| from transformers {diff:.1e}", file=sys.stderr)
    assert scores.std() > 1e-3, scores  # rows scored apart: the comparison can fail
    assert diff <= SCORE_TOLERANCE, (scores, reference)


def test_sft_of_a_huggingface_model_to_a_reward_model_to_transformers_to_online_grpo(from_hf, tmp_path, capsys):
    """The SFT -> RM -> RL path of issue 40: the reward model's ``meta.json`` ``source`` is its family's classifier
    (what its weights compute), so export writes ``Qwen3ForSequenceClassification``; online grpo from the sft
    checkpoint is scored by the reward model's checkpoint and by its export alike."""
    assert main(run_argv("reward_model", from_hf["sft"], "bundled:data/dpo", tmp_path / "rm")) == 0
    rm = tmp_path / "rm" / "epoch_0_step_2"
    source = json.loads((rm / "meta.json").read_text())["source"]
    pad = read_model_config(rm).pad_token_id
    assert source["architecture"] == "Qwen3ForSequenceClassification" and source["config"]["pad_token_id"] == pad
    assert_export_scores_as_ours(rm, tmp_path / "rm_hf", "Qwen3ForSequenceClassification")
    capsys.readouterr()
    for name, reward_model in (("checkpoint", rm), ("export", tmp_path / "rm_hf")):
        out = tmp_path / f"grpo_{name}"
        recipe = ["--config", str(ROOT / "recipes" / "tiny-grpo-online.yaml"), "--param_path", str(from_hf["sft"])]
        short = "--reward null --max_steps 1 --batch_per_device 2 --rollout_max_tokens 4 --loggers []".split()
        argv = ["grpo", *recipe, *short, "--reward_model", str(reward_model), "--ckpt_dir", str(out)]
        assert main(argv) == 0
        assert f"scored by the reward model {reward_model}" in capsys.readouterr().out
        assert (out / "epoch_0_step_1" / "model.safetensors").is_file()
    # The record is still checked: a source whose padding is not the reward model's describes another model.
    broken = tmp_path / "broken"
    shutil.copytree(rm, broken)
    meta = json.loads((broken / "meta.json").read_text())
    meta["source"]["config"]["pad_token_id"] = pad + 1
    (broken / "meta.json").write_text(json.dumps(meta))
    assert main(["export", str(broken), "--format", "hf", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "'source' describes another model than config.json (they differ in ['pad_token_id'])" in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("start", "architecture"),
    [
        ("hf_directory", "Qwen3ForSequenceClassification"),  # the transformers directory itself
        ("lora", "Qwen3ForSequenceClassification"),  # a LoRA checkpoint: its adapter merged into the base on reading
        ("merge_lora", "Qwen3ForSequenceClassification"),  # export --merge_lora's directory
        ("astrai_layout", "LlamaForSequenceClassification"),  # AstrAI's layout: the class computing its function
    ],
)  # fmt: skip
def test_a_reward_model_starts_from_any_checkpoint_and_exports_to_its_sequence_classifier(
    from_hf, models, tmp_path, start, architecture
):
    param_path = models / "lm" if start == "astrai_layout" else from_hf[start]
    assert main(run_argv("reward_model", param_path, "bundled:data/dpo", tmp_path / "rm", 1)) == 0
    rm = tmp_path / "rm" / "epoch_0_step_1"
    meta = json.loads((rm / "meta.json").read_text())
    assert meta.get("source", {}).get("architecture") == (None if start == "astrai_layout" else architecture)
    assert_export_scores_as_ours(rm, tmp_path / "rm_hf", architecture)


HOSTILE_SOURCES = [
    ("unknown_model_type", {"model_type": "foo", "config": {"model_type": "foo"}},
     "'source' config: Hugging Face model_type 'foo' is not supported (unknown architecture)"),
    ("model_type_a_list", {"model_type": ["x"], "config": {"model_type": ["x"]}},
     "'source' must be {format: 'huggingface', model_type, architecture, config} with the config's own model_type"),
    ("multimodal_without_text_config", {"model_type": "gemma3", "config": {"model_type": "gemma3", "text_config": 3}},
     "'source' config: a multimodal gemma3 config needs a 'text_config' object"),
    ("architectures_a_number", {"model_type": "llama", "config": {"model_type": "llama", "architectures": 3}},
     "'source' config: architectures 3 is not supported: expected a list of transformers class names"),
]  # fmt: skip


@pytest.mark.parametrize("kind", ["lm", "rm"])
@pytest.mark.parametrize(("value", "message"), [c[1:] for c in HOSTILE_SOURCES], ids=[c[0] for c in HOSTILE_SOURCES])
def test_a_hostile_source_record_is_one_line_exit_2(models, tmp_path, capsys, kind, value, message):
    """A language model's and a reward model's ``meta.json`` ``source`` (the reward model's read as its family's
    classifier first) are refused alike, in one line, before anything is written."""
    checkpoint = tmp_path / kind
    shutil.copytree(models / kind, checkpoint)
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["source"] = {"format": "huggingface", "architecture": "X", **value}
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    assert main(["export", str(checkpoint), "--format", "hf", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "out").exists(), err
