"""``astrai-fabric evaluate``: perplexity read and scored as training reads and scores (against an independent
computation, training's own loss, and AstrAI's ``scripts/eval/evaluate_ppl.py`` through the oracle), lm-eval tasks
against lm-eval's own ``hf`` backend on our ``export --format hf`` of the same model, a run's checkpoints evaluated
once each and plotted, and the mistakes' one line.

Nothing is downloaded: the lm-eval tasks are YAML and JSONL files written here (a multiple-choice task, a rolling
log-likelihood task and a generate-until task with exact match), read by ``datasets``' local JSON builder.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from astrai_oracle import ASTRAI_SRC, needs_astrai, run_astrai
from test_hf_tokenizer import build_tokenizer

from astrai_fabric.assets import TINY_MODEL_DIR
from astrai_fabric.checkpoint import load_model, save_checkpoint
from astrai_fabric.cli import main
from astrai_fabric.config import ModelConfig
from astrai_fabric.config.evaluate import EvaluateArgs
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.evaluate.perplexity import rolling_windows, score_data, summarize
from astrai_fabric.export import export
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.tokenizer import Tokenizer

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the .[eval] extra (in the test extra)")

WORDS = "light darkness earth heaven waters day night God said was good and the of firmament".split()
MAX_POSITIONS = 48
"""The model's context: short, so that lm-eval's long requests are left-truncated and rolling texts take several
windows."""


def words(rng, count: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (count,), generator=rng))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """``model`` (the bundled tokenizer's vocabulary, 2 layers, untied, random weights), ``hf`` (its export),
    ``model_bos`` and ``hf_bos`` (the same weights with a Llama-3-like tokenizer that adds BOS when encoding),
    ``text.jsonl`` (seq records of 3 to 70 tokens), ``chats.jsonl`` (short conversations) and ``tasks/`` (the three
    lm-eval tasks)."""
    root = tmp_path_factory.mktemp("evaluate")
    config = ModelConfig.from_dict(
        {
            **json.loads((TINY_MODEL_DIR / "config.json").read_text()),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "tie_word_embeddings": False,
            "max_position_embeddings": MAX_POSITIONS,
        }
    )
    torch.manual_seed(11)
    model = AutoRegressiveLM(config)
    with torch.no_grad():  # a sharper distribution than the init's, so greedy choices are far from ties
        model.lm_head.weight.mul_(8)
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(root / "model", model.state_dict(), config.to_dict(), files=files, meta={"train_type": "seq"})
    export(root / "model", root / "hf", "hf")
    build_tokenizer("llama3").save_pretrained(root / "llama3")  # Hugging Face's layout, BOS added when encoding
    files = {name: root / "llama3" / name for name in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(root / "model_bos", model.state_dict(), config.to_dict(), files=files, meta={"train_type": "seq"})
    export(root / "model_bos", root / "hf_bos", "hf")
    rng = torch.Generator().manual_seed(3)
    lines = [json.dumps({"text": words(rng, n)}) for n in (2, 9, 30, 60, 17, 25, 5)]
    (root / "text.jsonl").write_text("\n".join(lines) + "\n")
    chats = [
        [{"role": "user", "content": words(rng, 2 + i % 4)}, {"role": "assistant", "content": words(rng, 1 + i % 3)}]
        for i in range(12)
    ]
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    tasks = root / "tasks"
    tasks.mkdir()
    mc = [
        {"question": words(rng, 4 + i), "choices": [" " + words(rng, k + 1) for k in range(3)], "answer": i % 3}
        for i in range(6)
    ]
    rolling = [{"text": words(rng, n)} for n in (3, 25, 90)]  # the last spans several windows
    gen = [{"prompt": words(rng, 3 + 20 * (i % 3)), "answer": WORDS[i]} for i in range(5)]  # some truncated
    for name, records in (("mc", mc), ("rolling", rolling), ("gen", gen)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = "dataset_path: json\ntest_split: test\n"
    (tasks / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n"
    )
    (tasks / "tiny_rolling.yaml").write_text(
        f"task: tiny_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'rolling.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    (tasks / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {tasks / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['firmament']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return root


# --- perplexity ---------------------------------------------------------------------------------------------------


def evaluate_args(**values) -> EvaluateArgs:
    return EvaluateArgs(**{"param_path": "unused", "bootstrap_iters": 0, **values})


def test_windows_score_every_token_of_the_training_stream_once(work):
    """seq: the windows' mean loss equals cross-entropy computed here from the records (tokenised, each followed by
    EOS, concatenated, cut into windows of 16 inputs and their next tokens), summed over the windows."""
    model = load_model(work / "model").eval()
    tokenizer = Tokenizer.from_dir(work / "model")
    scores = score_data(
        model,
        tokenizer,
        evaluate_args(data_root_path=str(work / "text.jsonl"), window_size=16, batch_size=3),
        progress=False,
    )
    stream = []
    for line in (work / "text.jsonl").read_text().splitlines():
        stream += tokenizer.encode(json.loads(line)["text"], add_special_tokens=False) + [tokenizer.eos_token_id]
    stream = torch.tensor(stream)
    total, count = 0.0, 0
    for begin in range(0, len(stream) - 16, 16):
        window = stream[begin : begin + 17]
        with torch.no_grad():
            logits = model(window[None, :-1])["logits"][0]
        total += F.cross_entropy(logits, window[1:], reduction="sum").item()
        count += 16
    metrics = summarize(scores, 0, 0)
    assert metrics["tokens"] == count and metrics["units"] == (len(stream) - 1) // 16
    assert metrics["loss"] == pytest.approx(total / count, rel=1e-6)  # float32 sums in another order
    assert metrics["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-6)


def test_sft_windows_are_scored_with_training_masks_and_document_boundaries(work):
    """sft: each window's loss equals training's own ``lm_loss`` on the training dataset's window (assistant tokens
    only, documents masked apart); a window scored without its document mask differs."""
    from astrai_fabric.train.lm import build_dataset, lm_loss
    from astrai_fabric.train.start import Start

    model = load_model(work / "model").eval()
    tokenizer = Tokenizer.from_dir(work / "model")
    data = str(work / "chats.jsonl")
    args = evaluate_args(data_root_path=data, train_type="sft", window_size=MAX_POSITIONS, batch_size=4)
    scores = score_data(model, tokenizer, args, progress=False)
    start = Start(model.config, None, None, tokenizer, window_size=MAX_POSITIONS)  # a fresh run's, on this data
    dataset, _ = build_dataset(TrainArgs(train_type="sft", data_root_path=data, window_size=MAX_POSITIONS), start)
    assert len(scores.token_counts) == len(dataset)
    mixed = 0
    for index in range(0, len(dataset), 7):
        batch = {key: value[None] for key, value in dataset[index].items()}
        with torch.no_grad():
            loss, _ = lm_loss(model, batch, label_smoothing=0.0, moe_aux_loss_coef=0.0)
        assert scores.token_counts[index] == int(batch["loss_mask"].sum())
        if scores.token_counts[index]:
            assert scores.nll_sums[index] / scores.token_counts[index] == pytest.approx(loss.item(), rel=1e-5)
        mixed += int((batch["position_ids"][0, 1:] <= batch["position_ids"][0, :-1]).any())
    assert mixed > 0  # windows holding more than one document were among those checked


def test_bin_shards_are_scored_as_the_records_they_were_prepared_from(work, tmp_path):
    """``prepare``'s shards of the records hold the stream training reads from them: the same windows, the same
    loss."""
    config = tmp_path / "text.json"
    config.write_text(
        json.dumps({"input": {"sections": [{"field": "text", "action": "train"}]}, "preprocessing": {"min_chars": 0}})
    )  # AstrAI's default drops short records
    argv = [
        "prepare",
        str(work / "text.jsonl"),
        "-o",
        str(tmp_path / "shards"),
        "-c",
        str(config),
        "--tokenizer_path",
        str(work / "model"),
    ]
    assert main(argv) == 0
    model, tokenizer = load_model(work / "model").eval(), Tokenizer.from_dir(work / "model")
    records, shards = (
        summarize(
            score_data(model, tokenizer, evaluate_args(data_root_path=str(path), window_size=16), progress=False), 0, 0
        )
        for path in (work / "text.jsonl", tmp_path / "shards")
    )
    assert shards == pytest.approx(records, rel=1e-6) and shards["units"] > 5


def test_rolling_windows_score_each_token_once_with_the_most_context():
    for num_tokens in range(0, 40):
        for window in (1, 2, 5, 16):
            scored = []
            for begin, end, num_scored in rolling_windows(num_tokens, window):
                assert 0 < end - 1 - begin <= window and num_scored <= end - 1 - begin
                assert end - 1 - begin == min(window, end - 1)  # as much context as the window holds
                scored += range(end - num_scored, end)
            assert scored == list(range(1, num_tokens))


def test_records_are_scored_alone_whatever_the_window_and_batch(work):
    """records: each record's tokens after the first, with no context from other records; the same sums whether a
    record fits one window or is rolled over several, and whatever the batch size (right padding is inert)."""
    model = load_model(work / "model").eval()
    tokenizer = Tokenizer.from_dir(work / "model")
    data = str(work / "text.jsonl")
    whole = score_data(
        model, tokenizer, evaluate_args(data_root_path=data, perplexity_unit="records", batch_size=1), progress=False
    )
    rolled = score_data(
        model,
        tokenizer,
        evaluate_args(data_root_path=data, perplexity_unit="records", window_size=8, batch_size=5),
        progress=False,
    )
    lengths = [len(tokenizer.encode(json.loads(line)["text"])) for line in Path(data).read_text().splitlines()]
    assert whole.token_counts.tolist() == [n - 1 for n in lengths] == rolled.token_counts.tolist()
    fits = max((n, i) for i, n in enumerate(lengths) if n <= MAX_POSITIONS + 1)[1]  # one window, read whole
    ids = tokenizer.encode(json.loads(Path(data).read_text().splitlines()[fits])["text"])
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))["logits"][0]
    expected = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
    assert whole.nll_sums[fits] == pytest.approx(expected, rel=1e-6) and len(ids) > 9
    pieces = []
    for begin, end, num_scored in rolling_windows(len(ids), 8):  # each piece alone: the batch of 5 padded ones
        with torch.no_grad():
            logits = model(torch.tensor([ids[begin : end - 1]]))["logits"][0, -num_scored:]
        pieces.append(F.cross_entropy(logits, torch.tensor(ids[end - num_scored : end]), reduction="sum").item())
    assert rolled.nll_sums[fits] == pytest.approx(sum(pieces), rel=1e-6) and len(pieces) > 2
    assert abs(rolled.nll_sums[fits] - whole.nll_sums[fits]) > 0.1  # other context, another sum
    assert rolled.nll_sums[0] == pytest.approx(whole.nll_sums[0], rel=1e-6)  # 2 words fit a window of 8


def test_the_bootstrap_interval_brackets_the_mean_and_narrows_with_more_units():
    from astrai_fabric.evaluate.perplexity import Scores

    rng = torch.Generator().manual_seed(0)
    few = Scores((torch.rand(8, generator=rng) * 40).double().numpy(), torch.full((8,), 10).numpy(), "few")
    many = Scores((torch.rand(800, generator=rng) * 40).double().numpy(), torch.full((800,), 10).numpy(), "many")
    narrow, wide = summarize(many, 400, 1), summarize(few, 400, 1)
    for metrics in (narrow, wide):
        low, high = metrics["loss_ci95"]
        assert low < metrics["loss"] < high
        assert metrics["perplexity_ci95"] == pytest.approx([math.exp(low), math.exp(high)])
    assert narrow["loss_ci95"][1] - narrow["loss_ci95"][0] < (wide["loss_ci95"][1] - wide["loss_ci95"][0]) / 3
    assert summarize(few, 400, 1) == wide  # seeded


@needs_astrai
def test_records_perplexity_equals_astrai_evaluate_ppl_made_causal(work, tmp_path):
    """AstrAI's own ``scripts/eval/evaluate_ppl.py`` (its tokenisation, batching, truncation at max_length and
    statistics) on our checkpoint and the same records, float32, run by AstrAI's interpreter. Its model call passes
    a 2-D padding mask, which AstrAI's transformer turns into a non-causal attention (``use_sdpa_causal_mask = attn_mask
    is None``): every position sees the token it predicts. Here that one call is made causal (the padding mask and
    the causal mask together); the script's own number is printed too, for docs/astrai-compat.md. Its batches hold
    one record: it pads with ``tokenizer.pad_id``, which AstrAI's tokenizer answers with None (its special token is
    ``pad_token``), so any padded batch fails."""
    tokenizer = Tokenizer.from_dir(work / "model")
    lines = (work / "text.jsonl").read_text().splitlines()
    fitting = [line for line in lines if len(tokenizer.encode(json.loads(line)["text"])) <= MAX_POSITIONS]
    assert 3 < len(fitting) < len(lines)  # AstrAI's script truncates longer records at max_length: not the same
    (tmp_path / "fits.jsonl").write_text("\n".join(fitting) + "\n")
    output = run_astrai(f"""
        import json, sys, torch
        sys.path.insert(0, "{Path(ASTRAI_SRC or "") / "scripts" / "eval"}")
        import evaluate_ppl
        from astrai.model import AutoModel
        from astrai.tokenize import AutoTokenizer
        model = AutoModel.from_pretrained("{work / "model"}").float().eval()
        tokenizer = AutoTokenizer.from_pretrained("{work / "model"}")
        items = [json.loads(line) for line in open("{tmp_path / "fits.jsonl"}")]
        def run():
            with torch.inference_mode():
                return evaluate_ppl.process_file(model, tokenizer, items, "text", batch_size=1,
                    max_length={MAX_POSITIONS}, token_level=False, max_samples=None, output_file=None, label="x",
                    device="cpu")["overall"]
        as_shipped = run()
        forward = model.forward
        def causal(input_ids, input_mask=None, **kwargs):
            length = input_ids.size(1)
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            return forward(input_ids, input_mask=causal[None, None] & input_mask[:, None, None, :].bool(), **kwargs)
        model.forward = causal
        print(json.dumps({{"causal": run(), "as_shipped": as_shipped}}))
    """)
    astrai = json.loads(output.splitlines()[-1])
    ours = summarize(
        score_data(
            load_model(work / "model").eval(),
            tokenizer,
            evaluate_args(data_root_path=str(tmp_path / "fits.jsonl"), perplexity_unit="records"),
            progress=False,
        ),
        0,
        0,
    )
    assert ours["tokens"] == astrai["causal"]["num_tokens"]
    assert ours["loss"] == pytest.approx(astrai["causal"]["mean_loss"], rel=1e-5)
    assert ours["perplexity"] == pytest.approx(astrai["causal"]["ppl"], rel=1e-4)
    assert abs(astrai["as_shipped"]["mean_loss"] - ours["loss"]) > 1e-3  # each position sees what follows it
    print(
        f"AstrAI's evaluate_ppl.py as shipped: mean loss {astrai['as_shipped']['mean_loss']:.4f}, made causal "
        f"{astrai['causal']['mean_loss']:.6f}, ours {ours['loss']:.6f}"
    )


def test_a_lora_checkpoint_is_evaluated_with_its_adapter_applied(work, tmp_path, capsys):
    """The adapter-only checkpoint (a pointer to its base) scores as the model merged on disk does, not as its
    base; the base's Hugging Face export scores as the base."""
    from astrai_fabric import lora
    from astrai_fabric.checkpoint.adapter import lora_base_entry, weight_digests

    model = load_model(work / "model")
    spec = lora.LoRASpec(r=4, alpha=8)
    lora.inject(model, spec, seed=0)
    torch.manual_seed(4)
    adapter = {k: torch.randn_like(v) * 0.5 for k, v in lora.adapter_state_dict(model.state_dict()).items()}
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    meta = {"lora_base": lora_base_entry(work / "model", tmp_path / "lora", weight_digests(work / "model"))}
    save_checkpoint(
        tmp_path / "lora",
        None,
        model.config.to_dict(),
        meta=meta,
        files=files,
        adapter=adapter,
        adapter_config=spec.adapter_config(),
    )
    assert main(["export", str(tmp_path / "lora"), "--merge_lora", "--out", str(tmp_path / "merged")]) == 0
    losses = {}
    sources = [
        ("lora", tmp_path / "lora"),
        ("merged", tmp_path / "merged"),
        ("base", work / "model"),
        ("hf", work / "hf"),
    ]
    for name, path in sources:
        argv = [
            "evaluate",
            str(path),
            "--data_root_path",
            str(work / "text.jsonl"),
            "--perplexity_unit",
            "records",
            "--output",
            str(tmp_path / f"{name}.json"),
        ]
        assert main(argv) == 0
        losses[name] = json.loads((tmp_path / f"{name}.json").read_text())["results"][0]["metrics"]["loss"]
    assert losses["lora"] == pytest.approx(losses["merged"], rel=1e-6)
    assert abs(losses["lora"] - losses["base"]) > 1e-3
    assert losses["hf"] == pytest.approx(losses["base"], rel=1e-6)  # a Hugging Face directory reads as its source
    assert not (tmp_path / "lora" / "model.safetensors").exists()  # nothing merged on disk


