"""ModelConfig reads and writes AstrAI's config.json; bad values give one error naming the field (TrainArgs'
optimizer flags too)."""

import json

import pytest

from astrai_fabric.config import ModelConfig
from astrai_fabric.errors import ConfigError


def test_defaults_are_astrai_defaults():
    config = ModelConfig()
    assert (config.attn_type, config.ffn_type, config.norm_topk_prob) == ("gqa", "mlp", True)
    assert (config.decoder_sparse_step, config.moe_aux_loss_coef, config.neftune_alpha) == (1, 0.01, 0.0)
    assert config.vocab_size is None and config.tie_word_embeddings is None


def test_unknown_keys_are_ignored_with_a_warning():
    with pytest.warns(UserWarning, match=r"ignoring keys .*'torch_dtype'"):
        config = ModelConfig.from_dict({"vocab_size": 10, "torch_dtype": "bfloat16"})
    assert config.vocab_size == 10
    assert "torch_dtype" not in config.to_dict()


def test_int_is_accepted_for_float_fields():
    assert ModelConfig.from_dict({"rope_theta": 10000}).rope_theta == 10000.0


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"hidden_size": "64"}, r"'hidden_size' must be int or null, got \"64\""),
        ({"tie_word_embeddings": 1}, r"'tie_word_embeddings' must be bool or null, got 1"),
        ({"num_hidden_layers": True}, r"'num_hidden_layers' must be int or null, got true"),
        ({"mlp_only_layers": [0, "1"]}, r"'mlp_only_layers' must be list of int or null"),
        ({"attn_type": "mha"}, r"attn_type must be one of \['gqa', 'mla'\], got 'mha'"),
        ({"decoder_sparse_step": 0}, r"decoder_sparse_step must be at least 1"),
    ],
)
def test_wrong_values_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw, source="model/config.json")


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 1.5}))
    with pytest.raises(ConfigError, match=rf"{path}: 'hidden_size' must be int or null, got 1.5"):
        ModelConfig.from_file(path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=rf"{path}: not valid JSON"):
        ModelConfig.from_file(path)
    with pytest.raises(ConfigError, match="file not found"):
        ModelConfig.from_file(tmp_path / "absent.json")


def test_check_buildable_lists_every_missing_field():
    with pytest.raises(ConfigError) as err:
        ModelConfig(vocab_size=10).check_buildable(source="x/config.json")
    message = str(err.value)
    assert message.startswith("x/config.json: cannot build a model")
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
        assert f"'{name}' is required" in message


def test_check_buildable_checks_head_arithmetic():
    config = ModelConfig(
        vocab_size=8,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=3,
        intermediate_size=8,
        max_position_embeddings=8,
    )
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads"):
        config.check_buildable()
    moe = ModelConfig(
        vocab_size=8,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=8,
        max_position_embeddings=8,
        ffn_type="moe",
        n_routed_experts=4,
        n_activated_experts=2,
    )
    with pytest.raises(ConfigError, match="'n_shared_experts' is required"):  # AstrAI raises a TypeError here
        moe.check_buildable()


def test_optimizer_flags_are_checked_and_nora_decay_defaults_to_weight_decay():
    from astrai_fabric.config.train import TrainArgs

    required = dict(param_path="bundled:tiny", data_root_path="bundled:data/seq")
    args = TrainArgs(**required, optimizer="nora_nadamw", weight_decay=0.07)
    assert args.resolved_nora_weight_decay == 0.07  # AstrAI's 0.0 left --weight_decay nothing to decay (B18)
    assert TrainArgs(**required, nora_weight_decay=0.0).resolved_nora_weight_decay == 0.0
    bad = TrainArgs(
        **required, nora_beta=1.0, nora_momentum=-0.1, mano_momentum=1.5, nora_weight_decay=-1.0, nora_lr=-1e-3
    )
    with pytest.raises(ConfigError) as raised:
        bad.validate()
    for message in (
        "nora_beta must be in [0, 1), got 1.0",
        "nora_momentum must be in [0, 1], got -0.1",
        "mano_momentum must be in [0, 1], got 1.5",
        "nora_weight_decay must be >= 0, got -1.0",
        "nora_lr must be >= 0, got -0.001",
    ):
        assert message in str(raised.value)


def test_warmup_is_given_one_way():
    from astrai_fabric.config.train import TrainArgs

    required = dict(param_path="bundled:tiny", data_root_path="bundled:data/seq")
    TrainArgs(**required, warmup_steps=10).validate()
    for given, message in (
        (dict(warmup_steps=10, warmup_ratio=0.05), "warmup_steps 10 and warmup_ratio 0.05 both set the warmup: give"),
        (dict(warmup_steps=-1), "warmup_steps must be >= 0, got -1"),
        (dict(warmup_ratio=1.5), "warmup_ratio must be in [0, 1], got 1.5"),
    ):
        with pytest.raises(ConfigError) as raised:
            TrainArgs(**required, **given).validate()
        assert message in str(raised.value)


def test_other_names_each_set_one_of_our_flags_and_shadow_none():
    """config.aliases: each name another project uses sets a field of ours; none is a field itself (it would hide
    ours), none both taken and answered as not taken; READ_BY names fields and train types."""
    import dataclasses
    import typing

    from astrai_fabric.config.aliases import ALIASES, NOT_TAKEN, WHOLE_NUMBERS
    from astrai_fabric.config.train import READ_BY, TrainArgs, TrainType

    fields = {f.name for f in dataclasses.fields(TrainArgs)}
    assert {name: alias.flag for name, alias in ALIASES.items() if alias.flag not in fields} == {}
    assert sorted(fields & (set(ALIASES) | set(NOT_TAKEN))) == []
    assert sorted(set(ALIASES) & set(NOT_TAKEN)) == [] and set(WHOLE_NUMBERS) <= fields
    assert set(READ_BY) <= fields
    assert {t for readers in READ_BY.values() for t in readers} <= set(typing.get_args(TrainType))
