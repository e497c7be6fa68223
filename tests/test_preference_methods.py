"""dpo's loss variants (--dpo_loss), kto and grpo's loss variants (--grpo_loss) checked against TRL 1.16's own
trainers, and each method's recipe run.

References: TRL's ``DPOTrainer._compute_loss`` (sigmoid, ipo, hinge, robust), ``trl.experimental``'s
``CPOTrainer.get_batch_loss_metrics`` (simpo with ``cpo_alpha 0``, cpo) and ``ORPOTrainer.get_batch_loss_metrics``
(orpo), each built over our ``export --format hf`` of the same policy (and reference) and fed the very token ids,
masks and pairs our collate makes: the loss within 1e-5 and the gradient of one MLP weight within 1e-5 of its
largest entry (float32, tests/equality.py).
At step 1 a policy is its own reference, so the reference losses start at their formula's value there.
"""

from __future__ import annotations

import json
import math
import re
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_resume_is_bit_exact
from equality import assert_same_gradient
from safetensors.torch import load_file

from astrai_fabric import assets
from astrai_fabric.checkpoint import load_model, read_model_config, save_checkpoint
from astrai_fabric.checkpoint.position import RunPosition
from astrai_fabric.cli import main
from astrai_fabric.config import ModelConfig
from astrai_fabric.data.records import (
    GroupDataset,
    PreferenceDataset,
    UnpairedDataset,
    collate_groups,
    collate_preferences,
    collate_unpaired,
    pack,
)
from astrai_fabric.data.storage import read_records
from astrai_fabric.losses import PREFERENCE_LOSSES, REFERENCE_FREE
from astrai_fabric.model import AutoRegressiveLM, next_token_logprobs
from astrai_fabric.policy_losses import RatioShape, grpo_advantages, rloo_advantages
from astrai_fabric.schedule import StepPlan
from astrai_fabric.tokenizer import Tokenizer
from astrai_fabric.train.dpo import PreferenceArgs, dpo_batch_loss, online_dpo_batch_loss
from astrai_fabric.train.grpo import (
    REWARD_STD,
    TOKENS_PER_MICRO_BATCH,
    GRPOLossArgs,
    batch_statistics,
    grpo_batch_loss,
)
from astrai_fabric.train.kto import kto_batch_loss

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

ROOT = Path(__file__).parents[1]
SETTINGS = {  # each loss with its own knobs away from their defaults, so a dropped one shows
    "sigmoid": {}, "ipo": {}, "hinge": {}, "robust": {"label_smoothing": 0.1},
    "simpo": {"label_smoothing": 0.1, "simpo_gamma": 0.3}, "cpo": {"label_smoothing": 0.1, "cpo_alpha": 0.7},
    "orpo": {"orpo_beta": 0.2},
}  # fmt: skip


def test_every_loss_is_a_flag_value_and_has_settings_here():
    from typing import get_args, get_type_hints

    from astrai_fabric.config.train import TrainArgs

    assert get_args(get_type_hints(TrainArgs)["dpo_loss"]) == PREFERENCE_LOSSES == tuple(SETTINGS)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Two different random tiny models (policy and reference) in our layout and as Hugging Face directories."""
    root = tmp_path_factory.mktemp("preference")
    source = assets.resolve("bundled:tiny")
    config = ModelConfig.from_dict({**read_model_config(source).to_dict(), "num_hidden_layers": 2})
    files = {name: source / name for name in ("tokenizer.json", "tokenizer_config.json")}
    for name, seed in (("policy", 0), ("reference", 1)):
        torch.manual_seed(seed)
        save_checkpoint(root / name, AutoRegressiveLM(config).state_dict(), config.to_dict(), files=files)
        assert main(["export", str(root / name), "--format", "hf", "--out", str(root / f"{name}_hf")]) == 0
    return root


def pairs_batch(root: Path) -> dict[str, torch.Tensor]:
    """Three bundled pairs as our dpo collate makes them: ``[3, 2, L]``, chosen then rejected, right-padded."""
    tokenizer = Tokenizer.from_dir(root / "policy")
    dataset = PreferenceDataset(read_records(assets.resolve("bundled:data/dpo"))[:3], tokenizer, 64)
    return collate_preferences([dataset[i] for i in range(3)], tokenizer.padding_id)


def trl_loss(kind: str, root: Path, batch: dict, args: PreferenceArgs) -> tuple[torch.Tensor, dict, torch.nn.Module]:
    """TRL's loss of ``batch`` (and its metrics, and its policy for the gradient)."""
    policy = transformers.AutoModelForCausalLM.from_pretrained(root / "policy_hf", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "policy_hf")
    dataset = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # __init__ needs one
    common = dict(output_dir=str(root / "trl"), report_to=[], use_cpu=True, bf16=False, beta=args.beta)  # float32
    ids, attention, mask = batch["input_ids"], batch["attention_mask"].long(), batch["loss_mask"]
    with warnings.catch_warnings():  # its dataset preparation warns about our one-row placeholder
        warnings.simplefilter("ignore")
        if kind in ("simpo", "cpo", "orpo"):
            from trl.experimental.cpo import CPOConfig, CPOTrainer
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            if kind == "orpo":
                trainer = ORPOTrainer(
                    model=policy,
                    args=ORPOConfig(**{**common, "beta": args.orpo_beta}),
                    train_dataset=dataset,
                    processing_class=tokenizer,
                )
            else:  # SimPO is TRL's CPOTrainer with loss_type simpo and no NLL term (cpo_alpha 0)
                config = CPOConfig(
                    **common,
                    loss_type="simpo" if kind == "simpo" else "sigmoid",
                    label_smoothing=args.label_smoothing,
                    simpo_gamma=args.simpo_gamma,
                    cpo_alpha=0.0 if kind == "simpo" else args.cpo_alpha,
                )
                trainer = CPOTrainer(model=policy, args=config, train_dataset=dataset, processing_class=tokenizer)
            inputs = {
                f"{side}_{key}": value
                for i, side in enumerate(("chosen", "rejected"))
                for key, value in (
                    ("input_ids", ids[:, i]),
                    ("attention_mask", attention[:, i]),
                    ("labels", ids[:, i].masked_fill(~mask[:, i], -100)),
                )
            }
            trainer.model.train()
            loss, metrics = trainer.get_batch_loss_metrics(trainer.model, inputs, "train")
        else:
            reference = transformers.AutoModelForCausalLM.from_pretrained(root / "reference_hf", dtype=torch.float32)
            config = trl.DPOConfig(**common, loss_type=kind, label_smoothing=args.label_smoothing)
            trainer = trl.DPOTrainer(
                model=policy, ref_model=reference, args=config, train_dataset=dataset, processing_class=tokenizer
            )
            inputs = {
                "input_ids": ids.transpose(0, 1).flatten(0, 1),  # TRL's layout: every chosen, then every rejected
                "attention_mask": attention.transpose(0, 1).flatten(0, 1),
                "completion_mask": mask.long().transpose(0, 1).flatten(0, 1),
            }
            trainer.model.train()
            loss, metrics = trainer._compute_loss(trainer.model, inputs, return_outputs=False), {}
    return loss, metrics, policy