# --- lm-evaluation-harness ----------------------------------------------------------------------------------------


TASKS = ["tiny_mc", "tiny_rolling", "tiny_gen"]


def lm_eval_samples(lm, tasks: Path, chat: bool) -> dict:
    from astrai_fabric.evaluate.harness import tasks_index

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=TASKS,
        log_samples=True,
        apply_chat_template=chat,
        task_manager=tasks_index(TASKS, str(tasks)),
        bootstrap_iters=0,
    )


@pytest.mark.parametrize(
    ("ours_dir", "hf_dir", "chat"),
    [("model", "hf", False), ("model_bos", "hf_bos", False), ("model", "hf", True)],
    ids=["plain", "bos", "chat-template"],
)
def test_lm_eval_requests_and_metrics_equal_its_hf_backend_on_our_export(work, monkeypatch, ours_dir, hf_dir, chat):
    """Per request: log-likelihoods within 1e-4 (float32; the two compute in other orders) and the same greedy
    flags; generated text identical; task metrics identical. Ours batches 4 requests of different lengths, lm-eval's
    ``hf`` one at a time. With the bundled tokenizer (no special token added when encoding) and a Llama-3-like one
    (BOS added: the prefix and truncation rules then matter), and with each request rendered by the chat template
    (``--apply_chat_template``: ours renders the bundled template, transformers its export)."""
    from lm_eval.models.huggingface import HFLM

    from astrai_fabric.evaluate.harness import AstraiFabricLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = lm_eval_samples(AstraiFabricLM(str(work / ours_dir), batch_size=4, progress=False), work / "tasks", chat)
    theirs = lm_eval_samples(
        HFLM(pretrained=str(work / hf_dir), dtype="float32", device="cpu", batch_size=1), work / "tasks", chat
    )
    compared, largest = 0, 0.0
    for task in ("tiny_mc", "tiny_rolling", "tiny_gen"):
        for mine, reference in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            assert mine["arguments"] == reference["arguments"]
            for got, expected in zip(mine["resps"], reference["resps"], strict=True):
                got, expected = got[0], expected[0]
                if isinstance(expected, str):
                    assert got == expected
                elif isinstance(expected, tuple | list):  # (log-likelihood, is greedy)
                    assert got[0] == pytest.approx(expected[0], abs=1e-4) and got[1] == expected[1]
                    largest = max(largest, abs(got[0] - expected[0]))
                else:
                    assert got == pytest.approx(expected, abs=1e-4)
                    largest = max(largest, abs(got - expected))
                compared += 1
        numbers = {k: v for k, v in theirs["results"][task].items() if isinstance(v, float)}
        assert {k: ours["results"][task][k] for k in numbers} == pytest.approx(numbers, rel=1e-5) and numbers
    assert compared == 6 * 3 + 3 + 5
    if chat:
        assert all("<|im_start|>" in s["arguments"][0][0] for s in ours["samples"]["tiny_mc"])
    assert any(s["resps"][0][0] for s in ours["samples"]["tiny_gen"])  # something was generated
    print(f"{compared} requests; largest log-likelihood difference from lm-eval's hf backend: {largest:.2e}")


