"""The networks a run builds from a ``ModelConfig``: on the meta device for counting and checking
(``meta_model``), initialised from the seed or read from weights (``initial_model``), and under FSDP filled shard by
shard (``load_sharded_weights``); and the run's LoRA adapter (``lora_spec``)."""

from __future__ import annotations

from lightning.fabric import Fabric
from torch import Tensor, nn

from astrai_fabric import lora
from astrai_fabric.checkpoint import Checkpoint, empty_model
from astrai_fabric.checkpoint.state import load_weights
from astrai_fabric.checkpoint.weights import allocating, shape_model
from astrai_fabric.config.model import ModelConfig
from astrai_fabric.config.train import TrainArgs
from astrai_fabric.model import AutoRegressiveLM
from astrai_fabric.quantize import plan_quantization
from astrai_fabric.strategy import is_fsdp


def lora_spec(args: TrainArgs) -> lora.LoRASpec | None:
    """The run's adapter, or None when ``lora_r`` is 0."""
    if not args.lora_r:
        return None
    return lora.LoRASpec(args.lora_r, args.lora_alpha, tuple(args.lora_targets), args.lora_dropout, args.lora_init)


def meta_model(config: ModelConfig, args: TrainArgs) -> nn.Module:
    """The run's model on the meta device (nothing allocated), adapters injected: for counting and checking."""
    model = shape_model(config)
    if (spec := lora_spec(args)) is not None:
        lora.inject(model, spec, args.random_seed)
    return model


def initial_model(
    fabric: Fabric,
    config: ModelConfig,
    weights: Checkpoint | None,
    seed: int,
    source: str,
    quantize: bool = False,
    num_shards: int = 1,
) -> nn.Module:
    """A model initialised from ``seed`` (identically on every rank, AstrAI's init) or from ``weights``; a model
    too large for this machine's memory is a ``ConfigError`` naming ``source``, where its config came from.
    ``quantize``: the block linear weights stored as NF4 as they are read (QLoRA, ``quantize.py``), those that split
    into ``num_shards`` FSDP shards of whole blocks; under FSDP such a model is read whole on each rank, in 4 bits,
    and Fabric shards it after (torchao's NF4 tensor splits and gathers as FSDP2 asks).

    From weights nothing is initialised: the tensors are allocated empty in the run's parameter dtype (what Fabric's
    precision would cast them to) and each is read from the memory-mapped files straight into its place
    (``checkpoint.load_model_weights``), so memory never holds the model twice, nor at a wider dtype. Under FSDP the
    model is built on the meta device instead and stays there: Fabric shards it, materialises only each rank's
    shards on its device, and ``load_sharded_weights`` fills them. Nothing after the model draws from the global
    generator, so skipping the initialisation changes no later random number.
    """
    fabric.seed_everything(seed, verbose=False)
    if weights is None:
        with allocating(source):
            return AutoRegressiveLM(config)
    if is_fsdp(fabric) and not quantize:
        return fabric.strategy.precision.convert_module(shape_model(config))
    model = empty_model(config, source)
    dtype = fabric.strategy.precision.convert_module(nn.Linear(1, 1)).weight.dtype
    keys = plan_quantization(model, num_shards).quantized if quantize else ()
    load_weights(model, weights, dtype=dtype, quantized=keys)
    return model


def load_sharded_weights(
    model: nn.Module, weights: Checkpoint | None, adapter: dict[str, Tensor] | None = None
) -> None:
    """Under FSDP, ``weights`` into a sharded, materialised model (no-op without weights).

    Each rank reads its own slice of every tensor from the memory-mapped files (``checkpoint._read_into``) rather
    than rank 0 reading everything and sending each rank its part: no collective per tensor, each rank touches
    only its 1/N of the bytes, and a rank's memory peaks at its shards plus one chunk, where a broadcast from rank
    0 needs a full-size receive buffer per tensor on every rank and N times the traffic from one process. It needs
    the files visible to every rank; where they are not (``read_on_rank_zero``), rank 0 has already read the whole
    state and sent it, as before, and each rank copies its part from that.
    """
    if weights is not None:
        load_weights(model, weights, adapter=adapter)