@pytest.mark.parametrize("kind", PREFERENCE_LOSSES)
def test_each_loss_matches_trl(models, kind):
    batch = pairs_batch(models)
    args = PreferenceArgs(kind=kind, beta=0.1, **SETTINGS[kind])
    ours = load_model(models / "policy_hf")
    reference = None if kind in REFERENCE_FREE else load_model(models / "reference_hf")
    loss, metrics = dpo_batch_loss(ours, batch, reference, args.beta, 0.0, preference=args)
    loss.backward()
    theirs, their_metrics, their_policy = trl_loss(kind, models, batch, args)
    if kind == "orpo":
        # TRL's ORPOTrainer takes the NLL over the whole chosen sequence, prompt included (its concatenated_forward:
        # labels are input_ids wherever attention_mask is 1); ours over the chosen response's tokens, as CPO's NLL
        # in TRL and our sft: the odds-ratio terms must agree, and our NLL is the response tokens' mean.
        theirs = theirs - their_metrics["nll_loss"]
        assert metrics["dpo_loss"].item() == pytest.approx(theirs.item(), abs=1e-5)
        ids, mask = batch["input_ids"][:, 0], batch["loss_mask"][:, 0, 1:]
        with torch.no_grad():
            logprobs = torch.log_softmax(load_model(models / "policy_hf")(ids)["logits"][:, :-1], -1)
        nll = -logprobs.gather(-1, ids[:, 1:, None])[..., 0][mask].mean()
        assert metrics["nll_loss"].item() == pytest.approx(nll.item(), abs=1e-5)
        return
    print(
        f"{kind}: ours {loss.item():.6f}, TRL {theirs.item():.6f}, |diff| {abs(loss.item() - theirs.item()):.1e}",
        file=sys.stderr,
    )
    assert loss.item() == pytest.approx(theirs.item(), abs=1e-5)
    theirs.backward()
    their_grad = their_policy.model.layers[0].mlp.down_proj.weight.grad
    assert_same_gradient(ours.layers[0].mlp.down.weight.grad, their_grad)
    if kind in ("simpo", "cpo"):  # the rewards TRL logs: beta x the log-probabilities the loss compares
        assert metrics["chosen_reward"].item() == pytest.approx(their_metrics["rewards/chosen"], abs=1e-5)


STEP_1 = {"sigmoid": math.log(2), "ipo": (1 / (2 * 0.1)) ** 2, "hinge": 1.0, "robust": math.log(2)}
"""Each reference loss at step 1, where the policy is its reference (d = 0), with the recipes' beta 0.1."""
RECIPES = {"tiny-dpo.yaml": "sigmoid", "tiny-dpo-ipo.yaml": "ipo", "tiny-dpo-hinge.yaml": "hinge",
           "tiny-dpo-robust.yaml": "robust", "tiny-simpo.yaml": "simpo", "tiny-cpo.yaml": "cpo",
           "tiny-orpo.yaml": "orpo"}  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_runs(recipe, tmp_path, capsys):
    kind = RECIPES[recipe]
    out = tmp_path / "run"
    argv = [
        "dpo",
        "--config",
        str(ROOT / "recipes" / recipe),
        "--ckpt_dir",
        str(out),
        "--max_steps",
        "2",
        "--batch_per_device",
        "2",
        "--grad_accum_steps",
        "1",
        "--window_size",
        "48",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    (checkpoint,) = out.glob("epoch_*_step_2")
    meta = json.loads((checkpoint / "meta.json").read_text())
    entries = [json.loads(line) for line in (checkpoint / "metric.jsonl").read_text().splitlines()]
    steps = [e for e in entries if e.get("type") == "step" or "dpo_loss" in e]
    assert meta["dpo_loss"] == kind and all(math.isfinite(e["loss"]) for e in steps)
    if kind in REFERENCE_FREE:
        assert "reference" not in meta and "reference model: none (--dpo_loss" in printed
        assert f"dpo loss {kind}" in printed and "no reference model" in printed
    else:
        assert meta["reference"]["param_path"] is None  # the seeded initialisation, as the policy's
        assert steps[0]["dpo_loss"] == pytest.approx(STEP_1[kind], abs=1e-5)


@pytest.mark.parametrize(
    ("recipe", "flag", "value"),
    [
        ("tiny-simpo.yaml", "simpo_beta", "2.0"),  # the recipe as written (dpo_beta: 2.0 before)
        ("tiny-cpo.yaml", "cpo_beta", "0.5"),
        ("tiny-kto.yaml", "kto_beta", "0.5"),
    ],
)
def test_dpo_beta_still_spells_simpo_cpo_and_kto_beta(recipe, flag, value, tmp_path, capsys):
    """A recipe as written before its method's own beta (tiny-simpo.yaml's ``dpo_beta: 2.0``) trains exactly as
    with the new flag, with one FutureWarning naming it; both spellings at once are refused in one line."""
    command, method = ("kto", "kto") if flag == "kto_beta" else ("dpo", f"dpo --dpo_loss {flag[:-5]}")
    text = (ROOT / "recipes" / recipe).read_text()
    assert f"\n{flag}: " in text and "dpo_beta" not in text
    for name, key in (("new", flag), ("old", "dpo_beta")):
        (tmp_path / f"{name}.yaml").write_text(re.sub(rf"\n{flag}: .*\n", f"\n{key}: {value}\n", text))
    common = ["--max_steps", "2", "--batch_per_device", "4", "--grad_accum_steps", "1", "--window_size", "48"]
    new_run, old_run = (tmp_path / run / "epoch_0_step_2" for run in ("new", "old"))
    assert main([command, "--config", str(tmp_path / "new.yaml"), "--ckpt_dir", str(new_run.parent), *common]) == 0
    with pytest.warns(FutureWarning) as caught:
        assert main([command, "--config", str(tmp_path / "old.yaml"), "--ckpt_dir", str(old_run.parent), *common]) == 0
    assert [str(w.message) for w in caught] == [
        f"--dpo_beta {float(value):g} read as --{flag}, its deprecated spelling for {method}: write {flag}"
    ]
    assert (new_run / "model.safetensors").read_bytes() == (old_run / "model.safetensors").read_bytes()
    losses = [
        [json.loads(line)["loss"] for line in (run / "metric.jsonl").open() if '"type": "step"' in line]
        for run in (new_run, old_run)
    ]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    capsys.readouterr()
    both = [command, "--config", str(tmp_path / "old.yaml"), f"--{flag}", "2.5", "--ckpt_dir", str(tmp_path / "both")]
    assert main(both) == 2
    err = capsys.readouterr().err
    assert f"{flag} 2.5 and dpo_beta {float(value)}, its deprecated spelling, both set {method}'s beta" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "both").exists()