def test_the_model_is_registered_for_lm_eval_by_name(work):
    from lm_eval.api.registry import get_model

    import astrai_fabric.evaluate.harness  # noqa: F401 - registering is importing

    lm = get_model("astrai_fabric").create_from_arg_string(f"pretrained={work / 'model'},batch_size=2")
    assert lm.batch_size == 2 and lm.max_length == MAX_POSITIONS


# --- the command ----------------------------------------------------------------------------------------------------


def run_dir(root: Path) -> Path:
    """A run's ckpt_dir with two checkpoints of different weights (as training writes them, meta.json and all)."""
    run = root / "run"
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    for step in (2, 4):
        model = load_model(root / "model")
        with torch.no_grad():
            model.lm_head.weight.mul_(step / 4)
        save_checkpoint(
            run / f"epoch_0_step_{step}",
            model.state_dict(),
            model.config.to_dict(),
            files=files,
            epoch=0,
            meta={"train_type": "seq"},
        )
    return run


def test_a_run_is_evaluated_checkpoint_by_checkpoint_once_and_plotted(work, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "model").symlink_to(work / "model")
    run = run_dir(tmp_path)
    shutil.copy(work / "text.jsonl", tmp_path / "held_out.jsonl")
    argv = [
        "evaluate",
        str(run),
        "--data_root_path",
        str(tmp_path / "held_out.jsonl"),
        "--window_size",
        "16",
        "--tasks",
        "tiny_mc",
        "--include_path",
        str(work / "tasks"),
        "--trust_code",
        "--limit",
        "3",
        "--log_samples",
        "--output",
        str(tmp_path / "results.json"),
    ]
    assert main(argv) == 0
    first = capsys.readouterr().out
    stored = sorted(run.glob("epoch_*/eval/*.json"))
    assert [p.parent.parent.name for p in stored] == ["epoch_0_step_2"] * 2 + ["epoch_0_step_4"] * 2
    assert re.search(r"perplexity +loss +\d", first) and re.search(r"tiny_mc +acc +\d", first)
    written = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["step"], r["kind"]) for r in written] == [
        (2, "perplexity"),
        (2, "tasks"),
        (4, "perplexity"),
        (4, "tasks"),
    ]
    assert written[0]["metrics"]["loss"] != written[2]["metrics"]["loss"]
    assert written[1]["versions"]["lm_eval"] == lm_eval.__version__
    assert len(written[1]["lm_eval"]["samples"]["tiny_mc"]) == 3  # --log_samples: each document's requests
    times = [p.stat().st_mtime_ns for p in stored]
    assert main(argv) == 0  # again: read, not evaluated
    again = capsys.readouterr().out
    assert again.count("evaluated already with these settings") == 2
    assert [p.stat().st_mtime_ns for p in stored] == times
    assert json.loads((tmp_path / "results.json").read_text())["results"] == written
    assert main([*argv[:4], "--window_size", "8"]) == 0  # other settings: evaluated, stored beside
    assert len(list(run.glob("epoch_*/eval/perplexity-*.json"))) == 4
    with (tmp_path / "held_out.jsonl").open("a") as file:  # the data changed at the same path: evaluated again
        file.write(json.dumps({"text": "In the beginning"}) + "\n")
    assert main([*argv[:4], "--window_size", "8"]) == 0
    assert len(list(run.glob("epoch_*/eval/perplexity-*.json"))) == 6
    capsys.readouterr()
    assert main(["plot", str(run), "-o", str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").stat().st_size > 10_000


@pytest.mark.slow
def test_two_processes_give_the_results_of_one(work, tmp_path, monkeypatch):
    """``--nprocs 2`` through the real CLI (gloo): each rank scores every other window and lm-eval's share of the
    documents; the gathered results equal one process's (float32 sums of the same per-unit values)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "model").symlink_to(work / "model")
    run = run_dir(tmp_path)
    alone = tmp_path / "alone"
    shutil.copytree(run, alone)
    flags = [
        "--data_root_path",
        str(work / "text.jsonl"),
        "--window_size",
        "8",
        "--tasks",
        "tiny_mc,tiny_gen",
        "--include_path",
        str(work / "tasks"),
        "--trust_code",
    ]
    assert main(["evaluate", str(alone), *flags, "--output", str(tmp_path / "one.json")]) == 0
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai_fabric",
            "evaluate",
            str(run),
            *flags,
            "--nprocs",
            "2",
            "--output",
            str(tmp_path / "two.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 processes" in result.stdout and result.stdout.count("stored:") == 4  # rank 0 speaks and writes
    one = json.loads((tmp_path / "one.json").read_text())["results"]
    two = json.loads((tmp_path / "two.json").read_text())["results"]
    assert [(r["step"], r["kind"]) for r in two] == [(r["step"], r["kind"]) for r in one]
    for mine, reference in zip(two, one, strict=True):
        assert mine["metrics"].keys() == reference["metrics"].keys()
        for name, value in reference["metrics"].items():
            assert mine["metrics"][name] == pytest.approx(value, rel=1e-6), name
    assert one[0]["metrics"]["tokens"] == two[0]["metrics"]["tokens"] > 100


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["evaluate"], "evaluate needs a model"),
        (["evaluate", "{model}"], "evaluate needs --data_root_path (perplexity) or --tasks"),
        (["evaluate", "{tmp}", "--data_root_path", "{text}"], "neither a model directory (no config.json) nor a run"),
        (["evaluate", "{tmp}/missing", "--data_root_path", "{text}"], "not found"),
        (["evaluate", "{model}", "--tasks", "tiny_mc", "--include_path", "{tasks}"], "add --trust_code"),
        (["evaluate", "{model}", "--tasks", "no_such_task_here"], "no_such_task_here not known to lm-eval"),
        (["evaluate", "{model}", "--tasks", "a b"], "'a b' is not a task name"),
        (["evaluate", "{model}", "--data_root_path", "{text}", "--output", "{tmp}"],
         "is a directory; name the JSON file to write"),
        (["evaluate", "{model}", "--data_root_path", "{text}", "--window_size", "4096"], "exceeds the model's"),
        (["evaluate", "{model}", "--data_root_path", "{text}", "--train_type", "sft", "--perplexity_unit", "records"],
         "perplexity_unit records scores plain text"),
        (["evaluate", "{model}", "--data_root_path", "{text}", "--batch_size", "0"], "batch_size must be >= 1"),
        (["evaluate", "{model}", "--data_root_path", "{text}", "--window_sise", "8"], "did you mean --window_size"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line_and_nothing_is_written(work, tmp_path, capsys, argv, message):
    values = {
        "model": str(work / "model"),
        "tmp": str(tmp_path),
        "text": str(work / "text.jsonl"),
        "tasks": str(work / "tasks"),
    }
    before = sorted(p.name for p in (work / "model").rglob("*"))
    assert main([a.format(**values) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in (work / "model").rglob("*")) == before


def test_bf16_evaluation_is_close_to_float32(work, tmp_path):
    """``--precision bf16-true`` loads the weights as bfloat16 (CUDA's default), scores the same tokens, and a loss
    within bf16's precision of float32's (its 8-bit mantissa: ~0.4% per product; here, measured, far less)."""
    losses = {}
    for precision in ("32-true", "bf16-true"):
        argv = [
            "evaluate",
            str(work / "model"),
            "--data_root_path",
            str(work / "text.jsonl"),
            "--perplexity_unit",
            "records",
            "--precision",
            precision,
            "--output",
            str(tmp_path / f"{precision}.json"),
        ]
        assert main(argv) == 0
        losses[precision] = json.loads((tmp_path / f"{precision}.json").read_text())["results"][0]["metrics"]
    assert losses["bf16-true"]["tokens"] == losses["32-true"]["tokens"]
    assert losses["bf16-true"]["loss"] == pytest.approx(losses["32-true"]["loss"], rel=2e-2)
    assert losses["bf16-true"]["loss"] != losses["32-true"]["loss"]  # bf16 did run


def test_a_model_whose_loss_is_not_finite_is_one_line(work, tmp_path, capsys):
    model = load_model(work / "model")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    files = {name: TINY_MODEL_DIR / name for name in ("tokenizer.json", "tokenizer_config.json")}
    save_checkpoint(tmp_path / "nan", model.state_dict(), model.config.to_dict(), files=files)
    argv = [
        "evaluate",
        str(tmp_path / "nan"),
        "--data_root_path",
        str(work / "text.jsonl"),
        "--perplexity_unit",
        "records",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "nats per token; the model's weights or outputs are not finite" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "nan" / "eval").exists()


def test_tasks_without_the_eval_extra_name_it(work, tmp_path):
    """lm_eval made unimportable in a child: one line naming the extra, exit 2."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["lm_eval"] = None
        from astrai_fabric.cli import main
        sys.exit(main(["evaluate", "{work / "model"}", "--tasks", "hellaswag"]))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "astrai-fabric: error: --tasks needs lm-evaluation-harness: pip install 'astrai-fabric[eval]'"
    )


def test_the_documented_local_task_runs_as_evaluation_md_shows(work, tmp_path, capsys, monkeypatch):
    """docs/examples/lm-eval-task: the task YAML and data evaluation.md walks through, run by its own command line
    from the repository root and from elsewhere (its data path is relative to the YAML), offline; every record
    scored, the same scores."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(Path(__file__).parents[1])
    records = Path("docs/examples/lm-eval-task/capitals.jsonl").read_text().splitlines()
    model = tmp_path / "model"
    shutil.copytree(work / "model", model)
    argv = ["evaluate", str(model), "--tasks", "capitals", "--trust_code", "--log_samples"]
    assert main([*argv, "--include_path", "docs/examples/lm-eval-task", "--output", str(tmp_path / "r.json")]) == 0
    assert re.search(r"capitals +acc +[01]\.\d+", capsys.readouterr().out)
    (result,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert len(result["lm_eval"]["samples"]["capitals"]) == len(records) == 6
    monkeypatch.chdir(tmp_path)
    task_dir = tmp_path / "tasks"
    shutil.copytree(Path(__file__).parents[1] / "docs" / "examples" / "lm-eval-task", task_dir)
    (task_dir / "capitals.yaml").write_text(
        (task_dir / "capitals.yaml").read_text().replace("task: capitals", "task: capitals_copy")
    )
    assert main(["evaluate", str(model), "--tasks", "capitals_copy", "--trust_code", "--include_path", "tasks"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"capitals_copy +acc +[01]\.\d+", out), out
    # A data file found neither beside the YAML nor from here: one line naming it (it was a bug's traceback), nothing
    # kept.
    (task_dir / "capitals.jsonl").unlink()
    stored = sorted((model / "eval").iterdir())
    assert main(["evaluate", str(model), "--tasks", "capitals_copy", "--include_path", "tasks", "--trust_code"]) == 2
    err = capsys.readouterr().err
    assert f"tasks capitals_copy: Unable to find '{tmp_path}/capitals.jsonl'" in err, err
    assert "its YAML file's directory, else from the current directory" in err
    assert "Traceback" not in err and sorted((model / "eval").iterdir()) == stored
