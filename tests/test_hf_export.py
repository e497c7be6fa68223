"""``astrai-fabric export --format hf|astrai`` and training from a Hugging Face directory and back, against the
oracles: transformers (tiny random models built here, nothing downloaded) loads what we export and computes our
logits to 1e-5 in float32; AstrAI's own ``AutoModel.from_pretrained`` loads the AstrAI-layout results strictly with
the same logits, and refuses (loudly) the checkpoints its schema cannot express.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from astrai_oracle import needs_astrai, run_astrai  # noqa: E402
from test_huggingface import CASES, LLAMA3, build_hf, max_diff, save_hf  # noqa: E402

from astrai_fabric.assets import TINY_MODEL_DIR  # noqa: E402
from astrai_fabric.checkpoint import (  # noqa: E402
    hf,
    load_checkpoint,
    load_model,
    load_model_weights,
    read_model_config,
    save_checkpoint,
)
from astrai_fabric.cli import main  # noqa: E402
from astrai_fabric.config import ModelConfig  # noqa: E402
from astrai_fabric.config.model import EXTENDED_MODEL_TYPE  # noqa: E402
from astrai_fabric.model import AutoRegressiveLM  # noqa: E402
from astrai_fabric.reward_model import reward_model_config, reward_model_weights, sequence_scores  # noqa: E402
from astrai_fabric.tokenizer import Tokenizer  # noqa: E402

TOLERANCE = 1e-5
"""Max abs logit difference in float32 (the issue's bar)."""
VOCAB = json.loads((TINY_MODEL_DIR / "config.json").read_text())["vocab_size"]


def load_hf(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def export(*argv: str) -> int:
    return main(["export", *map(str, argv)])


def on_disk(directory: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(directory.glob("*.safetensors")) for k, v in load_file(file).items()}


@torch.no_grad()
def logits_diff(ours: torch.nn.Module, theirs: torch.nn.Module, vocab: int = 96) -> float:
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    return max_diff(ours.float().eval()(ids)["logits"], theirs(ids).logits)


# --- Hugging Face directory -> export --format hf: the same class back, bit for bit -----------------------------

FROM_HF = {
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama_llama3_rope": ("LlamaConfig", {"rope_parameters": {"rope_theta": 10000.0, **LLAMA3}}),
    "mistral_window": ("MistralConfig", {"sliding_window": 24}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3_tied": ("Qwen3Config", {"head_dim": 16, "tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    **{case: CASES[case][:2] for case in ("qwen2_moe", "qwen3_moe", "olmo2", "phi3", "gemma2", "gemma3_text",
                                          "deepseek_v3", "phi3_longrope", "llama_dynamic")},
}  # fmt: skip


@pytest.mark.parametrize("case", list(FROM_HF))
def test_a_huggingface_directory_exports_back_bit_for_bit(tmp_path, case):
    config_class, fields = FROM_HF[case]
    theirs = build_hf(config_class, **fields)
    source = save_hf(theirs, tmp_path / "source")
    assert export(source, "--format", "hf", "--out", tmp_path / "out") == 0
    back = load_hf(tmp_path / "out")
    assert type(back).__name__ == type(theirs).__name__
    with pytest.warns(UserWarning) if case == "mistral_window" else _no_warning():  # positions limited to the window
        ours = load_model(source)
    diff = logits_diff(ours, back)
    print(f"{case}: exported max |logit diff| {diff:.2e}", file=sys.stderr)
    assert diff <= TOLERANCE
    # import -> export -> import: the same tensors (names, dtypes, bits) and the same config
    before, after = on_disk(source), on_disk(tmp_path / "out")
    assert before.keys() == after.keys()
    assert all(before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )
    assert read_model_config(tmp_path / "out") == read_model_config(source)


SCORE_TOLERANCE = 2e-6
"""Max score difference of a reward model from transformers' ``*ForSequenceClassification``, float32, relative to the
largest score (scores of 4-8 here, where float32's spacing is 4.8e-7; observed at most 5e-7 of it)."""


@pytest.mark.parametrize("case", list(FROM_HF))
def test_a_reward_model_of_each_family_exports_to_its_sequence_classifier(tmp_path, case):
    """What ``reward_model`` makes of a Hugging Face directory (``train/start.py``'s steps: ``reward_model_config``,
    ``reward_model_weights``, ``hf.source_of`` for ``meta.json``), with a random score head, exported: the family's
    ``*ForSequenceClassification``, whose scores of right-padded rows are ours. Reference: transformers' own class
    over the export, float32, within ``SCORE_TOLERANCE`` of the largest score."""
    config_class, fields = FROM_HF[case]
    source = save_hf(build_hf(config_class, **fields), tmp_path / "source")
    with warnings.catch_warnings():  # mistral_window: positions limited to its window, said on loading
        warnings.simplefilter("ignore")
        language_model = load_checkpoint(source, load_extra=False)
    config = reward_model_config(language_model.model_config(), pad_token_id=0)
    start = reward_model_weights(language_model, config)
    model = AutoRegressiveLM(config)
    load_model_weights(model, start.state_dict, source=source)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    origin = hf.source_of(language_model.source, {}, config, "meta.json")
    save_checkpoint(tmp_path / "rm", model.state_dict(), config.to_dict(), meta={hf.SOURCE_KEY: origin.to_meta()})
    assert export(tmp_path / "rm", "--format", "hf", "--out", tmp_path / "out") == 0
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(theirs).__name__ == hf.sequence_classifier(language_model.source.model_type)
    ids = torch.randint(1, 96, (3, 20), generator=torch.Generator().manual_seed(1))
    ids[1, 12:], ids[2, 5:] = 0, 0  # right-padded
    with torch.no_grad():
        scores, _ = sequence_scores(model.eval(), ids)
        reference = theirs.eval()(input_ids=ids).logits.squeeze(-1)
    diff = (scores - reference).abs().max().item()
    print(f"{case}: {type(theirs).__name__} scores {scores.tolist()}, max |diff| {diff:.1e}", file=sys.stderr)
    assert scores.std() > 0.1 and diff <= SCORE_TOLERANCE * scores.abs().max(), (scores, reference)


def test_a_reward_model_of_a_multimodal_model_is_its_language_models_classifier(tmp_path):
    """A reward model started from a multimodal Gemma 3 holds its language model alone: its source is that
    ``Gemma3TextForSequenceClassification``, and the multimodal record its run may carry reads as the same."""
    vision = dict(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    text = {**CASES["gemma3_text"][1], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 40}
    transformers.Gemma3Config(text_config=text, vision_config=vision).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    with warnings.catch_warnings():  # the vision tower left out, said on loading
        warnings.simplefilter("ignore")
        config = reward_model_config(hf.model_config_from_hf(raw), pad_token_id=0)
        described = hf.source_of(hf.HFSource(model_type="gemma3", config=raw), {}, config, "meta.json")
        assert described.model_type == "gemma3_text"
        assert described.architecture == "Gemma3TextForSequenceClassification"
        assert hf.model_config_from_hf(described.config) == config
        assert hf.source_of(None, {hf.SOURCE_KEY: described.to_meta()}, config, "meta.json") == described
        multimodal_record = {hf.SOURCE_KEY: hf.HFSource(model_type="gemma3", config=raw).to_meta()}
        assert hf.source_of(None, multimodal_record, config, "meta.json") == described


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- AstrAI-native models -> the transformers class computing the same function ---------------------------------


def native(directory: Path, pair_equal_norms: bool = False, **fields) -> Path:
    """A random AstrAI model saved as a checkpoint (every weight redrawn: norms around 1, so a wrong order shows)."""
    torch.manual_seed(0)
    values = dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=40,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
    )
    config = ModelConfig(**{**values, **fields})
    model = AutoRegressiveLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
                if pair_equal_norms and "_norm" in name:
                    param[1::2] = param[0::2]
            else:
                param.normal_(0.0, 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("score_correction_bias"):  # zero at initialisation
                buffer.normal_(0.0, 0.1)
    return save_checkpoint(directory, model.state_dict(), config.to_dict(), meta={"train_type": "seq"})


GEMMA = dict(norm_placement="sandwich", norm_unit_offset=True, scale_embeddings=True, query_pre_attn_scalar=10,
             mlp_activation="gelu_pytorch_tanh", sliding_window=6,
             layer_types=["sliding_attention", "full_attention"])  # fmt: skip
DEEPSEEK_V3_LAYOUT = dict(
    attn_type="mla", kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
    mla_shared_rope_key=True, yarn_softmax_scale=True, num_key_value_heads=4, num_hidden_layers=3, ffn_type="moe",
    n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_intermediate_size=12,
    shared_expert_intermediate_size=24, mlp_only_layers=[0], scoring_func="sigmoid", score_correction_bias=True,
    n_group=4, topk_group=2, routed_scaling_factor=2.5,
    rope_frequency_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5},
)  # fmt: skip
"""DeepSeek-V3's layout, written natively (no Hugging Face source to copy the config from)."""
OLMO2 = dict(norm_placement="post", use_qk_norm=True, qk_norm_over_projection=True, qk_norm_before_rope=True)
MOE = dict(ffn_type="moe", n_routed_experts=4, n_activated_experts=2, n_shared_experts=0, moe_intermediate_size=24,
           norm_topk_prob=False, num_hidden_layers=3)  # fmt: skip
"""Three layers and an unnormalised top-k (each case adds its dense layers): what only the Qwen MoE classes
compute."""
NATIVE = {
    # id: (expected class, config fields, pair-equal q/k norm weights)
    "dense_gqa": ("LlamaForCausalLM", {}, False),
    "tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}, False),
    "astrai_ntk_rope": ("LlamaForCausalLM", {"rope_scaling": {"type": "ntk", "factor": 4.0}}, False),
    "head_dim_and_linear_rope": (
        "LlamaForCausalLM", {"head_dim": 16, "rope_frequency_scaling": {"rope_type": "linear", "factor": 2.0}}, False,
    ),
    "qkv_bias": ("Qwen2ForCausalLM", {"attention_qkv_bias": True}, False),
    "qk_norm_before_rope": ("Qwen3ForCausalLM", {"use_qk_norm": True, "qk_norm_before_rope": True}, False),
    "astrai_qk_norm_pair_equal": ("Qwen3ForCausalLM", {"use_qk_norm": True}, True),
    "moe": ("MixtralForCausalLM", {"ffn_type": "moe", "n_routed_experts": 4, "n_activated_experts": 2,
                                   "n_shared_experts": 0, "moe_intermediate_size": 24}, False),
    "moe_gated_shared_expert": ("Qwen2MoeForCausalLM", {**MOE, "n_shared_experts": 1, "shared_expert_gate": True,
                                "shared_expert_intermediate_size": 20, "mlp_only_layers": [0]}, False),
    "moe_qk_norm_before_rope": ("Qwen3MoeForCausalLM", {**MOE, "use_qk_norm": True, "qk_norm_before_rope": True,
                                "decoder_sparse_step": 2}, False),
    "output_norms_qk_norm_over_projection": ("Olmo2ForCausalLM", OLMO2, False),
    "latent_attention_shared_rope_key": ("DeepseekV3ForCausalLM", DEEPSEEK_V3_LAYOUT, False),
    "partial_rotary": ("Phi3ForCausalLM", {"rotary_dim": 6}, False),
    # logits_diff's 24 tokens are past both original lengths (16): the long factors, the raised base
    "partial_rotary_longrope": ("Phi3ForCausalLM", {"rotary_dim": 6, "rope_frequency_scaling": {
        "rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
        "short_factor": [1.0, 1.2, 1.9], "long_factor": [1.4, 3.1, 7.5]}}, False),
    "dynamic_ntk_rope": ("LlamaForCausalLM", {"rope_frequency_scaling": {
        "rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16}}, False),
    "sandwich_norms_windows_softcaps": ("Gemma2ForCausalLM", {**GEMMA, "attn_logit_softcapping": 2.0,
                                       "final_logit_softcapping": 3.0}, False),
    "sandwich_norms_qk_norm_local_rope": ("Gemma3ForCausalLM", {**GEMMA, "use_qk_norm": True,
                                         "qk_norm_before_rope": True, "rope_local_theta": 1e3}, False),
}  # fmt: skip


@pytest.mark.parametrize("case", list(NATIVE))
def test_an_astrai_model_exports_to_the_class_computing_its_function(tmp_path, case):
    expected_class, fields, pair_equal = NATIVE[case]
    source = native(tmp_path / "ckpt", pair_equal, **fields)
    assert export(source, "--format", "hf", "--out", tmp_path / "out") == 0
    back = load_hf(tmp_path / "out")
    assert type(back).__name__ == expected_class
    diff = logits_diff(load_model(source), back)
    print(f"{case}: {expected_class} max |logit diff| {diff:.2e}", file=sys.stderr)
    assert diff <= TOLERANCE
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {"rope_theta", "rope_scaling", "torch_dtype"} <= set(written) and "rope_parameters" not in written
    if case in ("partial_rotary_longrope", "dynamic_ntk_rope"):  # the same scaling read back, limit included
        before, after = read_model_config(source), read_model_config(tmp_path / "out")
        assert after.rope_frequency_scaling == before.rope_frequency_scaling
        assert after.max_position_embeddings == before.max_position_embeddings


REFUSED = [
    ("mla", dict(attn_type="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4), False,
     "attn_type 'mla' cannot be exported to Hugging Face"),
    ("gated", dict(use_gated_attention=True), False, "use_gated_attention True cannot be exported"),
    ("deepseek_v3_grouped_kv", dict(DEEPSEEK_V3_LAYOUT, num_key_value_heads=2), False,
     "num_key_value_heads 2 cannot be exported to Hugging Face: DeepSeek-V3 has a key and value per head"),
    ("deepseek_v3_scaled_embeddings", dict(DEEPSEEK_V3_LAYOUT, scale_embeddings=True), False,  # a Gemma option
     "scale_embeddings True cannot be exported to Hugging Face: DeepseekV3ForCausalLM, the class with latent"),
    ("deepseek_v3_softmax", dict(DEEPSEEK_V3_LAYOUT, scoring_func="softmax"), False,
     "scoring_func 'softmax' cannot be exported to Hugging Face: DeepseekV3ForCausalLM"),
    ("shared_experts", dict(ffn_type="moe", n_routed_experts=4, n_activated_experts=2, n_shared_experts=1), False,
     "n_shared_experts 1 cannot be exported to Hugging Face: shared experts added ungated (AstrAI's) have no"),
    ("two_gated_shared_experts", dict(MOE, n_shared_experts=2, shared_expert_gate=True), False,
     "n_shared_experts 2 cannot be exported to Hugging Face: Qwen2-MoE gates exactly one shared expert"),
    ("unnormalised_topk", dict(ffn_type="moe", n_routed_experts=4, n_activated_experts=2, n_shared_experts=0,
                               norm_topk_prob=False), False, "norm_topk_prob False cannot be exported"),
    ("dense_layers_in_moe", dict(ffn_type="moe", n_routed_experts=4, n_activated_experts=2, n_shared_experts=0,
                                 mlp_only_layers=[0]), False, "mlp_only_layers/decoder_sparse_step [0] cannot be"),
    ("astrai_qk_norm_order", dict(use_qk_norm=True), False,
     "use_qk_norm True cannot be exported to Hugging Face: AstrAI normalises q/k after RoPE"),
    ("output_norms_without_a_qk_norm", dict(norm_placement="post"), False,
     "use_qk_norm None cannot be exported to Hugging Face: Olmo2ForCausalLM, the class with output norms only or"),
    ("qk_norm_over_projection_with_input_norms", dict(OLMO2, norm_placement="pre"), False,
     "norm_placement 'pre' cannot be exported to Hugging Face: Olmo2ForCausalLM"),
    ("softcap_without_gemma_norms", dict(final_logit_softcapping=3.0), False,
     "norm_placement 'pre' cannot be exported to Hugging Face: Gemma2ForCausalLM, the class with norms around"),
    ("partial_rotary_with_qk_norm", dict(rotary_dim=4, use_qk_norm=True, qk_norm_before_rope=True), False,
     "use_qk_norm True cannot be exported to Hugging Face: Phi3ForCausalLM, the class with RoPE on part of each head"),
]  # fmt: skip


def run_refused(argv: list, tmp_path: Path, capsys) -> str:
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    code = export(*argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("astrai-fabric: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before  # nothing written
    return lines[0]


@pytest.mark.parametrize("fields, pair_equal, message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_what_has_no_equivalent_is_refused_in_one_line(tmp_path, capsys, fields, pair_equal, message):
    source = native(tmp_path / "ckpt", pair_equal, **fields)
    line = run_refused([source, "--format", "hf", "--out", tmp_path / "out"], tmp_path, capsys)
    assert message in line and str(source / "config.json") in line


def test_export_options_are_checked_before_anything_is_written(tmp_path, capsys):
    source = native(tmp_path / "ckpt")
    qwen2 = save_hf(build_hf("Qwen2Config"), tmp_path / "qwen2")
    qwen2_moe = save_hf(build_hf("Qwen2MoeConfig", **CASES["qwen2_moe"][1]), tmp_path / "qwen2_moe")
    broken = native(tmp_path / "broken_tokenizer")
    (broken / "tokenizer.json").write_bytes((TINY_MODEL_DIR / "tokenizer.json").read_bytes())
    (broken / "tokenizer_config.json").write_text("{")
    cases = [
        ([broken, "--format", "hf"], "broken_tokenizer/tokenizer_config.json: not valid JSON"),
        ([source, "--format", "hf", "--max_shard_size", "lots"], "'lots': expected a size such as 5GB"),
        ([source, "--max_shard_size", "1GB"], "--max_shard_size applies to --format hf"),
        ([source, "--format", "hf", "--out", qwen2], "already exists and is not empty ([config.json, "),
        (
            [qwen2, "--out", tmp_path / "as_astrai"],
            "a qwen2 model needs ['attention_qkv_bias'], "
            "which AstrAI's schema lacks (AstrAI would compute another function); export it with --format hf",
        ),
        (
            [qwen2_moe, "--out", tmp_path / "as_astrai"],
            "a qwen2_moe model needs ['attention_qkv_bias', 'shared_expert_gate'], which AstrAI's schema lacks",
        ),
        ([source, "--format", "onnx"], "--format"),
        ([source, "--dtype", "int8"], "--dtype"),
    ]
    for argv, message in cases:
        assert message in run_refused(argv, tmp_path, capsys), argv


def test_an_empty_out_directory_is_taken_and_anything_else_is_left_alone(tmp_path, capsys):
    """``--out`` may be an empty directory (replaced by the export's atomic rename); a directory holding anything,
    a previous export included, is never written into, replaced or deleted."""
    source = native(tmp_path / "ckpt")
    (tmp_path / "empty").mkdir()
    assert export(source, "--format", "hf", "--out", tmp_path / "empty") == 0
    assert (tmp_path / "empty" / "config.json").is_file() and (tmp_path / "empty" / "model.safetensors").is_file()
    before = {p.name: p.read_bytes() for p in (tmp_path / "empty").iterdir()}
    assert "already exists and is not empty" in run_refused(
        [source, "--format", "hf", "--out", tmp_path / "empty"], tmp_path, capsys
    )
    assert {p.name: p.read_bytes() for p in (tmp_path / "empty").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "empty"]  # no staging sibling left


def test_sharded_and_cast_exports_load_in_transformers(tmp_path):
    source = native(tmp_path / "ckpt")
    assert export(source, "--format", "hf", "--max_shard_size", "20KB", "--out", tmp_path / "sharded") == 0
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert all(p.stat().st_size <= 20_000 + 10_000 for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert logits_diff(load_model(source), load_hf(tmp_path / "sharded")) <= TOLERANCE
    assert export(source, "--format", "hf", "--dtype", "bfloat16", "--out", tmp_path / "bf16") == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in on_disk(tmp_path / "bf16").values()} == {torch.bfloat16}
    as_stored = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert as_stored.model.embed_tokens.weight.dtype == torch.bfloat16
    assert export(source, "--dtype", "bfloat16", "--out", tmp_path / "astrai_bf16") == 0  # AstrAI's layout, cast
    cast = load_checkpoint(tmp_path / "astrai_bf16")
    assert {t.dtype for t in cast.state_dict.values()} == {torch.bfloat16} and cast.meta["train_type"] == "seq"
    rounded = {k: v.to(torch.bfloat16) for k, v in load_model(source).state_dict().items()}
    assert all(
        torch.equal(rounded[k], v.to(torch.bfloat16)) for k, v in load_model(tmp_path / "bf16").state_dict().items()
    )


# --- the tokenizer ----------------------------------------------------------------------------------------------

TEXTS = ["In the beginning God created the heaven and the earth.", "  two  spaces,\ttab and ünïcode 123", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And then?"}]  # fmt: skip


def test_the_bundled_tokenizer_loads_in_transformers_and_encodes_the_same(tmp_path):
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (ckpt / name).write_bytes((TINY_MODEL_DIR / name).read_bytes())
    # a template whose newlines after block tags Jinja's defaults keep and transformers' trim_blocks would drop
    astrai_config = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())
    astrai_config["chat_template"] = (
        "{% for m in messages %}\n  {% if m['role'] == 'system' %}<|im_start|>system {{ m['content'] }}\n"
        "  {% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (ckpt / "tokenizer_config.json").write_text(json.dumps(astrai_config))
    model = AutoRegressiveLM(ModelConfig.from_file(ckpt / "config.json"))
    save_checkpoint(
        tmp_path / "model",
        model.state_dict(),
        model.config.to_dict(),
        files={n: ckpt / n for n in ("tokenizer.json", "tokenizer_config.json")},
    )
    assert export(tmp_path / "model", "--format", "hf", "--out", tmp_path / "out") == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ours = Tokenizer.from_dir(tmp_path / "model")
    for text in TEXTS:
        assert theirs.encode(text) == ours.encode(text), text
        assert theirs.decode(ours.encode(text), skip_special_tokens=True) == ours.decode(ours.encode(text))
    assert (theirs.bos_token, theirs.eos_token, theirs.pad_token) == tuple(
        ours.special_tokens[n] for n in ("bos_token", "eos_token", "pad_token")
    )
    for prompt in (True, False):
        rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        assert rendered == ours.render_chat(MESSAGES, add_generation_prompt=prompt)
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation == {
        "bos_token_id": ours.bos_token_id,
        "eos_token_id": ours.eos_token_id,
        "pad_token_id": ours.pad_token_id,
    }
    assert load_hf(tmp_path / "out").config.eos_token_id == ours.eos_token_id


# --- training from a Hugging Face directory and back ------------------------------------------------------------


def sft(param_path: Path, ckpt_dir: Path, *extra: str) -> list[str]:
    return [
        "sft",
        "--param_path",
        str(param_path),
        "--data_root_path",
        "bundled:data/sft",
        "--tokenizer_path",
        "bundled:tiny",
        "--window_size",
        "32",
        "--batch_per_device",
        "2",
        "--grad_accum_steps",
        "1",
        "--max_lr",
        "1e-3",
        "--parallel_mode",
        "none",
        "--num_workers",
        "0",
        "--loggers",
        "[]",
        "--ckpt_dir",
        str(ckpt_dir),
        "--ckpt_interval",
        "2",
        "--max_steps",
        "2",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """A tiny llama and a tiny qwen2 (biases: outside AstrAI's schema), each fine-tuned 2 steps with the CLI."""
    root = tmp_path_factory.mktemp("trained")
    runs = {}
    for name, config_class, steps in (("llama", "LlamaConfig", "2"), ("qwen2", "Qwen2Config", "4")):
        source = save_hf(build_hf(config_class, vocab_size=VOCAB, max_position_embeddings=256), root / f"{name}_hf")
        assert main(sft(source, root / name, "--max_steps", steps)) == 0
        runs[name], runs[f"{name}_hf"] = root / name / "epoch_0_step_2", source
    runs["qwen2_step_4"] = root / "qwen2" / "epoch_0_step_4"
    return runs


def test_a_finetuned_model_exports_to_transformers_with_our_logits(trained, tmp_path):
    for name, architecture in (("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")):
        meta = json.loads((trained[name] / "meta.json").read_text())
        assert meta["source"]["model_type"] == name and meta["source"]["architecture"] == architecture
        assert export(trained[name], "--format", "hf", "--out", tmp_path / name) == 0
        back = load_hf(tmp_path / name)
        assert type(back).__name__ == architecture
        tuned = load_model(trained[name])
        assert not torch.equal(tuned.embed_tokens.weight, load_model(trained[f"{name}_hf"]).embed_tokens.weight)
        diff = logits_diff(tuned, back, vocab=VOCAB)
        print(f"fine-tuned {name}: exported max |logit diff| {diff:.2e}", file=sys.stderr)
        assert diff <= TOLERANCE
        assert transformers.AutoTokenizer.from_pretrained(tmp_path / name).encode(TEXTS[0]) == Tokenizer.from_dir(
            TINY_MODEL_DIR
        ).encode(TEXTS[0])


def test_checkpoints_astrai_can_express_are_plain_astrai_and_the_others_carry_a_type_it_refuses(trained):
    llama, qwen2 = (json.loads((trained[n] / "config.json").read_text()) for n in ("llama", "qwen2"))
    assert llama["model_type"] == "autoregressive_lm" and not set(llama) - set(ModelConfig().to_dict())
    assert qwen2["model_type"] == EXTENDED_MODEL_TYPE and qwen2["attention_qkv_bias"] is True
    assert load_checkpoint(trained["qwen2"]).model_config().attention_qkv_bias  # ours reads it back


@needs_astrai
def test_astrai_loads_the_plain_ones_exactly_and_refuses_the_others(trained, tmp_path):
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    assert export(trained["llama_hf"], "--out", tmp_path / "llama_astrai") == 0  # an HF directory in AstrAI's layout
    mixtral = save_hf(
        build_hf("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB), tmp_path / "mixtral_hf"
    )
    assert export(mixtral, "--out", tmp_path / "mixtral_astrai") == 0
    out = run_astrai(f"""
        import torch
        from astrai.model.automodel import AutoModel
        from astrai.config.model_config import ConfigFactory
        from astrai.serialization import Checkpoint
        ids = torch.load("{tmp_path / "ids.pt"}")
        for name, path in (("trained", "{trained["llama"]}"), ("converted", "{tmp_path / "llama_astrai"}"),
                           ("mixtral", "{tmp_path / "mixtral_astrai"}")):
            model = AutoModel.from_pretrained(path)  # strict, weights_format auto
            torch.save(model(ids)["logits"].detach(), "{tmp_path}/" + name + ".pt")
        for load in (lambda: AutoModel.from_pretrained("{trained["qwen2"]}"),
                     lambda: ConfigFactory.load(Checkpoint.load("{trained["qwen2"]}").config)):  # its trainer's path
            try:
                load()
                print("loaded")
            except ValueError as err:
                print("refused:", err)
    """)
    with torch.no_grad():
        for name, path in (("trained", trained["llama"]), ("converted", trained["llama_hf"]), ("mixtral", mixtral)):
            expected = load_model(path).float()(ids)["logits"]
            assert max_diff(torch.load(tmp_path / f"{name}.pt"), expected) <= TOLERANCE, name
    assert out.count("refused: Unknown component: 'astrai_fabric_lm'") == 2, out


def test_dpo_from_a_huggingface_directory_uses_it_as_the_reference(trained, tmp_path):
    """At the first step policy and reference are the same model, so DPO's loss is exactly log 2: a reference
    built any other way (a random init, unpermuted q/k rows) gives another value."""
    argv = ["dpo", *sft(trained["llama_hf"], tmp_path / "dpo", "--max_steps", "1")[1:]]
    argv[argv.index("bundled:data/sft")] = "bundled:data/dpo"
    argv[argv.index("--batch_per_device") + 1] = "1"
    assert main(argv) == 0
    (ckpt,) = (tmp_path / "dpo").glob("epoch_*_step_1")
    entries = [json.loads(line) for line in (ckpt / "metric.jsonl").read_text().splitlines()]
    first = next(e for e in entries if e["type"] == "step")
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert (
        meta["reference"]["param_path"] == str(trained["llama_hf"].resolve())
        and meta["source"]["model_type"] == "llama"
    )


def test_resuming_a_run_from_a_huggingface_directory_is_exact(trained, tmp_path):
    argv = sft(trained["qwen2_hf"], tmp_path / "resumed", "--max_steps", "4", "--resume", str(trained["qwen2"]))
    assert main(argv) == 0  # steps 3 and 4 again, from the step-2 checkpoint of the uninterrupted run
    full, resumed = on_disk(trained["qwen2_step_4"]), on_disk(tmp_path / "resumed" / "epoch_0_step_4")
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    assert (
        json.loads((tmp_path / "resumed" / "epoch_0_step_4" / "meta.json").read_text())["source"]["model_type"]
        == "qwen2"
    )


def test_a_source_entry_that_does_not_describe_the_model_is_refused(trained, tmp_path, capsys):
    import shutil

    broken = tmp_path / "ckpt"
    shutil.copytree(trained["qwen2"], broken)
    meta = json.loads((broken / "meta.json").read_text())
    meta["source"]["config"]["hidden_size"] = 64
    (broken / "meta.json").write_text(json.dumps(meta))
    line = run_refused([broken, "--format", "hf", "--out", tmp_path / "out"], tmp_path, capsys)
    assert "'source' describes another model than config.json (they differ in ['hidden_size'" in line
    assert hf.SOURCE_KEY == "source"


ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate,up,down"


@pytest.fixture(scope="module")
def lora_run(trained, tmp_path_factory) -> Path:
    """A LoRA adapter on all seven targets of the tiny llama from Hugging Face, trained 2 steps with the CLI."""
    root = tmp_path_factory.mktemp("lora")
    assert main(sft(trained["llama_hf"], root, "--lora_r", "8", "--lora_targets", ALL_TARGETS)) == 0
    checkpoint = root / "epoch_0_step_2"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    return checkpoint


def test_a_lora_checkpoint_exports_merged_to_transformers_with_our_logits(trained, lora_run, tmp_path):
    """export --format hf reads the LoRA checkpoint through load_checkpoint, which merges the adapter into the base
    the pointer names: transformers gets one plain model computing the merged function."""
    assert export(lora_run, "--format", "hf", "--out", tmp_path / "hf") == 0
    assert not any("lora" in key for key in on_disk(tmp_path / "hf"))
    merged, base = load_model(lora_run), load_model(trained["llama_hf"])
    assert not torch.equal(merged.layers[0].attention.q_proj.weight, base.layers[0].attention.q_proj.weight)
    back = load_hf(tmp_path / "hf")
    assert type(back).__name__ == "LlamaForCausalLM"
    diff = logits_diff(merged, back, vocab=VOCAB)
    print(f"lora llama: exported merged max |logit diff| {diff:.2e}", file=sys.stderr)
    assert diff <= TOLERANCE


def test_a_lora_checkpoint_exports_as_a_peft_adapter_of_its_huggingface_base(trained, lora_run, tmp_path):
    """--format peft: PEFT's config and names; with peft installed, PeftModel on transformers' base computes our
    merged model's logits (float32, 1e-5): q/k's lora_B rows permuted back to rotate-half pairing."""
    assert export(lora_run, "--format", "peft", "--out", tmp_path / "peft") == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 32
    assert config["base_model_name_or_path"] == str(trained["llama_hf"].resolve())
    projections = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["target_modules"] == projections
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    ours = load_file(lora_run / "adapter_model.safetensors")
    layers = load_model(trained["llama_hf"]).config.num_hidden_layers
    expected = {
        f"base_model.model.model.layers.{i}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}.lora_{m}.weight"
        for i in range(layers)
        for p in projections
        for m in "AB"
    }
    assert set(tensors) == expected
    prefix = "base_model.model.model.layers.0"
    assert torch.equal(tensors[f"{prefix}.self_attn.q_proj.lora_A.weight"], ours["layers.0.attention.q_proj.lora_A"])
    assert torch.equal(tensors[f"{prefix}.self_attn.v_proj.lora_B.weight"], ours["layers.0.attention.v_proj.lora_B"])
    head_dim = load_model(trained["llama_hf"]).config.attention_head_dim
    assert torch.equal(
        tensors[f"{prefix}.self_attn.k_proj.lora_B.weight"],
        hf.interleaved_to_rotate_half(ours["layers.0.attention.k_proj.lora_B"], head_dim),
    )
    peft = pytest.importorskip("peft")
    adapted = peft.PeftModel.from_pretrained(load_hf(trained["llama_hf"]), tmp_path / "peft").eval()
    diff = logits_diff(load_model(lora_run), adapted, vocab=VOCAB)
    print(f"lora llama: PEFT adapter on transformers' base, max |logit diff| {diff:.2e}", file=sys.stderr)
    assert diff <= TOLERANCE


def test_peft_export_is_refused_without_a_huggingface_base(trained, tmp_path, capsys):
    line = run_refused([trained["llama"], "--format", "peft", "--out", tmp_path / "a"], tmp_path, capsys)
    assert "not a LoRA checkpoint with a base pointer" in line
    base = native(tmp_path / "native", vocab_size=VOCAB, max_position_embeddings=256)
    assert main(sft(base, tmp_path / "run", "--lora_r", "4", "--max_steps", "1", "--ckpt_interval", "1")) == 0
    line = run_refused(
        [tmp_path / "run" / "epoch_0_step_1", "--format", "peft", "--out", tmp_path / "b"], tmp_path, capsys
    )
    assert "is not a Hugging Face directory, so PEFT has no base model" in line
    moe = save_hf(
        build_hf(
            "MixtralConfig", vocab_size=VOCAB, max_position_embeddings=256, num_local_experts=2, num_experts_per_tok=1
        ),
        tmp_path / "mixtral_hf",
    )
    assert (
        main(
            sft(
                moe,
                tmp_path / "moe",
                "--lora_r",
                "4",
                "--lora_targets",
                "up",
                "--max_steps",
                "1",
                "--ckpt_interval",
                "1",
            )
        )
        == 0
    )
    line = run_refused(
        [tmp_path / "moe" / "epoch_0_step_1", "--format", "peft", "--out", tmp_path / "c"], tmp_path, capsys
    )
    assert "has no PEFT equivalent (only dense layers are mapped)" in line
    phi3 = save_hf(
        build_hf("Phi3Config", **CASES["phi3"][1], vocab_size=VOCAB, max_position_embeddings=256), tmp_path / "phi3_hf"
    )
    assert main(sft(phi3, tmp_path / "phi3", "--lora_r", "4", "--max_steps", "1", "--ckpt_interval", "1")) == 0
    line = run_refused(
        [tmp_path / "phi3" / "epoch_0_step_1", "--format", "peft", "--out", tmp_path / "d"], tmp_path, capsys
    )
    assert "adapter on layers.0.attention.k_proj has no PEFT equivalent: its base's files fuse that layer" in line
