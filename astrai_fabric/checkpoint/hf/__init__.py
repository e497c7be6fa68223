"""Hugging Face model directories: the one package that knows transformers' conventions (transformers is never
imported; it is the test oracle, ``tests/test_huggingface.py``).

A Hugging Face ``config.json`` names its architecture in ``model_type``. Each supported one maps onto the single
model of this project, ``AutoRegressiveLM``, so that it computes *the same function*; anything that would compute
something else is refused by name before a byte is written (AstrAI's adapter loads such models approximately, its
bug B21). Both config forms are read: transformers 4's (``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and
transformers 5's (``rope_parameters``, ``dtype``).

- ``families/``: one module per family (``llama.py``, ``qwen3.py``, ``deepseek_v3.py``, ...), all that is particular
  to it, with the transformers source file that states each fact (``src/transformers/models/<type>/``): its model
  type and class, its config's defaults and keys, the fields it reads and writes, its tensor names, what it refuses.
  Adding a family is adding its file there.
- ``family.py``: what a family is to the engine (``Family``) and the typed reads of a config (``Reader``).
- ``config.py``: ``config.json`` both ways (``model_config_from_hf``, ``hf_config``, ``export_model_type``) and
  ``HFSource``, where an imported model came from (kept in ``meta.json``).
- ``rope.py``: RoPE parameters and scaling as transformers reads them.
- ``tensors.py``: tensor names, the RoPE row permutation, fused tensors; ``state_dict_to_hf`` is the inverse of
  ``state_dict_from_hf``.
- ``tokenizer_config.py``: the tokenizer and generation files export writes.

Reading the files stays in ``checkpoint/files.py`` (the only safetensors importer); ``astrai_fabric.export`` writes
the directory.
"""

from astrai_fabric.checkpoint.hf.config import (
    ARCHITECTURES,
    SOURCE_KEY,
    HFSource,
    export_model_type,
    hf_config,
    is_hf_config,
    language_model_config,
    model_config_from_hf,
    sequence_classifier,
    source_of,
)
from astrai_fabric.checkpoint.hf.families import SUPPORTED_MODEL_TYPES
from astrai_fabric.checkpoint.hf.tensors import (
    Target,
    fused_into,
    hf_key_to_ours,
    import_targets,
    interleaved_to_rotate_half,
    is_hf_name,
    is_rotated,
    multi_token_prediction_layers,
    our_key_to_hf,
    rotate_half_to_interleaved,
    state_dict_from_hf,
    state_dict_to_hf,
)
from astrai_fabric.checkpoint.hf.tokenizer_config import generation_config, hf_tokenizer_config

__all__ = [
    "ARCHITECTURES",
    "SOURCE_KEY",
    "SUPPORTED_MODEL_TYPES",
    "HFSource",
    "Target",
    "export_model_type",
    "fused_into",
    "generation_config",
    "hf_config",
    "hf_key_to_ours",
    "hf_tokenizer_config",
    "import_targets",
    "interleaved_to_rotate_half",
    "is_hf_config",
    "is_hf_name",
    "is_rotated",
    "language_model_config",
    "model_config_from_hf",
    "multi_token_prediction_layers",
    "our_key_to_hf",
    "rotate_half_to_interleaved",
    "sequence_classifier",
    "source_of",
    "state_dict_from_hf",
    "state_dict_to_hf",
]
