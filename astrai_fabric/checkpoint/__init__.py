"""AstrAI's checkpoint directories and the models in them, one module per job:

- ``files``: the directory format, written atomically and read strictly and safely (the only safetensors importer)
- ``directory``: the checkpoints in a ``ckpt_dir``: names, the newest complete one, pruning, stale staging
- ``ownership``: who may write into a ``ckpt_dir``: writable, one run at a time (a lock), a manifest of its files
- ``weights``: a directory read as a model (AstrAI's, Hugging Face's, a LoRA checkpoint) and bound to one
- ``adapter``: a LoRA adapter directory and the pointer to its base weights
- ``hf``: the Hugging Face mapping (the only module that knows transformers' conventions)
- ``state``: what a resume needs (optimizer, schedule, RNG, position): gathered, sharded, exported

The names users need are importable from here (``from astrai_fabric.checkpoint import load_model``), and importing
them is light: ``state`` imports Lightning and torch.distributed.checkpoint, so it is not imported here (import
``astrai_fabric.checkpoint.state`` where a run is resumed or exported).
"""

from astrai_fabric.checkpoint.adapter import (
    LORA_BASE_KEY,
    LoRAAdapter,
    lora_base_entry,
    read_adapter,
    resolve_lora_base,
    weight_digests,
    weight_files,
)
from astrai_fabric.checkpoint.directory import (
    CHECKPOINT_NAME,
    checkpoint_problem,
    checkpoint_step,
    checkpoints_after,
    complete_checkpoints,
    find_latest_checkpoint,
    prune_checkpoints,
    remove_stale_staging,
)
from astrai_fabric.checkpoint.files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    CONFIG_FILE,
    FORMAT_KEY,
    FORMAT_VERSION,
    META_FILE,
    RESERVED_META,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    StoredStateDict,
    save_checkpoint,
    save_model_directory,
    staging_dir,
)
from astrai_fabric.checkpoint.weights import (
    Checkpoint,
    empty_model,
    load_checkpoint,
    load_language_model,
    load_model,
    load_model_weights,
    read_model_config,
    weights_source,
)

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_FILE",
    "CHECKPOINT_NAME",
    "CONFIG_FILE",
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "LORA_BASE_KEY",
    "META_FILE",
    "RESERVED_META",
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX_FILE",
    "Checkpoint",
    "LoRAAdapter",
    "StoredStateDict",
    "checkpoint_problem",
    "checkpoint_step",
    "checkpoints_after",
    "complete_checkpoints",
    "empty_model",
    "find_latest_checkpoint",
    "load_checkpoint",
    "load_language_model",
    "load_model",
    "load_model_weights",
    "lora_base_entry",
    "prune_checkpoints",
    "read_adapter",
    "read_model_config",
    "remove_stale_staging",
    "resolve_lora_base",
    "save_checkpoint",
    "save_model_directory",
    "staging_dir",
    "weight_digests",
    "weight_files",
    "weights_source",
]