@pytest.mark.parametrize(
    ("train_type", "loss", "flags", "beta"),
    [
        ("dpo", "sigmoid", {"dpo_beta": 0.3}, 0.3),  # AstrAI's --dpo_beta, unchanged
        ("dpo", "ipo", {}, 0.1),
        ("dpo", "orpo", {"dpo_beta": 0.3}, 0.3),  # read by no loss: orpo's lambda is --orpo_beta
        ("dpo", "simpo", {"simpo_beta": 2.0}, 2.0),
        ("dpo", "simpo", {"dpo_beta": 2.0}, 2.0),
        ("dpo", "simpo", {}, 0.1),
        ("dpo", "cpo", {"cpo_beta": 0.2}, 0.2),
        ("dpo", "cpo", {"dpo_beta": 0.2}, 0.2),
        ("kto", "sigmoid", {"kto_beta": 0.2}, 0.2),
        ("kto", "sigmoid", {"dpo_beta": 0.2}, 0.2),
        ("kto", "sigmoid", {}, 0.1),
    ],
)
def test_each_method_reads_its_own_beta_or_dpo_beta(train_type, loss, flags, beta):
    from astrai_fabric.config.train import TrainArgs

    data = f"bundled:data/{train_type}"
    args = TrainArgs(train_type=train_type, dpo_loss=loss, param_path="bundled:tiny", data_root_path=data, **flags)
    deprecated = "dpo_beta" in flags and args.beta_flag != "dpo_beta"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args.validate()
    assert [str(w.message).split(":")[-1] for w in caught] == ([f" write {args.beta_flag}"] if deprecated else [])
    assert args.preference_beta == beta and PreferenceArgs.from_args(args).beta == beta


def test_lora_cpo_resumes_bit_exactly(models, tmp_path):
    common = [
        "dpo",
        "--param_path",
        str(models / "policy_hf"),
        "--data_root_path",
        "bundled:data/dpo",
        "--dpo_loss",
        "cpo",
        "--lora_r",
        "4",
        "--window_size",
        "48",
        "--batch_per_device",
        "2",
        "--max_steps",
        "4",
        "--ckpt_interval",
        "2",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
    ]
    assert_resume_is_bit_exact(common, tmp_path)


# --- kto -------------------------------------------------------------------------------------------------------


def unpaired_batch(root: Path) -> dict[str, torch.Tensor]:
    """Six bundled kto records (both labels among them) as our collate makes them, with their mismatched pairs."""
    tokenizer = Tokenizer.from_dir(root / "policy")
    dataset = UnpairedDataset(read_records(assets.resolve("bundled:data/kto"))[:6], tokenizer, 64)
    batch = collate_unpaired([dataset[i] for i in range(6)], tokenizer.padding_id)
    assert 0 < int(batch["desirable"].sum()) < 6
    return batch


