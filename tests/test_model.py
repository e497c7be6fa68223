"""Model behaviour beyond the golden values: tie rules, RoPE table, masks, NEFTune, MoE."""

import dataclasses
import gc
import math

import pytest
import torch
from conftest import tiny_config

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.errors import ConfigError
from astrai_fabric.model import (
    AutoRegressiveLM,
    LanguageHead,
    ModelOutput,
    TokenLoss,
    count_parameters,
    make_doc_boundary_mask,
)
from astrai_fabric.model.layers import apply_rotary_emb, rope_factors, rope_table
from astrai_fabric.model.transformer import cycle_collection_paused, process_attention_mask


def test_tied_state_dict_omits_lm_head_and_load_reties(tiny_model):
    state = tiny_model.state_dict()
    assert "lm_head.weight" not in state
    assert tiny_model.lm_head.weight is tiny_model.embed_tokens.weight
    other = AutoRegressiveLM(tiny_config())
    other.load_state_dict(state)
    assert other.lm_head.weight is other.embed_tokens.weight
    assert torch.equal(other.lm_head.weight, state["embed_tokens.weight"])


def test_untied_load_without_lm_head_clones_the_embedding():
    model = AutoRegressiveLM(tiny_config(tie_word_embeddings=False))
    state = model.state_dict()
    assert "lm_head.weight" in state
    del state["lm_head.weight"]
    model.load_state_dict(state)
    assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()  # a clone, not shared


def test_tie_flag_must_be_exactly_true():
    # AstrAI ties only on `is True`; an absent flag (None) means untied.
    model = AutoRegressiveLM(tiny_config(tie_word_embeddings=None))
    assert model.lm_head.weight is not model.embed_tokens.weight


def test_rope_table_is_float64_angles_rounded_once_to_float32():
    table = rope_table(dim=8, max_len=5, base=10000.0)
    assert table.shape == (5, 4, 2) and table.dtype == torch.float32
    angle = 3 * 10000.0 ** (-4 / 8)  # position 3, pair 2: theta_i = base^(-2i/dim)
    assert table[3, 2, 0].item() == pytest.approx(math.cos(angle), abs=1e-7)
    assert table[3, 2, 1].item() == pytest.approx(math.sin(angle), abs=1e-7)


def test_rope_rotates_adjacent_pairs():
    x = torch.tensor([1.0, 0.0, 0.0, 1.0]).view(1, 1, 1, 4)
    angle = math.pi / 2
    rotary = rope_factors(torch.tensor([[math.cos(angle), math.sin(angle)], [1.0, 0.0]]).view(1, 1, 2, 2))
    out = apply_rotary_emb(x, rotary).flatten()
    # pair (x0, x1) = (1, 0) turns by 90 degrees to (0, 1); pair (x2, x3) keeps angle 0.
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0, 1.0]), atol=1e-7, rtol=0)


