"""Reward models (``astrai-fabric reward_model``, ``--reward_model``): scores, loss and gradients against
transformers' ``*ForSequenceClassification`` and TRL 1.16's ``RewardTrainer``, the checkpoint and its export, the
recipe from log 2, online rollouts scored by one, resume, and the one-line refusals.

References: transformers 5's ``LlamaForSequenceClassification`` over our ``export --format hf`` (the score at each
row's last token that is not ``pad_token_id``: ``GenericForSequenceClassification``), and TRL's
``RewardTrainer.compute_loss`` over the same export, fed the very ids our collate makes (chosen rows, then rejected
rows, as TRL chunks them), with a margin per pair and ``center_rewards_coefficient``: float32, loss within 1e-6,
gradients within 1e-6.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_resume_is_bit_exact
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
        assert torch.allclose(mine_grad, their_grad, atol=1e-6, rtol=0), (mine, (mine_grad - their_grad).abs().max())


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
    first = json.loads((tmp_path / "fresh" / "epoch_0_step_1" / "metric.jsonl").read_text().splitlines()[-1])
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
