"""Regenerate the golden forward values in this folder from AstrAI's own model code.

Not a test and not part of the package: run it with a Python that can import AstrAI
(public repository ViperEkura/AstrAI, snapshot 75304d0; under Python 3.11 replace the 3.12-only line
``type MessageType = ...`` in ``astrai/tokenize/chat_template.py`` by a plain assignment):

    PYTHONPATH=/path/to/AstrAI /path/to/astrai-venv/bin/python tests/data/golden/make_golden.py

For each tiny config it seeds torch, builds AstrAI's ``AutoRegressiveLM`` (AstrAI's own initialisation),
runs its training-mode forward (float32, CPU) on fixed inputs with no mask, a document-boundary mask and a
2-D padding mask, and writes ``<name>.safetensors`` (weights under ``weight.*``, inputs and outputs under
their names, AstrAI's key order in the metadata) plus ``<name>.json`` (the config.json AstrAI writes for that model).
"""

import json
from pathlib import Path

import torch
from astrai.config.model_config import AutoRegressiveLMConfig
from astrai.model.transformer import AutoRegressiveLM
from astrai.trainer.strategy import make_doc_boundary_mask
from safetensors.torch import save_file

BASE = dict(
    vocab_size=48,
    hidden_size=16,
    num_hidden_layers=2,
    rms_norm_eps=1e-6,
    intermediate_size=32,
    max_position_embeddings=16,
    num_attention_heads=4,
    num_key_value_heads=2,
)

CONFIGS = {
    "dense_tied": dict(BASE, tie_word_embeddings=True, rope_theta=10000.0),
    "dense_untied_ntk": dict(
        BASE,
        tie_word_embeddings=False,
        num_key_value_heads=1,
        rope_theta=500000.0,
        rope_scaling={"type": "ntk", "factor": 4.0},
    ),
    "qknorm_gated": dict(BASE, tie_word_embeddings=True, use_qk_norm=True, use_gated_attention=True),
    "moe": dict(
        BASE,
        tie_word_embeddings=False,
        ffn_type="moe",
        n_routed_experts=4,
        n_shared_experts=1,
        n_activated_experts=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[0],
    ),
    "mla": dict(
        BASE,
        tie_word_embeddings=True,
        attn_type="mla",
        num_attention_heads=2,
        num_key_value_heads=1,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        use_qk_norm=True,
    ),
}


def main() -> None:
    out_dir = Path(__file__).parent
    for seed, (name, raw) in enumerate(CONFIGS.items()):
        config = AutoRegressiveLMConfig.from_dict(raw)
        torch.manual_seed(seed)
        model = AutoRegressiveLM(config).float().train()

        gen = torch.Generator().manual_seed(100 + seed)
        input_ids = torch.randint(0, config.vocab_size, (2, 8), generator=gen)
        position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 0, 1, 2, 3, 4]])
        doc_mask = make_doc_boundary_mask(position_ids)
        pad_mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3], dtype=torch.bool)

        tensors = {f"weight.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        tensors.update(input_ids=input_ids, position_ids=position_ids, pad_mask=pad_mask)
        with torch.no_grad():
            causal = model(input_ids)
            tensors["logits_causal"] = causal["logits"]
            tensors["logits_doc"] = model(input_ids, input_mask=doc_mask, position_ids=position_ids)["logits"]
            tensors["logits_pad"] = model(input_ids, input_mask=pad_mask)["logits"]
        if config.ffn_type == "moe":
            # The aux loss exists only in training mode with grad enabled (AstrAI's rule).
            tensors["aux_loss"] = model(input_ids)["aux_loss"].detach()

        # safetensors stores keys sorted; the metadata keeps AstrAI's registration order.
        order = {"state_dict_order": json.dumps(list(model.state_dict()))}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / f"{name}.safetensors"), order)
        (out_dir / f"{name}.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        print(name, {k: tuple(v.shape) for k, v in tensors.items() if not k.startswith("weight.")})


if __name__ == "__main__":
    main()