def test_rope_is_astrais_complex_product_bit_for_bit():
    """``apply_rotary_emb`` against AstrAI's rotation as its torch path writes it (astrai/extension/backend/rotary.py:
    each pair a complex number, times ``torch.complex(cos, sin)``): equal to the last bit; and within float32's
    rounding of the pairwise formula, ``(x0 cos - x1 sin, x0 sin + x1 cos)``, the rotation it is."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=generator)
    table = rope_table(dim=8, max_len=5, base=10000.0)[None].expand(2, -1, -1, -1)
    cos, sin = table[..., 0], table[..., 1]
    astrai = torch.view_as_real(torch.view_as_complex(x.reshape(2, 5, 3, -1, 2)) * torch.complex(cos, sin)[:, :, None])
    assert torch.equal(apply_rotary_emb(x, rope_factors(table)), astrai.flatten(-2))
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    even, odd = x[..., 0::2], x[..., 1::2]
    pairwise = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    torch.testing.assert_close(apply_rotary_emb(x, rope_factors(table)), pairwise, rtol=0, atol=1e-6)
    # A slice of the head (partial rotary, MLA's RoPE part) is rotated as the whole would be.
    wide = torch.cat([torch.randn(2, 5, 3, 2, generator=generator), x], dim=-1)
    assert torch.equal(apply_rotary_emb(wide[..., 2:], rope_factors(table)), apply_rotary_emb(x, rope_factors(table)))


def test_rope_table_stays_float32_when_the_model_is_cast_to_bf16(tiny_model):
    reference = tiny_model.rotary_embedding.freqs_cis.clone()
    tiny_model.to(torch.bfloat16)
    assert tiny_model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(tiny_model.rotary_embedding.freqs_cis, reference)
    assert "rotary_embedding.freqs_cis" not in tiny_model.state_dict()


def test_ntk_scaling_raises_the_base_and_other_types_are_ignored():
    plain = AutoRegressiveLM(tiny_config()).rotary_embedding
    ntk = AutoRegressiveLM(tiny_config(rope_scaling={"type": "ntk", "factor": 4.0})).rotary_embedding
    no_type = AutoRegressiveLM(tiny_config(rope_scaling={"factor": 4.0})).rotary_embedding
    linear = AutoRegressiveLM(tiny_config(rope_scaling={"type": "linear", "factor": 4.0})).rotary_embedding
    dim = 4  # 16 hidden / 4 heads
    assert ntk.base == pytest.approx(10000.0 * 4.0 ** (dim / (dim - 2)))
    assert no_type.base == ntk.base  # AstrAI: a dict without "type" counts as NTK
    assert linear.base == plain.base == 10000.0


def test_doc_boundary_mask_hand_computed():
    mask = make_doc_boundary_mask(torch.tensor([[0, 1, 2, 0, 1]]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


def test_attention_mask_shapes_follow_astrai():
    assert process_attention_mask(torch.ones(2, 5)).shape == (2, 1, 1, 5)
    assert process_attention_mask(torch.ones(2, 5, 5)).shape == (2, 1, 5, 5)
    assert process_attention_mask(torch.ones(2, 1, 5, 5)).shape == (2, 1, 5, 5)
    with pytest.raises(ValueError, match="2-D, 3-D or 4-D"):
        process_attention_mask(torch.ones(5))


def test_full_causal_mask_equals_no_mask(tiny_model):
    ids = torch.randint(0, 32, (2, 6))
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 6, 6)
    torch.testing.assert_close(tiny_model(ids, input_mask=causal)["logits"], tiny_model(ids)["logits"])


def test_position_ids_reach_rope(tiny_model):
    ids = torch.randint(0, 32, (1, 6))
    # RoPE sees only relative positions: a uniform shift changes nothing, a reset changes the output.
    shifted = torch.arange(3, 9).unsqueeze(0)
    reset = torch.tensor([[0, 1, 2, 0, 1, 2]])
    plain = tiny_model(ids)["logits"]
    torch.testing.assert_close(tiny_model(ids, position_ids=shifted)["logits"], plain, atol=1e-6, rtol=0)
    assert not torch.allclose(tiny_model(ids, position_ids=reset)["logits"], plain)


def test_neftune_noise_only_in_training():
    model = AutoRegressiveLM(tiny_config(neftune_alpha=5.0))
    ids = torch.randint(0, 32, (1, 4))
    model.eval()
    torch.testing.assert_close(model(ids)["logits"], model(ids)["logits"])
    model.train()
    assert not torch.allclose(model(ids)["logits"], model(ids)["logits"])


def moe_config(**overrides):
    values = dict(ffn_type="moe", n_routed_experts=8, n_shared_experts=1, n_activated_experts=2)
    values.update(overrides)
    return tiny_config(**values)


def test_moe_aux_loss_only_in_training_with_grad():
    model = AutoRegressiveLM(moe_config())
    ids = torch.randint(0, 32, (2, 4))
    assert "aux_loss" in model.train()(ids)
    with torch.no_grad():
        assert "aux_loss" not in model(ids)
    assert "aux_loss" not in model.eval()(ids)


def test_moe_every_parameter_gets_a_gradient_even_for_unused_experts():
    torch.manual_seed(0)
    model = AutoRegressiveLM(moe_config(n_routed_experts=16))
    ids = torch.zeros(1, 1, dtype=torch.long)  # one token: at most 2 of 16 experts see it
    out = model(ids)
    (out["logits"].sum() + out["aux_loss"]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []  # DDP without find_unused_parameters needs every parameter in the graph


def test_moe_layer_selection_follows_astrai():
    config = moe_config(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2)
    kinds = [config.ffn_type_of_layer(i) for i in range(4)]
    # layer 0 is listed dense; with step 2 only layers whose (index + 1) is even are MoE.
    assert kinds == ["mlp", "moe", "mlp", "moe"]


def test_input_must_be_two_dimensional(tiny_model):
    with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
        tiny_model(torch.zeros(4, dtype=torch.long))


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = AutoRegressiveLM(moe_config())
    recomputed = AutoRegressiveLM(moe_config())
    recomputed.load_state_dict(plain.state_dict())
    recomputed.gradient_checkpointing = True
    ids = torch.randint(0, 32, (2, 6))
    for model in (plain, recomputed):
        out = model(ids)
        (out["logits"].square().mean() + out["aux_loss"]).backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-7, rtol=0, msg=name)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"tie_word_embeddings": True, "num_key_value_heads": 2, "use_qk_norm": True, "use_gated_attention": True},
        {"attention_qkv_bias": True, "head_dim": 24, "qk_norm_before_rope": True, "use_qk_norm": True},
        {
            "attn_type": "mla",
            "kv_lora_rank": 8,
            "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 4,
            "use_qk_norm": True,
            "use_gated_attention": True,
            "num_key_value_heads": 2,
        },
        {
            "ffn_type": "moe",
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "n_activated_experts": 2,
            "moe_intermediate_size": 12,
            "shared_expert_intermediate_size": 20,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [1, 3],
        },
        {
            "ffn_type": "moe",
            "n_routed_experts": 3,
            "n_shared_experts": 0,
            "n_activated_experts": 1,
            "mlp_only_layers": [0],
        },
        {
            "ffn_type": "moe",
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "n_activated_experts": 2,
            "shared_expert_gate": True,
        },
        {  # DeepSeek-V3's layout: compressed query, shared RoPE key, narrower values, gated, grouped sigmoid routing
            "attn_type": "mla",
            "kv_lora_rank": 8,
            "q_lora_rank": 6,
            "qk_nope_head_dim": 6,
            "qk_rope_head_dim": 4,
            "v_head_dim": 5,
            "mla_shared_rope_key": True,
            "use_gated_attention": True,
            "ffn_type": "moe",
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "n_activated_experts": 2,
            "scoring_func": "sigmoid",
            "score_correction_bias": True,
            "n_group": 2,
            "topk_group": 1,
            "mlp_only_layers": [0],
        },
        {"norm_placement": "post", "use_qk_norm": True, "qk_norm_over_projection": True, "num_key_value_heads": 2},
        {"norm_placement": "sandwich", "norm_unit_offset": True, "use_qk_norm": True, "rope_local_theta": 1e3},
        {"score_head": True, "pad_token_id": 0, "tie_word_embeddings": False},
    ],
    ids=[
        "gqa",
        "tied-qknorm-gated",
        "bias-head-dim",
        "mla",
        "moe-sparse",
        "moe-no-shared",
        "moe-gated-shared",
        "deepseek-v3-layout",
        "post-norms-qknorm-over-projection",
        "sandwich-norms-local-rope",
        "reward-model-untied",
    ],
)
def test_the_closed_form_parameter_count_is_the_models(changes):
    """``count_parameters`` (no layer built) against the meta-device model's own count."""
    base = dict(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=40,
        max_position_embeddings=16,
    )
    config = ModelConfig(**{**base, **changes})
    with torch.device("meta"):
        model = AutoRegressiveLM(config)
    assert count_parameters(config) == model.num_parameters()