def test_kto_matches_trl(models):
    """TRL's ``KTOTrainer._compute_loss`` fed the same samples and mismatched pairs: loss, KL baseline and the
    gradient of an MLP weight."""
    batch = unpaired_batch(models)
    ours = load_model(models / "policy_hf")
    one_rank = lambda log_ratios: log_ratios.mean().clamp(min=0)  # noqa: E731 - kto.kl_baseline's, 1 process
    loss, metrics = kto_batch_loss(
        ours,
        batch,
        load_model(models / "reference_hf"),
        one_rank,
        beta=0.1,
        desirable_weight=1.3,
        undesirable_weight=0.8,
        moe_aux_loss_coef=0.0,
    )
    loss.backward()
    policy = transformers.AutoModelForCausalLM.from_pretrained(models / "policy_hf", dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(models / "reference_hf", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(models / "policy_hf")
    dataset = datasets.Dataset.from_list(
        [{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}]
    )
    config = trl.KTOConfig(
        output_dir=str(models / "trl"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        beta=0.1,
        desirable_weight=1.3,
        undesirable_weight=0.8,
        per_device_train_batch_size=2,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.KTOTrainer(
            model=policy, ref_model=reference, args=config, train_dataset=dataset, processing_class=tokenizer
        )
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"].long(),
        "completion_mask": batch["loss_mask"].long(),
        "KL_input_ids": batch["kl_input_ids"],
        "KL_attention_mask": batch["kl_attention_mask"].long(),
        "KL_completion_mask": batch["kl_loss_mask"].long(),
        "label": batch["desirable"],
    }
    trainer.model.train()
    theirs = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    print(
        f"kto: ours {loss.item():.6f}, TRL {theirs.item():.6f}, |diff| {abs(loss.item() - theirs.item()):.1e}",
        file=sys.stderr,
    )
    assert loss.item() == pytest.approx(theirs.item(), abs=1e-5)
    assert metrics["kl"].item() == pytest.approx(trainer._metrics["train"]["kl"][-1], abs=1e-5)
    theirs.backward()
    their_grad = policy.model.layers[0].mlp.down_proj.weight.grad
    assert_same_gradient(ours.layers[0].mlp.down.weight.grad, their_grad)


def test_kto_recipe_runs_from_one_half(tmp_path, capsys):
    """At step 1 the policy is its reference: every sample's log-ratio and the baseline are 0, so each loss is
    1 - sigmoid(0) = 1/2."""
    argv = [
        "kto",
        "--config",
        str(ROOT / "recipes" / "tiny-kto.yaml"),
        "--ckpt_dir",
        str(tmp_path / "run"),
        "--max_steps",
        "2",
        "--batch_per_device",
        "4",
        "--grad_accum_steps",
        "1",
        "--window_size",
        "48",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "unpaired preferences from" in printed and "desirable" in printed
    (checkpoint,) = (tmp_path / "run").glob("epoch_*_step_2")
    entries = [json.loads(line) for line in (checkpoint / "metric.jsonl").read_text().splitlines()]
    steps = [e for e in entries if "kto_loss" in e]
    assert steps[0]["kto_loss"] == pytest.approx(0.5, abs=1e-6) and steps[0]["kl"] == 0.0
    assert math.isfinite(steps[1]["loss"]) and steps[1]["kto_loss"] != pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "2 + 2?", "completion": "4", "label": 1}, "'label' must be true (desirable) or false"),
        ({"prompt": "2 + 2?", "completion": "4"}, "a kto record needs ['label']"),
        ({"prompt": "2 + 2?", "completion": 4, "label": True}, "'completion' must be a string or a list of messages"),
    ],
)
def test_bad_kto_records_are_one_line_naming_the_line(tmp_path, capsys, record, message):
    records = [json.loads(line) for line in (assets.resolve("bundled:data/kto") / "unpaired.jsonl").open()][:3]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [*records[:2], record, records[2]]))
    argv = [
        "kto",
        "--config",
        str(ROOT / "recipes" / "tiny-kto.yaml"),
        "--data_root_path",
        str(data),
        "--ckpt_dir",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{data}:3" in err and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# --- online dpo ----------------------------------------------------------------------------------------------


def test_online_dpo_ranks_and_scores_as_trl(models):
    """TRL's ``OnlineDPOTrainer.training_step`` with its sampling replaced by our two responses per prompt (the
    issue's "samples fixed where sampling differs") and a reward returning ours: the same ranking (ties: the first
    response), the same loss, the same gradient."""
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    tokenizer = Tokenizer.from_dir(models / "policy")
    prompts = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((12, 34), (23, 45), (90, 13))]
    prompt_ids = [tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
    assert len({len(p) for p in prompt_ids}) == 1  # TRL left-pads prompts: equal lengths keep positions equal
    responses = [tokenizer.encode(text) for text in ("46.", "It is 46, I think.", "68", "68.", "103", "99")]
    packed = pack([(prompt_ids[i // 2], responses[i]) for i in range(6)], tokenizer.padding_id)
    batch = {k: v.unflatten(0, (3, 2)) for k, v in packed.items()}
    batch["rewards"] = torch.tensor([[0.5, 1.0], [1.0, 1.0], [2.0, -1.0]])  # second wins, a tie, first wins
    ours = load_model(models / "policy_hf")
    dpo = dict(reference=load_model(models / "reference_hf"), beta=0.1, moe_aux_loss_coef=0.0)
    loss, metrics = online_dpo_batch_loss(ours, batch, **dpo)
    loss.backward()
    assert metrics["reward_gap"].item() == pytest.approx((0.5 + 0.0 + 3.0) / 3)
    policy = transformers.AutoModelForCausalLM.from_pretrained(models / "policy_hf", dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(models / "reference_hf", dtype=torch.float32)
    order = [0, 2, 4, 1, 3, 5]  # TRL's layout: every prompt's first sample, then every second one
    rewards = batch["rewards"].transpose(0, 1).flatten().tolist()
    config = OnlineDPOConfig(
        output_dir=str(models / "trl"), report_to=[], use_cpu=True, bf16=False, beta=0.1, per_device_train_batch_size=3
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = OnlineDPOTrainer(
            model=policy,
            ref_model=reference,
            args=config,
            reward_funcs=[lambda completions, **_: rewards[: len(completions)]],
            train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in prompts]),
            processing_class=transformers.AutoTokenizer.from_pretrained(models / "policy_hf"),
        )
    width = len(prompt_ids[0])
    ids, attention = packed["input_ids"][order], packed["attention_mask"][order].long()
    trainer._generate = lambda model, prompts, images=None: (
        ids[:, :width],
        attention[:, :width],
        ids[:, width:],
        attention[:, width:],
        None,
    )
    theirs = trainer.training_step(trainer.model, {"prompt": prompts})
    print(f"online dpo: ours {loss.item():.6f}, TRL {theirs.item():.6f}", file=sys.stderr)
    assert loss.item() == pytest.approx(theirs.item(), abs=1e-5)
    their_grad = policy.model.layers[0].mlp.down_proj.weight.grad
    assert_same_gradient(ours.layers[0].mlp.down.weight.grad, their_grad)


def test_online_dpo_recipe_starts_at_log_2(tmp_path, capsys):
    argv = [
        "--train_type",
        "online_dpo",
        "--config",
        str(ROOT / "recipes" / "tiny-online-dpo.yaml"),
        "--ckpt_dir",
        str(tmp_path / "run"),
        "--max_steps",
        "2",
        "--batch_per_device",
        "2",
    ]
    assert main(argv) == 0
    assert "online: 2 samples each, ranked by" in capsys.readouterr().out
    (checkpoint,) = (tmp_path / "run").glob("epoch_*_step_2")
    entries = [json.loads(line) for line in (checkpoint / "metric.jsonl").read_text().splitlines()]
    steps = [e for e in entries if "dpo_loss" in e]
    assert steps[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6) and "reward_gap" in steps[0]


# --- grpo's loss variants ----------------------------------------------------------------------------------------


def groups_batch(root: Path) -> tuple[dict[str, torch.Tensor], int]:
    """Two bundled grpo groups of 4 whose prompts have the same length (TRL left-pads prompts, and a left-padded
    prompt shifts the positions of transformers' forward), as our collate makes them, with "old" log-probabilities
    from the reference model so that the ratio moves and clipping acts; and the prompts' length."""
    tokenizer = Tokenizer.from_dir(root / "policy")
    dataset = GroupDataset(read_records(assets.resolve("bundled:data/grpo")), tokenizer, 64)
    by_length: dict[int, list[int]] = {}
    for index in range(len(dataset)):
        by_length.setdefault(len(dataset[index][0].prompt_ids), []).append(index)
    pair = next(indices for indices in by_length.values() if len(indices) >= 2)[:2]
    batch = collate_groups([dataset[i] for i in pair], tokenizer.padding_id)
    with torch.no_grad():
        old = next_token_logprobs(load_model(root / "reference_hf"), batch["input_ids"].flatten(0, 1))[0]
    batch["old_logprobs"] = old.unflatten(0, (2, -1))
    return batch, len(dataset[pair[0]][0].prompt_ids)


DAPO_ACCUM, DAPO_STEPS_PER_GENERATION = 2, 4
"""dapo's check: 2 micro-batches per optimizer step, a rollout of 2 steps (our ``rollout_interval`` 2)."""


def online_trainer(trainer_class, policy, config, models: Path):  # noqa: ANN001, ANN201 - TRL's classes
    """TRL's online trainer (GRPOTrainer, RLOOTrainer) over ``policy``, its reward and prompts unused: the tests call
    its ``_compute_loss`` on completions of their own."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(models / "policy_hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_class(
            model=policy,
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
            args=config,
            train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * 4),
            processing_class=tokenizer,
        )


GRPO_METHODS = {  # id: (--grpo_loss, TRL's GRPOConfig settings beyond loss_type, our GRPOLossArgs beyond kind)
    "grpo": ("grpo", {}, {}),
    "bnpo": ("bnpo", {}, {}),
    "dr_grpo": ("dr_grpo", {}, {}),
    "dapo": ("dapo", {}, {}),
    "gspo": ("grpo", {"importance_sampling_level": "sequence"}, {"shape": RatioShape(sequence_level=True)}),
    "gspo_bnpo": ("bnpo", {"importance_sampling_level": "sequence"}, {"shape": RatioShape(sequence_level=True)}),
    "sapo": ("sapo", {"sapo_temperature_pos": 1.3, "sapo_temperature_neg": 0.9},
             {"shape": RatioShape(sapo_temperature_pos=1.3, sapo_temperature_neg=0.9)}),
    "delta": ("bnpo", {"delta": 1.1}, {"shape": RatioShape(delta=1.1)}),
    "top_entropy": ("grpo", {"top_entropy_quantile": 0.3}, {"top_entropy_quantile": 0.3}),
}  # fmt: skip
"""Each loss, and each method of issue 61 (GSPO, SAPO, two-sided clipping, top-entropy tokens), with its knobs off
their defaults."""


@pytest.mark.parametrize("method", GRPO_METHODS)
def test_grpo_losses_match_trl(models, method):
    """TRL's ``GRPOTrainer._compute_loss`` on the same completions, advantages and old/reference log-probabilities,
    with DAPO's asymmetric clip bound and a KL weight: loss within 1e-5, an MLP weight's gradient within 1e-5 of its
    largest entry. GSPO (sequence-level ratios), SAPO (its two temperatures) and two-sided clipping (``delta``) too,
    each checked to change the loss from the plain one (a setting dropped on either side shows).

    dapo: this micro-batch is one of a rollout of 4 (2 steps of 2 micro-batches) holding ``num_items`` response
    tokens; TRL divides its token sum by ``num_items / processes x accumulation / steps_per_generation`` and ours by
    the rollout's tokens per micro-batch, then the loop by ``grad_accum_steps``: the same loss and gradient."""
    kind, settings, ours_only = GRPO_METHODS[method]
    batch, prompt_length = groups_batch(models)
    args = GRPOLossArgs(kind=kind, clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05, max_response_tokens=40, **ours_only)
    reference = load_model(models / "reference_hf")
    ours = load_model(models / "policy_hf")
    accum, extra = (DAPO_ACCUM, {"steps_per_generation": DAPO_STEPS_PER_GENERATION}) if kind == "dapo" else (1, {})
    num_items = 3 * int(batch["loss_mask"].flatten(0, 1)[:, 1:].sum()) + 7  # the other micro-batches' tokens too
    if kind == "dapo":  # what Rollouts attaches (batch_statistics): the rollout's tokens per micro-batch
        batch[TOKENS_PER_MICRO_BATCH] = torch.tensor(num_items / DAPO_STEPS_PER_GENERATION)
    loss, metrics = grpo_batch_loss(ours, batch, reference, 0.2, 0.05, 0.0, loss=args)
    loss = loss / accum  # the loop's division (loop/step.py)
    loss.backward()
    if ours_only:
        plain_args = replace(args, shape=RatioShape(), top_entropy_quantile=1.0)
        with torch.no_grad():
            plain = grpo_batch_loss(ours, batch, reference, 0.2, 0.05, 0.0, loss=plain_args)[0]
        assert abs(plain.item() / accum - loss.item()) > 1e-4, method  # the setting bites here
    if args.top_entropy_quantile < 1:  # the fused head's entropies (chunk by chunk, no whole logits) select alike
        with torch.no_grad():
            fused = grpo_batch_loss(ours, batch, reference, 0.2, 0.05, 0.0, loss_chunk_size=7, loss=args)
        assert fused[0].item() == pytest.approx(loss.item(), abs=1e-6)
        assert fused[1]["policy_token_fraction"] == metrics["policy_token_fraction"] < 0.5
    if kind != "sapo" and not args.shape.sequence_level:  # (a response's mean log-ratio stays nearer 0)
        assert metrics["clip_fraction"] > 0.1  # the old policy differs: the bounds act
    policy = transformers.AutoModelForCausalLM.from_pretrained(models / "policy_hf", dtype=torch.float32)
    config = trl.GRPOConfig(
        output_dir=str(models / "trl"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        loss_type=kind,
        **settings,
        beta=0.05,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=40,
        num_generations=4,
        per_device_train_batch_size=4,
        temperature=1.0,
        gradient_accumulation_steps=accum,
        **extra,
    )
    trainer = online_trainer(trl.GRPOTrainer, policy, config, models)
    ids, attention = batch["input_ids"].flatten(0, 1), batch["attention_mask"].flatten(0, 1).long()
    completions = batch["loss_mask"].flatten(0, 1)[:, prompt_length:].long()
    with torch.no_grad():
        ref_logprobs = next_token_logprobs(reference, ids)[0]
    start = prompt_length - 1  # the first completion token's prediction
    inputs = {
        "prompt_ids": ids[:, :prompt_length],
        "prompt_mask": attention[:, :prompt_length],
        "completion_ids": ids[:, prompt_length:],
        "completion_mask": completions,
        "advantages": grpo_advantages(batch["rewards"], kind).flatten(),
        "old_per_token_logps": batch["old_logprobs"].flatten(0, 1)[:, start:],
        "ref_per_token_logps": ref_logprobs[:, start:],
    }
    if kind == "dapo":  # the generation batch's response tokens, gathered over processes (_generate_and_score_...)
        inputs["num_items_in_batch"] = torch.tensor(num_items)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accum  # set by its training loop
    theirs = trainer._compute_loss(trainer.model, inputs)
    assert loss.item() == pytest.approx(theirs.item(), abs=1e-5)
    theirs.backward()
    their_grad = policy.model.layers[0].mlp.down_proj.weight.grad
    grad_diff = (ours.layers[0].mlp.down.weight.grad - their_grad).abs().max().item()
    print(
        f"grpo {method}: ours {loss.item():.6f}, TRL {theirs.item():.6f}, |diff| {abs(loss.item() - theirs.item()):.1e}"
        f", gradient |diff| {grad_diff:.1e}",
        file=sys.stderr,
    )
    assert_same_gradient(ours.layers[0].mlp.down.weight.grad, their_grad)


def test_rloo_matches_trls_rloo_trainer(models):
    """``--grpo_advantage rloo`` against TRL 1.16's RLOOTrainer on the same completions and old/reference
    log-probabilities, with its KL weight, a reward clip range that bites and normalised advantages: the advantages
    as its ``_generate_and_score_completions`` forms them (clipped rewards less beta x the summed ``logp_old -
    logp_ref``, the leave-one-out baseline, then ``(a - mean) / (nanstd + 1e-4)`` over the batch), its
    ``_compute_loss`` fed them: the loss within 1e-5, an MLP weight's gradient within 1e-5 of its largest entry."""
    from trl.trainer.utils import nanstd

    batch, prompt_length = groups_batch(models)
    reference, ours = load_model(models / "reference_hf"), load_model(models / "policy_hf")
    with torch.no_grad():  # "old" near the policy: a response's summed log-ratio in the bounds for some, not all
        now = next_token_logprobs(ours, batch["input_ids"].flatten(0, 1))[0].unflatten(0, (2, -1))
    batch["old_logprobs"] = now + 0.1 * (batch["old_logprobs"] - now)
    clip_range = (0.0, 0.6)
    rloo = dict(advantage="rloo", rloo_normalize_advantages=True, reward_clip_range=clip_range)
    args = GRPOLossArgs(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05, **rloo)
    assert batch["rewards"].max() > clip_range[1]  # the clip acts
    loss, metrics = grpo_batch_loss(ours, batch, reference, 0.2, 0.05, 0.0, loss=args)
    loss.backward()
    ids, attention = batch["input_ids"].flatten(0, 1), batch["attention_mask"].flatten(0, 1).long()
    completions = batch["loss_mask"].flatten(0, 1)[:, prompt_length:].long()
    start = prompt_length - 1  # the first completion token's prediction
    old = batch["old_logprobs"].flatten(0, 1)[:, start:]
    with torch.no_grad():
        ref = next_token_logprobs(reference, ids)[0][:, start:]
    # TRL's advantages, its steps written out (RLOOTrainer._generate_and_score_completions, TRL 1.16)
    rewards = batch["rewards"].flatten().clamp(*clip_range) - 0.05 * ((old - ref) * completions).sum(-1)
    grouped = rewards.view(-1, 4)
    baselines = ((grouped.sum(dim=1, keepdim=True) - grouped) / 3).view(-1)
    advantages = rewards - baselines
    advantages = (advantages - advantages.mean()) / (nanstd(advantages) + 1e-4)
    penalised = rewards.view_as(batch["rewards"])
    torch.testing.assert_close(rloo_advantages(penalised, normalize=True).flatten(), advantages, atol=1e-6, rtol=0)
    policy = transformers.AutoModelForCausalLM.from_pretrained(models / "policy_hf", dtype=torch.float32)
    settings = dict(beta=0.05, epsilon=0.2, epsilon_high=0.28, normalize_advantages=True, reward_clip_range=clip_range)
    run = dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=40)
    config = trl.RLOOConfig(str(models / "trl-rloo"), report_to=[], use_cpu=True, bf16=False, **settings, **run)
    trainer = online_trainer(trl.RLOOTrainer, policy, config, models)
    inputs = {
        "prompt_ids": ids[:, :prompt_length],
        "prompt_mask": attention[:, :prompt_length],
        "completion_ids": ids[:, prompt_length:],
        "completion_mask": completions,
        "old_logps": (old * completions).sum(1),
        "advantages": advantages,
    }
    trainer.model.train()
    theirs = trainer._compute_loss(trainer.model, inputs)
    assert loss.item() == pytest.approx(theirs.item(), abs=1e-5)
    assert 0 < metrics["clip_fraction"] < 1  # some responses' summed log-ratios leave the bounds
    theirs.backward()
    their_grad = policy.model.layers[0].mlp.down_proj.weight.grad
    print(f"rloo: ours {loss.item():.6f}, TRL {theirs.item():.6f}", file=sys.stderr)
    assert_same_gradient(ours.layers[0].mlp.down.weight.grad, their_grad)


def test_grpo_advantages_are_trls_and_astrais():
    """TRL's (``_generate_and_score_completions``, ``scale_rewards``): ``r - mean_G r``, divided by its ``nanstd``
    (Bessel-corrected) + 1e-4 for group, not for none; AstrAI's: population std + 1e-8."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.25], [2.0, 2.0, 2.0, 2.0]])
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    expected = torch.nan_to_num(centred / (nanstd(rewards, dim=1, keepdim=True) + 1e-4), nan=0.0)
    torch.testing.assert_close(grpo_advantages(rewards, "grpo", "group"), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(grpo_advantages(rewards, "bnpo", "none"), centred, atol=0, rtol=0)
    astrai = centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + 1e-8)
    torch.testing.assert_close(grpo_advantages(rewards, "astrai"), astrai, atol=0, rtol=0)
    assert torch.equal(grpo_advantages(rewards[:, :1], "grpo"), torch.zeros(2, 1))  # one response: no std, no signal


def test_grpo_batch_scale_is_trls_std_over_the_whole_rollout():
    """``--grpo_scale_rewards batch``: TRL's ``r - mean_G r`` over the ``nanstd`` of every reward of the generation
    batch + 1e-4. Ours: the rollout's (``batch_statistics``, here on one rank), or the micro-batch's offline."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.25], [2.0, 2.0, 2.0, 2.0], [3.0, -1.0, 0.0, 0.5]])
    expected = (rewards - rewards.mean(dim=1, keepdim=True)) / (nanstd(rewards) + 1e-4)
    torch.testing.assert_close(grpo_advantages(rewards, "grpo", "batch"), expected, atol=1e-6, rtol=0)
    rolled = [{"rewards": group[None], "loss_mask": torch.ones(1, 4, 3, dtype=torch.bool)} for group in rewards]
    batch_statistics(SimpleNamespace(world_size=1), rolled)  # a rollout of three micro-batches of one group
    for i, batch in enumerate(rolled):
        advantages = grpo_advantages(batch["rewards"], "bnpo", "batch", batch[REWARD_STD])
        torch.testing.assert_close(advantages, expected[i : i + 1], atol=1e-6, rtol=0)
    assert torch.equal(grpo_advantages(rewards[:1, :1], "grpo", "batch"), torch.zeros(1, 1))  # one reward: no std


def test_num_iterations_multiplies_the_steps_of_the_plan():
    plan = StepPlan(
        num_samples=200,
        num_dp_ranks=2,
        batch_per_device=3,
        grad_accum_steps=4,
        n_epoch=2,
        warmup_ratio=0.0,
        num_iterations=3,
    )
    # ceil(200 / 2) = 100 per rank -> ceil(100 / 3) = 34 micro-batches, each trained 3 times: 102 // 4 = 25 per epoch
    assert (plan.micro_batches_per_rank, plan.epoch_steps) == (34, 50)
    assert plan.last_step() == 3 * 34 * 2 // 4 == 51  # windows run across epochs
    # A resume: every prompt left is trained 3 times (45 counted per rank, the next rollout samples anew)
    assert plan.last_step(RunPosition(epoch=1, sample_index=45, optimizer_step=40)) == 40 + 3 * (34 - 15) // 4
    assert "34 micro-batches per rank per epoch, each trained 3 times -> 50 optimizer steps" in plan.describe()[1][1]
    assert StepPlan(200, 2, 3, 4, 2, 0.0).epoch_steps == (34 // 4) * 2  # AstrAI's, for one iteration


def dapo_argv(out: Path, *flags: str) -> list[str]:
    return [
        "grpo",
        "--config",
        str(ROOT / "recipes" / "tiny-grpo-dapo.yaml"),
        "--ckpt_dir",
        str(out),
        "--group_size",
        "2",
        "--rollout_max_tokens",
        "4",
        "--batch_per_device",
        "2",
        "--grad_accum_steps",
        "1",
        "--max_steps",
        "4",
        "--ckpt_interval",
        "2",
        "--loggers",
        "[]",
        *flags,
    ]


def test_dapo_recipe_reuses_each_rollout_and_resumes_at_a_rollout_boundary_bit_exactly(tmp_path):
    """``--grpo_num_iterations 2``: steps 1 and 2 train the same rollout (the same rewards), the position counts its
    2 prompts once, and a resume from step 2 (a rollout boundary) ends at the same weights as the first run."""
    assert main(dapo_argv(tmp_path / "full")) == 0
    metrics = (tmp_path / "full" / "epoch_0_step_4" / "metric.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in metrics]
    rewards = [e["reward"] for e in steps if "reward" in e]
    assert len(rewards) == 4 and rewards[0] == rewards[1] and rewards[2] == rewards[3] and rewards[1] != rewards[2]
    meta = json.loads((tmp_path / "full" / "epoch_0_step_2" / "meta.json").read_text())
    assert meta["resume_position"]["sample_index"] == 2 and meta["resume_position"]["consumed_samples"] == 2
    resume = str(tmp_path / "full" / "epoch_0_step_2")
    assert main(dapo_argv(tmp_path / "resumed", "--resume", resume)) == 0
    full, resumed = (load_file(tmp_path / run / "epoch_0_step_4" / "model.safetensors") for run in ("full", "resumed"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)


@pytest.mark.parametrize("recipe", ["tiny-grpo-gspo.yaml", "tiny-grpo-rloo.yaml"])
def test_gspo_and_rloo_recipes_train_and_sample_only_what_they_train(recipe, tmp_path, capsys, monkeypatch):
    """Each recipe trains 2 steps (its loss finite, its settings in meta.json), with rollouts of 4 steps' prompts
    (8 micro-batches) asked for: the run samples only the 4 micro-batches its 2 steps train (it sampled all 8
    before; GSPO's second pass over them would come after the run's end), counted where every rollout passes
    (``Rollouts.rollout``), as many as the plan says."""
    from astrai_fabric.train.grpo import Rollouts

    sampled = []
    rollout = Rollouts.rollout
    monkeypatch.setattr(Rollouts, "rollout", lambda self, *a: sampled.append(1) or rollout(self, *a))
    argv = ["grpo", "--config", str(ROOT / "recipes" / recipe), "--ckpt_dir", str(tmp_path / "run")]
    argv += ["--max_steps", "2", "--rollout_interval", "4", "--batch_per_device", "2", "--group_size", "4"]
    if recipe == "tiny-grpo-rloo.yaml":  # its advantages made at rollout, normalised over the whole rollout
        argv += ["--rloo_normalize_advantages", "true"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rollouts     1 per rank, 4 micro-batches of prompts sampled (up to 8 at a time" in out, out
    assert len(sampled) == 4
    (checkpoint,) = (tmp_path / "run").glob("epoch_*_step_2")
    meta = json.loads((checkpoint / "meta.json").read_text())
    steps = [json.loads(line) for line in (checkpoint / "metric.jsonl").read_text().splitlines()]
    losses = [entry["loss"] for entry in steps if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    if recipe == "tiny-grpo-rloo.yaml":
        assert meta["grpo_advantage"] == "rloo" and "kl" in steps[-2]
    else:
        assert meta["grpo_importance_sampling_level"] == "sequence"


def test_grpo_recipe_with_a_trl_loss_runs(tmp_path):
    argv = [
        "grpo",
        "--config",
        str(ROOT / "recipes" / "tiny-grpo.yaml"),
        "--ckpt_dir",
        str(tmp_path / "run"),
        "--max_steps",
        "2",
        "--batch_per_device",
        "2",
        "--grad_accum_steps",
        "1",
        "--grpo_loss",
        "dr_grpo",
        "--grpo_clip_eps_high",
        "0.28",
        "--grpo_scale_rewards",
        "none",
    ]
    assert main(argv) == 0
    (checkpoint,) = (tmp_path / "run").glob("epoch_*_step_2")
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert (meta["grpo_loss"], meta["grpo_clip_eps_high"], meta["grpo_scale_rewards"]) == ("dr_grpo", 0.28, "none")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dpo_label_smoothing", "0.1"], "dpo_label_smoothing applies to --dpo_loss robust, simpo, cpo, not sigmoid"),
        (["--dpo_loss", "robust", "--dpo_label_smoothing", "0.5"], "dpo_label_smoothing must be in [0, 0.5), got 0.5"),
        (["--dpo_loss", "orpo", "--orpo_beta", "0"], "orpo_beta must be > 0, got 0.0"),
        (["--dpo_loss", "cpo", "--cpo_alpha", "-1"], "cpo_alpha must be >= 0, got -1.0"),
        (["--dpo_beta", "0"], "dpo_beta must be > 0, got 0.0"),
        (["--dpo_loss", "cpo", "--cpo_beta", "0"], "cpo_beta must be > 0, got 0.0"),
        (["--simpo_beta", "2"], "simpo_beta applies to dpo --dpo_loss simpo, not dpo --dpo_loss sigmoid; drop it"),
        (["--kto_beta", "0.2"], "kto_beta applies to kto, not dpo --dpo_loss sigmoid; drop it"),
        (["--dpo_loss", "cpo", "--cpo_beta", "0.2", "--dpo_beta", "0.3"], "cpo_beta 0.2 and dpo_beta 0.3, its"),
        (["--dpo_loss", "kto"], "dpo_loss"),
        (["--kto_desirable_weight", "0"], "kto_desirable_weight must be > 0, got 0.0"),
        (["--data_root_path", "bundled:data/grpo_online"], "records hold prompts without responses (online dpo)"),
        (["--grpo_clip_eps_high", "0"], "grpo_clip_eps_high must be > 0"),
        (["--grpo_loss", "sapo", "--grpo_sapo_temperature_neg", "-1"], "grpo_sapo_temperature_neg must be > 0, got -1"),
        (["--grpo_loss", "bnpo", "--delta", "0"], "grpo_delta must be > 0, got 0"),
        (["--grpo_loss", "sapo", "--grpo_delta", "2"], "grpo_delta clips the ratio of the clipped losses; --grpo_loss"),
        (
            ["--importance_sampling_level", "sequence"],
            "grpo_importance_sampling_level sequence (GSPO) applies to TRL's",
        ),
        (["--grpo_loss", "grpo", "--top_entropy_quantile", "0"], "grpo_top_entropy_quantile must be in (0, 1], got 0"),
        (["--grpo_top_entropy_quantile", "0.2"], "grpo_top_entropy_quantile applies to TRL's losses (grpo, bnpo, dr"),
        (["--grpo_advantage", "rloo", "--group_size", "1"], "grpo_advantage rloo needs group_size >= 2 (a leave-one"),
        (
            ["--grpo_advantage", "rloo", "--grpo_loss", "grpo"],
            "(TRL's RLOOTrainer: its advantages, KL and objective), wh",
        ),
        (
            ["--grpo_advantage", "rloo", "--reward_clip_range", "[1, 0]"],
            "reward_clip_range must be [low, high] with low",
        ),
        (
            ["--normalize_advantages", "true"],
            "rloo_normalize_advantages and reward_clip_range apply to --grpo_advantage",
        ),
        (["--dry_run", "--grpo_advantage", "rloo", "--group_size", "1"], "grpo_advantage rloo needs group_size >= 2"),
        (["--grpo_scale_rewards", "none"], "grpo_scale_rewards none applies to --grpo_loss grpo, bnpo, dr_grpo and"),
        (["--grpo_num_iterations", "2"], "grpo_num_iterations 2 applies to online grpo, not dpo"),
        (["--grpo_loss", "dapo"], "--grpo_loss dapo needs online grpo (its normaliser counts the tokens of a whole"),
        (["--grpo_loss", "bnpo", "--grpo_num_iterations", "3"], "--grpo_num_iterations 3 needs online grpo"),
    ],
)
def test_bad_preference_flags_are_one_line_exit_2(tmp_path, capsys, flags, message):
    # The grpo flags that need a batch of rollouts are refused on offline grpo data: the grpo recipe
    recipe, command = ("tiny-grpo.yaml", "grpo") if "needs online grpo" in message else ("tiny-dpo.yaml", "dpo")
    argv = [command, "--config", str(ROOT / "recipes" / recipe), "--ckpt_dir", str(tmp_path / "out"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()