def test_a_config_bounds_its_layers_and_experts_before_counting_them():
    """Counting layer by layer (or building) a config with 2**31 - 1 layers never ends: refused first, at once."""
    huge = ModelConfig(
        vocab_size=8,
        hidden_size=8,
        num_hidden_layers=2**31 - 1,
        num_attention_heads=2,
        intermediate_size=8,
        max_position_embeddings=8,
    )
    with pytest.raises(ConfigError, match="'num_hidden_layers' must be at most 4,096, got 2,147,483,647"):
        huge.check_buildable()
    experts = dataclasses.replace(
        huge, num_hidden_layers=64, ffn_type="moe", n_routed_experts=2048, n_shared_experts=1, n_activated_experts=2
    )
    with pytest.raises(ConfigError, match="64 MoE layers x 2,049 experts"):
        experts.check_buildable()


def test_the_output_is_typed_and_reads_as_astrai_s_dict(tiny_model):
    """``ModelOutput``: attributes, and AstrAI's dict access (``out["logits"]``; a field not computed is a
    ``KeyError``, as a missing key was)."""
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    out = tiny_model(ids)
    assert (
        isinstance(out, ModelOutput)
        and out["logits"] is out.logits
        and out.logits.shape == (2, 8, tiny_model.config.vocab_size)
    )
    assert "logits" in out and "token_nll" not in out and "aux_loss" not in out and out.get("aux_loss") is None
    with pytest.raises(KeyError):
        out["token_nll"]
    fused = tiny_model(ids, nll_targets=ids, nll_chunk_size=3)
    assert fused.logits is None and "logits" not in fused and fused.token_nll.shape == (2, 8)


def test_trunk_then_the_head_on_its_own_is_the_forward(tiny_model):
    """The head is usable where no root forward holds it (a pipeline's last stage): trunk, then ``LanguageHead``,
    give the forward's logits and its fused token losses exactly."""
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    hidden, aux_loss, router_stats = tiny_model.trunk(ids)
    assert aux_loss is None and router_stats is None
    head = LanguageHead(tiny_model.lm_head, tiny_model.config.final_logit_softcapping)
    assert torch.equal(head(hidden).logits, tiny_model(ids).logits)
    targets = torch.roll(ids, -1, dims=1)
    separate = head(hidden, TokenLoss(targets, chunk_size=5)).token_nll
    assert torch.equal(separate, tiny_model(ids, nll_targets=targets, nll_chunk_size=5).token_nll)
    whole = torch.nn.functional.cross_entropy(tiny_model(ids).logits.flatten(0, 1), targets.flatten(), reduction="none")
    assert torch.allclose(separate.flatten(), whole, atol=1e-6)


def test_building_a_model_pauses_the_cycle_collector_and_restores_it(monkeypatch):
    """The collector rests while a model is built (``cycle_collection_paused``: 80% of DeepSeek-V3's construction
    on the meta device went to its collections) and comes back as it was, an error inside included."""
    seen = []
    real_init = torch.nn.Module.__init__

    def watching(self, *args, **kwargs):
        seen.append(gc.isenabled())
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__init__", watching)
    AutoRegressiveLM(tiny_config())
    assert seen[0] and not any(seen[1:])  # the model's own __init__ runs before the pause; all its parts inside
    assert gc.isenabled()
    gc.disable()
    try:
        with cycle_collection_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), cycle_collection_paused():
        raise RuntimeError
    assert gc.isenabled()
