"""A training step's memory and communication per rank, as arithmetic over the model config and the layout.

Nothing is built and no device is asked: a 405B-parameter plan is a few hundred multiplications, so ``--dry_run``
plans a cluster this machine is not (``--device_type cuda --nprocs 8 --num_nodes 16 --device_memory 141GiB``) and
the preflight warns with the same figures. What each figure counts:

- **model states**, as each rank holds them between steps: parameters and gradients in the parameters' dtype,
  sharded as the layout shards them (FSDP over shard x context, tensor parallelism splitting attention and the dense
  MLPs, expert parallelism dealing out the routed experts), and the optimizer's state: one buffer per entry of the
  matrices Muon, Nora or Mano update, AdamW's two for the rest (``optim.STATE_BUFFERS``);
- **gathered parameters**: FSDP's unsharded blocks in the compute dtype, all of them at the end of the forward
  when blocks stay gathered (``--fsdp_reshard_after_forward false``, AstrAI's), else two blocks (one computing, one
  prefetched);
- **activations**: what autograd saves for the backward of one micro-batch, counted from what our modules save
  (``block_saved_elements``: each RMSNorm its input, normalised input and output, attention its query, keys and
  values (copied per query head off CPU) and output, the SwiGLU MLP four of its width, an MoE layer its router and
  each slot's expert activations), or with ``--gradient_checkpointing`` each block's input plus one block's
  recomputation;
- **head and loss**: the logits, their float32 log-softmax and the loss's gradients into them, or with the fused
  loss one chunk of them;
- **the optimizer step**: the gradients, with AdamW's intermediates over DTensor parameters. The peak is
  the larger of the forward's end and the step (both together while gradients accumulate over micro-batches).
  Under FSDP and tensor parallelism, Muon's (Nora's, Mano's) owner exchange too (``owners_exchange``).

Under LoRA (``Adapters``) the base is frozen, as stored (QLoRA's 4-bit weights where NF4's blocks fit), gradients and
optimizer state are the float32 adapters', and a frozen weight's input is not saved.

Communication per optimizer step and rank, by collective: the bytes each rank hands the collective (an all-gather's
output, a reduce-scatter's input, an all-reduce's tensor, an all-to-all's input), exact where the data does not
decide them (the experts' all-to-alls count every slot both ways; Muon's owners are taken as balanced), and the bytes a
ring or pairwise exchange puts on the rank's link, ``(n - 1) / n`` of them (twice for an all-reduce), on the
intra-node link when the group fits in a node (groups are consecutive ranks inside their outer dimensions).

Checked against runs here: ``tests/test_footprint.py`` (model states and activations measured in one process) and
``bench/footprint.py`` (live tensor bytes and the bytes through each collective at 1, 2 and 4 gloo ranks);
docs/performance.md has the table.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.config.pipeline import stages_of_rank
from astrai_fabric.mesh import MeshLayout
from astrai_fabric.model.pipeline import stage_layers
from astrai_fabric.model.transformer import ParameterCounts, parameter_counts
from astrai_fabric.optim import STATE_BUFFERS
from astrai_fabric.optim.muon import OWNER_ROUND_BYTES
from astrai_fabric.optim.muon_owners import assign_owners, newton_schulz_flops
from astrai_fabric.quantize import BYTES_PER_WEIGHT, fits_blocks

MATRIX_PARTS = {"muon_adamw": "muon", "nora_nadamw": "nora", "mano_adamw": "mano", "adamw": "adamw"}
"""The part of each ``--optimizer`` that updates the blocks' matrices; the rest is AdamW's (or NAdamW's, alike)."""


@dataclass(frozen=True)
class Adapters:
    """LoRA (``--lora_r``) as the footprint reads it: the base frozen, adapters float32 on the target layers."""

    rank: int
    targets: tuple[str, ...]
    """``--lora_targets``."""
    dropout: bool = False
    """``--lora_dropout`` above 0: each adapted layer saves its dropped input and the mask."""
    quantized: bool = False
    """QLoRA (``--quantize nf4``): the block linears that fit NF4's blocks stored in 4 bits (``quantize``)."""


@dataclass(frozen=True)
class BlockLinear:
    """One kind of linear layer in the blocks: its name (a LoRA target's), shape and how many the model has."""

    name: str
    in_features: int
    out_features: int
    count: int


def block_linears(config: ModelConfig) -> list[BlockLinear]:
    """Every linear layer of the blocks whose name LoRA may target, or QLoRA quantise (routers and gates apart)."""
    hidden, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    head_dim, moe_layers = config.attention_head_dim, config.num_moe_layers
    kv_heads = config.num_key_value_heads or heads
    if config.attn_type == "mla":
        value_dim = config.v_head_dim or head_dim
        found = [
            BlockLinear("q_proj", config.q_lora_rank or hidden, heads * head_dim, layers),
            BlockLinear("o_proj", heads * value_dim, hidden, layers),
        ]
    else:
        found = [
            BlockLinear("q_proj", hidden, heads * head_dim, layers),
            BlockLinear("k_proj", hidden, kv_heads * head_dim, layers),
            BlockLinear("v_proj", hidden, kv_heads * head_dim, layers),
            BlockLinear("o_proj", heads * head_dim, hidden, layers),
        ]
    widths = [(config.intermediate_size, layers - moe_layers)]
    if moe_layers:
        widths.append((config.moe_intermediate_size or config.intermediate_size, moe_layers * config.n_routed_experts))
        shared = config.shared_expert_intermediate_size or config.intermediate_size
        widths.append((shared, moe_layers * config.n_shared_experts))
    for width, count in widths:
        if count:
            found += [
                BlockLinear("gate", hidden, width, count),
                BlockLinear("up", hidden, width, count),
                BlockLinear("down", width, hidden, count),
            ]
    return found


def adapter_parameters(config: ModelConfig, adapters: Adapters) -> int:
    """LoRA's parameters: ``r x (in + out)`` for each targeted layer."""
    return sum(
        adapters.rank * (linear.in_features + linear.out_features) * linear.count
        for linear in block_linears(config)
        if linear.name in adapters.targets
    )


@dataclass(frozen=True)
class Layout:
    """Where a run's ranks are: the mesh (``mesh.MeshLayout``; DDP's and one process's ``replicas`` = world size)
    and how many ranks share a node."""

    parallel_mode: str
    """``--parallel_mode``: none, ddp or fsdp."""
    mesh: MeshLayout
    ranks_per_node: int
    """Ranks sharing a node's links (``--nprocs``)."""

    @property
    def fsdp(self) -> bool:
        return self.parallel_mode == "fsdp" and self.mesh.world_size > 1

    def link(self, group_span: int) -> str:
        """The link a group of consecutive ranks ``group_span`` wide crosses."""
        return "intra-node" if group_span <= self.ranks_per_node else "inter-node"


@dataclass(frozen=True)
class Workload:
    """What one optimizer step of a run computes, as the footprint reads it (``train.footprint_plan.plan_cluster``
    takes it from the flags)."""

    sequences_per_micro_batch: int
    """Sequences in one rank's forward (a preference pair counts two; a frozen reference model is not counted)."""
    window: int
    """Positions per sequence."""
    grad_accum_steps: int
    """Micro-batches per optimizer step."""
    param_bytes: int
    """Bytes per parameter as stored (and per gradient and optimizer state entry)."""
    compute_bytes: int
    """Bytes per activation element."""
    gather_bytes: int
    """Bytes per parameter as FSDP gathers it (``--fsdp_param_dtype``, else the parameters' own)."""
    reduce_bytes: int
    """Bytes per gradient element in the reduction (``--fsdp_reduce_dtype``, else the gathered parameters')."""
    optimizer: str
    """``--optimizer``, resolved (``MATRIX_PARTS``)."""
    gradient_checkpointing: bool = False
    """``--gradient_checkpointing``: each block's activations recomputed in the backward."""
    loss_chunk_size: int = 0
    """Positions per chunk of the fused head and loss; 0: the whole logits."""
    reshard_after_forward: bool = False
    """``--fsdp_reshard_after_forward``: each block's gathered parameters freed after its forward."""
    sync_each_micro_batch: bool = False
    """``--fsdp_sync_each_micro_batch``: gradients reduce-scattered after every micro-batch."""
    adapters: Adapters | None = None
    """LoRA or QLoRA; None: every parameter trains."""
    ns_bytes: int = 2
    """Bytes per element of Muon's Newton-Schulz iteration (``--muon_ns_dtype``: bfloat16 on CUDA by default)."""
    muon_spread: bool = False
    """``--muon_spread_replicated`` resolved: under DDP each matrix orthogonalised by one rank and sent to the rest."""
    attention_copies_kv: bool = False
    """Whether attention copies each key/value head for its query heads (off CPU: ``model.attention.sdpa``); on CPU
    torch's kernel reads grouped heads as they are, and autograd saves the keys and values uncopied."""
    adamw_foreach: bool = False
    """Whether torch's AdamW runs its foreach path over DTensor parameters (off CPU), one intermediate per entry of
    a parameter group at once; torch offers no foreach kernels on CPU, where it updates one tensor at a time, holding
    two of that tensor's size (``adamw_step_temporaries``)."""
    pp_schedule: str = "1f1b"
    """``--pp_schedule`` under pipeline stages: how many micro-batches' activations a stage holds at once."""
    pp_stages_per_rank: int = 1
    """Pipeline stages each rank holds (``--pp_stages_per_rank`` resolved), looped as ``model.pipeline`` deals them."""
    carries_positions: bool = False
    """Whether a pipeline's stages send position ids with the hidden states (sft's packed documents)."""


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step, for one rank."""

    name: str
    """What it is for and its kind: ``FSDP all-gather``, ``CP all-to-all``, ..."""
    group_size: int
    """Ranks in its group."""
    link: str
    """``intra-node`` or ``inter-node``: the slowest link the group crosses."""
    handed_bytes: int
    """Bytes this rank hands the collective per optimizer step (see the module docstring)."""
    all_reduce: bool = False
    """An all-reduce moves its bytes twice (reduce-scatter then all-gather)."""

    point_to_point: bool = False
    """Sends to a neighbour (a pipeline's stages): all of its bytes cross the link."""

    @property
    def link_bytes(self) -> int:
        """Bytes on this rank's link per step: ``(n - 1) / n`` of what it hands over, twice for an all-reduce, all
        of it for a send."""
        if self.point_to_point:
            return self.handed_bytes
        share = (self.group_size - 1) / self.group_size
        return int(self.handed_bytes * share * (2 if self.all_reduce else 1))


@dataclass(frozen=True)
class Footprint:
    """Bytes per rank (``total``: at its peak) and communication per step (``collectives``)."""

    parameters: int
    """This rank's parameters as stored (its FSDP shards, its tensor-parallel share, its experts)."""
    gradients: int
    """Their gradients, in the parameters' dtype."""
    optimizer_state: int
    """The optimizer's buffers for this rank's parameters."""
    buffers: int
    """The RoPE tables (float32, every rank whole)."""
    gradient_buckets: int
    """DDP's: torch's DDP reduces the gradients through buckets of its own (``gradient_as_bucket_view`` off,
    Fabric's default), alive from the first step on."""
    gathered_parameters: int
    """FSDP's unsharded parameters at the forward's end (``gathered_bytes``)."""
    activations: int
    """What the forward saves for its backward in the blocks (``activation_bytes``): one micro-batch's, or on a
    pipeline's stage those of the micro-batches it holds at once (``micro_batches_held``)."""
    head_and_loss: int
    """The logits and their log-softmax, and the gradient the loss sends back into them."""
    step_temporaries: int
    """The optimizer step's own: foreach AdamW's intermediates over DTensor parameters (FSDP, tensor parallelism),
    one for each of its part's entries (fused AdamW, torch's on plain tensors, keeps none)."""
    gradients_in_forward: bool
    """Whether the gradients exist while a forward runs (accumulating over micro-batches): else they are made as the
    backward frees the activations, and the peak holds one or the other."""
    collectives: list[Collective] = field(default_factory=list)
    """Each collective of one optimizer step (``step_collectives``)."""
    stage: int | None = None
    """Under pipeline stages, the pipeline rank these figures are of (its stage, with one per rank): the one whose
    peak is the highest."""
    micro_batches_held: int = 1
    """Micro-batches whose activations the rank holds at once (several on a pipeline's stages; with several stages
    per rank, forward passes of one stage each)."""

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        fixed = self.parameters + self.optimizer_state + self.buffers + self.gradient_buckets
        fixed += self.gathered_parameters
        forward = self.activations + self.head_and_loss
        if self.gradients_in_forward:
            return fixed + self.gradients + max(forward, self.step_temporaries)
        return fixed + max(forward, self.gradients + self.step_temporaries)


def block_saved_elements(
    config: ModelConfig, moe_layer: bool, tp: int = 1, adapters: Adapters | None = None, kv_copied: bool = False
) -> float:
    """Elements autograd saves per position in one decoder block's forward (one tensor-parallel rank's): its
    attention half's and its MLP half's (``block_halves_saved``)."""
    return sum(block_halves_saved(config, moe_layer, tp, adapters, kv_copied))


def block_halves_saved(
    config: ModelConfig, moe_layer: bool, tp: int = 1, adapters: Adapters | None = None, kv_copied: bool = False
) -> tuple[float, float]:
    """Elements autograd saves per position in one decoder block's attention half and its MLP half, each with its
    norms and its adapters.

    Counted from our modules on the eager path (tests/test_footprint.py measures them): each input RMSNorm saves its
    input, its normalised input and its output (3 x hidden + 1), an output norm (``sandwich``: Gemma) all but its
    output, which only the residual sum reads; attention its query, its keys and values (copied to every query head
    where ``kv_copied``: ``Workload.attention_copies_kv``) and its output (``o_proj`` reads the same storage) and
    log-sum-exp (SDPA), q/k norms (Qwen3's) their inputs, outputs and 1 / rms per head; a SwiGLU MLP its gate,
    ``silu(gate)``, up and their product (4 x width); an MoE layer its router's probabilities, each slot's copy of
    the hidden state, each routed expert's MLP over its slots, the shared experts' and the combine.

    With LoRA a frozen weight takes no gradient, so what only its gradient reads is not saved: a norm keeps its
    input and 1 / rms (not its normalised input), a linear nothing (its input is saved only where an adapter reads
    it, the MLP's product only when ``down`` is adapted); each adapter saves its rank's activations (``B`` reads
    ``A``'s output), and with dropout its dropped input and the mask it was drawn as (``lora.LoRALinear``: a
    tensor of the input's dtype).
    """
    hidden = config.hidden_size
    heads = config.num_attention_heads // tp
    everything = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down")
    targets = everything if adapters is None else adapters.targets
    norm = 2 * hidden + 1 if adapters is None else hidden + 1
    norms_per_half = 2 if config.norm_placement == "sandwich" else 1  # Gemma's output norms keep their input too
    if config.attn_type == "mla":
        query = heads * config.attention_head_dim
        value = heads * (config.v_head_dim or config.attention_head_dim)
        latent = 3 * config.kv_lora_rank + 1 + (3 * config.q_lora_rank + 1 if config.q_lora_rank else 0)
        attention = 2 * query + 2 * value + heads + latent
    else:
        kv_heads = heads if kv_copied else (config.num_key_value_heads or config.num_attention_heads) // tp
        attention = 2 * (heads + kv_heads) * config.attention_head_dim + heads
    if config.use_qk_norm:  # each norm's input and output, and 1 / rms per head: the keys' before any copying
        normed_heads = heads + (config.num_key_value_heads or config.num_attention_heads) // tp
        attention += 2 * normed_heads * config.attention_head_dim + normed_heads
    # An input is saved by what reads it: full training's linears, LoRA's adapters (with dropout they read a dropped
    # copy instead, counted with them): an input norm's output, the MLP's product (``down``'s input).
    read = (lambda names: any(t in targets for t in names)) if adapters is None or not adapters.dropout else None
    attention += norms_per_half * norm + (hidden * read(("q_proj", "k_proj", "v_proj")) if read else 0)
    mlp_norms = norms_per_half * norm + (hidden * read(("gate", "up")) if read else 0)
    adapters_per_position = {"attention": 0.0, "mlp": 0.0}  # each adapter's rank (and dropout's input and mask)
    if adapters is not None:
        for linear in block_linears(config):
            mlp_linear = linear.name in ("gate", "up", "down")
            if linear.name in targets and not (mlp_linear and moe_layer):
                dropped = 2 * linear.in_features if adapters.dropout else 0  # the kept mask and the dropped input
                adapters_per_position["mlp" if mlp_linear else "attention"] += adapters.rank + dropped
    attention += adapters_per_position["attention"]
    down = bool(read and read(("down",)))
    if not moe_layer:
        return attention, mlp_norms + (3 + down) * config.intermediate_size / tp + adapters_per_position["mlp"]
    k, experts = config.n_activated_experts, config.n_routed_experts
    routed = config.moe_intermediate_size or config.intermediate_size
    shared = config.shared_expert_intermediate_size or config.intermediate_size
    expert_adapters = 0.0
    if adapters is not None:  # per slot: each adapter's rank, and with dropout its dropped input and mask
        for name, inputs in (("gate", hidden), ("up", hidden), ("down", routed)):
            expert_adapters += (adapters.rank + (2 * inputs if adapters.dropout else 0)) * (name in targets)
    mlp = 2 * experts + 2 * k  # the router's
    mlp += k * (hidden + (3 + down) * routed + 1 + expert_adapters)
    mlp += config.n_shared_experts * ((3 + down) * shared + expert_adapters) + 2 * hidden
    return attention, mlp_norms + mlp


def quantized_savings(config: ModelConfig, adapters: Adapters, num_shards: int, float_bytes: float) -> float:
    """Bytes QLoRA saves over the whole model: the block linears that fit NF4's blocks in ``num_shards`` FSDP shards
    (``quantize.plan_quantization``'s rule), each weight at ``quantize.BYTES_PER_WEIGHT`` for ``float_bytes``."""
    if not adapters.quantized:
        return 0.0
    quantized = sum(
        linear.in_features * linear.out_features * linear.count
        for linear in block_linears(config)
        if fits_blocks((linear.out_features, linear.in_features), num_shards)
    )
    return quantized * (float_bytes - BYTES_PER_WEIGHT)


def local_parameters(counts: ParameterCounts, layout: Layout) -> tuple[float, float]:
    """``(matrices, rest)``: the blocks' matrices and the other parameters (embeddings, head, norms) one rank holds.
    FSDP shards both over shard x context; tensor parallelism splits attention and the dense MLPs, experts stay whole
    on the tensor axis (expert parallelism deals them over ep of the shards, FSDP the rest)."""
    matrices = counts.attention + counts.dense_mlp + counts.routed_experts + counts.moe_other
    rest = counts.embeddings + counts.norms
    if not layout.fsdp:
        return matrices, rest
    shards, tp = layout.mesh.num_fsdp_shards, layout.mesh.tp
    split = (counts.attention + counts.dense_mlp) / (shards * tp)
    return split + (counts.routed_experts + counts.moe_other) / shards, rest / shards


def model_state_bytes(
    config: ModelConfig, counts: ParameterCounts, layout: Layout, workload: Workload
) -> tuple[int, int, int]:
    """``(parameters, gradients, optimizer state)`` bytes of one rank between steps. With LoRA the base is frozen
    (no gradient, no state) and the adapters train in float32 (their optimizer's matrix part: they are the blocks'
    matrices); QLoRA stores the block linears that fit NF4's blocks at ``quantize.BYTES_PER_WEIGHT``."""
    shards = layout.mesh.num_fsdp_shards if layout.fsdp else 1
    matrices, rest = local_parameters(counts, layout)
    local = matrices + rest
    matrix_buffers = STATE_BUFFERS[MATRIX_PARTS[workload.optimizer]]
    adapters = workload.adapters
    if adapters is None:
        parameters = int(local * workload.param_bytes)
        buffers = matrix_buffers * matrices + 2 * rest
        return parameters, parameters, int(buffers * workload.param_bytes)
    base = local * workload.param_bytes - quantized_savings(config, adapters, shards, workload.param_bytes) / shards
    trained = adapter_parameters(config, adapters) / shards * 4
    return int(base + trained), int(trained), int(matrix_buffers * trained)


def activation_bytes(config: ModelConfig, layout: Layout, workload: Workload) -> tuple[int, int]:
    """``(activations, head and loss)`` bytes of one rank's micro-batch: what its forward saves for the backward,
    and the logits with the loss's gradient into them. Under context parallelism a rank's blocks hold its share of
    the positions, its head the whole window's logits (gathered) unless the loss is fused."""
    mesh = layout.mesh
    positions = workload.sequences_per_micro_batch * workload.window // mesh.cp
    moe_layers = config.num_moe_layers
    # Keys and values copied per query head: off CPU, under soft-capping (its scores are materialised), and under
    # context parallelism where their heads do not split over the group (copied before the exchange).
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    kv_copied = (
        workload.attention_copies_kv or config.attn_logit_softcapping is not None or (kv_heads // mesh.tp) % mesh.cp
    )
    saved = dict(tp=mesh.tp, adapters=workload.adapters, kv_copied=bool(kv_copied))
    dense = block_saved_elements(config, False, **saved)
    moe = block_saved_elements(config, True, **saved) if moe_layers else 0.0
    per_position = (config.num_hidden_layers - moe_layers) * dense + moe_layers * moe
    adapters = workload.adapters
    if adapters is not None:
        # Under LoRA nothing before the first adapter takes a gradient: the first block's input norm saves nothing,
        # nor its whole attention half when no adapter is there.
        if set(adapters.targets) & {"q_proj", "k_proj", "v_proj", "o_proj"}:
            per_position -= config.hidden_size + 1
        else:
            per_position -= block_halves_saved(config, config.ffn_type_of_layer(0) == "moe", **saved)[0]
    if workload.gradient_checkpointing:  # each block's input, and one block recomputed in the backward
        per_position = config.num_hidden_layers * config.hidden_size + max(dense, moe)
    # the final norm (its input and 1 / rms; under full training its normalised input and output too, which its
    # weight's and the LM head's gradients read)
    per_position += 3 * config.hidden_size + 1 if adapters is None else config.hidden_size + 1
    rotary = positions * config.rope_dim * 4  # complex64 cos + i sin of each pair, every position, shared
    activations = int(positions * per_position * workload.compute_bytes) + rotary
    if workload.loss_chunk_size:
        head_positions = min(positions, workload.loss_chunk_size)
    else:
        head_positions = positions * mesh.cp
    # The logits in the compute dtype and their float32 log-softmax (a float32 copy first when they are not), then
    # the loss's float32 gradients into both, alive together.
    logit_bytes = workload.compute_bytes + 4 + (4 if workload.compute_bytes != 4 else 0) + 2 * 4
    return activations, int(head_positions * config.vocab_size * logit_bytes)


def gathered_bytes(counts: ParameterCounts, config: ModelConfig, layout: Layout, workload: Workload) -> int:
    """FSDP's unsharded parameters at the end of the forward: every block's when they stay gathered, else two
    blocks' (one computing, one prefetched); the root's (embeddings, head, final norm) in both. A group of one rank
    (a pipeline stage's, HSDP's replicas of one shard) gathers into copies all the same (measured,
    ``bench/footprint.py``)."""
    if not layout.fsdp:
        return 0
    mesh = layout.mesh
    per_block = (unsharded_parameters(counts, mesh) - counts.embeddings - config.hidden_size) / config.num_hidden_layers
    gathered_blocks = 2 if workload.reshard_after_forward else config.num_hidden_layers
    gathered = (gathered_blocks * per_block + counts.embeddings + config.hidden_size) * workload.gather_bytes
    if workload.adapters is not None:  # QLoRA's 4-bit weights, and the float32 adapters, of the gathered blocks
        share = gathered_blocks / config.num_hidden_layers
        savings = quantized_savings(config, workload.adapters, mesh.num_fsdp_shards, workload.gather_bytes)
        gathered += share * (adapter_parameters(config, workload.adapters) * 4 - savings)
    return int(gathered)


def unsharded_parameters(counts: ParameterCounts, mesh: MeshLayout, experts_gathered: bool = True) -> float:
    """The parameters FSDP gathers on one rank: a tensor-parallel rank's share of attention and the dense MLPs, the
    rest whole, and a rank's own experts unless ``experts_gathered`` is False (under expert parallelism they pass
    through a group of their own, the expert shards, or none)."""
    experts = counts.routed_experts / mesh.ep if experts_gathered else 0
    whole = counts.embeddings + counts.moe_other + counts.norms
    return (counts.attention + counts.dense_mlp) / mesh.tp + whole + experts


def adamw_step_temporaries(
    config: ModelConfig, counts: ParameterCounts, layout: Layout, workload: Workload, gradients: int
) -> int:
    """AdamW's intermediates at the step, over DTensor parameters (FSDP or tensor parallelism: torch's fused AdamW
    takes plain tensors only, ``optim.composite.fused_if_possible``), for what AdamW updates: ``adamw``'s matrices
    and the rest, the rest (embeddings, head, norms) beside Muon, Nora or Mano, the adapters under LoRA
    (``gradients``: theirs). Its foreach path (``Workload.adamw_foreach``) holds one per entry of the largest group,
    a group at a time; on CPU torch's per-tensor path holds two of the largest tensor (``exp_avg_sq.sqrt()`` and
    its quotient, the denominator: bench/footprint.py measured two heads' worth on a pipeline's end stage, whose
    largest group is its head alone, where the foreach count planned one)."""
    if not (layout.fsdp or layout.mesh.tp > 1):
        return 0
    if workload.adamw_foreach:
        if workload.adapters is not None:
            return gradients
        matrices, rest = local_parameters(counts, layout)
        largest = max(matrices, rest) if workload.optimizer == "adamw" else rest
        return int(largest * workload.param_bytes)
    shards = layout.mesh.num_fsdp_shards if layout.fsdp else 1
    if workload.adapters is not None:  # float32 adapters: A is r x in, B is out x r
        adapted = [linear for linear in block_linears(config) if linear.name in workload.adapters.targets]
        largest = max((max(x.in_features, x.out_features) for x in adapted), default=0) * workload.adapters.rank
        return int(2 * largest / shards * 4)
    largest = (config.vocab_size if counts.embeddings else 1) * config.hidden_size / shards  # else a norm
    if workload.optimizer == "adamw":  # the blocks' matrices, split as local_parameters splits them
        split = max((rows * cols for rows, cols in block_matrices(config)), default=0) / (shards * layout.mesh.tp)
        expert_shards = layout.mesh.num_expert_shards if layout.fsdp else 1
        width = config.moe_intermediate_size or config.intermediate_size
        expert = width * config.hidden_size / expert_shards if config.num_moe_layers else 0  # whole on the tp axis
        largest = max(largest, split, expert)
    return int(2 * largest * workload.param_bytes)


def block_matrices(config: ModelConfig) -> list[tuple[int, int]]:
    """``(rows, cols)`` of every matrix in the blocks (what Muon, Nora and Mano update): the LoRA-targetable linears
    (``block_linears``), the routers, shared-expert gates, attention gates and MLA's down-projections."""
    hidden, layers, moe_layers = config.hidden_size, config.num_hidden_layers, config.num_moe_layers
    shapes = [
        (linear.out_features, linear.in_features) for linear in block_linears(config) for _ in range(linear.count)
    ]
    shapes += [(config.n_routed_experts, hidden)] * moe_layers
    shapes += [(1, hidden)] * (moe_layers if config.shared_expert_gate else 0)
    width = config.num_attention_heads * (config.v_head_dim or config.attention_head_dim)
    shapes += [(width, hidden)] * (layers if config.use_gated_attention else 0)
    if config.attn_type == "mla":
        shared_rope = config.qk_rope_head_dim if config.mla_shared_rope_key else 0
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        head_width = config.attention_head_dim - shared_rope + (config.v_head_dim or config.attention_head_dim)
        shapes += [(config.kv_lora_rank + shared_rope, hidden), (kv_heads * head_width, config.kv_lora_rank)] * layers
        shapes += [(config.q_lora_rank, hidden)] * (layers if config.q_lora_rank else 0)
    return shapes


def owners_exchange(
    config: ModelConfig, counts: ParameterCounts, layout: Layout, workload: Workload
) -> tuple[int, int]:
    """``(bytes held, bytes handed to its all-to-alls)`` of Muon's, Nora's or Mano's owner exchange at the step
    (``optim.muon_owners``), for the rank owning the most: each matrix orthogonalised whole by one of the ``n`` ranks
    that share it, owners chosen from the shapes alone as the run chooses them (``assign_owners``).

    Under FSDP or tensor parallelism an owner holds its matrices whole (at most ``OWNER_ROUND_BYTES`` at once) and
    the iteration's three working matrices of the largest; a rank hands the first all-to-all its pieces of the
    others' matrices and the second the pieces of its results for the others. Under DDP with
    ``--muon_spread_replicated`` (``muon_spread``) each owner sends its results to every other rank in one
    all-to-all, holding every result and what it sends at once. Measured to 4% (``bench/footprint.py``)."""
    mesh = layout.mesh
    if MATRIX_PARTS[workload.optimizer] == "adamw" or workload.adapters is not None:
        return 0, 0
    ddp = layout.parallel_mode == "ddp" and mesh.world_size > 1
    ranks = mesh.world_size if ddp else mesh.num_fsdp_shards * mesh.tp if layout.fsdp else mesh.tp
    if ranks == 1 or (ddp and not workload.muon_spread):
        return 0, 0
    shapes = tuple(block_matrices(config))
    owned = most_owned(shapes, ranks)
    matrices, owned = sum(rows * cols for rows, cols in shapes) * workload.param_bytes, owned * workload.param_bytes
    if ddp:  # every result, the owner's sent to each other rank, and its own once more while it is packed
        return int(matrices + owned * ranks), int(owned * (ranks - 1))
    largest = max(rows * cols for rows, cols in shapes)
    held = min(owned, OWNER_ROUND_BYTES) + 3 * largest * workload.ns_bytes
    return int(held), int((matrices - owned) / ranks + owned * (ranks - 1) / ranks)


@functools.lru_cache(maxsize=16)
def most_owned(shapes: tuple[tuple[int, int], ...], ranks: int) -> int:
    """The most matrix elements one of ``ranks`` owns when ``assign_owners`` deals out matrices of ``shapes`` (kept:
    a plan's micro-batch search asks again for each size it tries, and the owners depend on the shapes alone)."""
    owners = assign_owners([newton_schulz_flops(rows, cols, 5) for rows, cols in shapes], ranks)
    owned_by: dict[int, int] = {}
    for (rows, cols), owner in zip(shapes, owners, strict=True):
        owned_by[owner] = owned_by.get(owner, 0) + rows * cols
    return max(owned_by.values(), default=0)


def footprint(config: ModelConfig, layout: Layout, workload: Workload) -> Footprint:
    """One rank's memory at its peak and its communication per step; under pipeline stages, a rank of the pipeline
    place whose peak is the highest (``stage_footprint``)."""
    if layout.mesh.pp > 1:
        stages = stage_layers(config, layout.mesh.pp, workload.pp_stages_per_rank)
        ranks = range(layout.mesh.pp)
        return max((stage_footprint(config, layout, workload, stages, rank) for rank in ranks), key=_peak)
    counts = parameter_counts(config)
    parameters, gradients, optimizer_state = model_state_bytes(config, counts, layout, workload)
    activations, head_and_loss = activation_bytes(config, layout, workload)
    positions = workload.sequences_per_micro_batch * workload.window // layout.mesh.cp
    tables = 2 if config.rope_local_theta is not None else 1
    buckets = gradients if layout.parallel_mode == "ddp" and layout.mesh.world_size > 1 else 0
    return Footprint(
        parameters,
        gradients,
        optimizer_state,
        tables * config.max_position_embeddings * config.rope_dim * 4,
        buckets,
        gathered_bytes(counts, config, layout, workload),
        activations,
        head_and_loss,
        adamw_step_temporaries(config, counts, layout, workload, gradients)
        + owners_exchange(config, counts, layout, workload)[0],
        workload.grad_accum_steps > 1,
        step_collectives(config, counts, layout, workload, positions),
    )


def _peak(found: Footprint) -> int:
    return found.total


def positions_of(workload: Workload) -> int:
    """Positions of one micro-batch (one rank's, without context parallelism)."""
    return workload.sequences_per_micro_batch * workload.window


def stage_footprint(
    config: ModelConfig, layout: Layout, workload: Workload, stages: list[range], rank: int
) -> Footprint:
    """A rank of pipeline place ``rank`` (of ``layout.mesh.pp``), holding stages ``rank``, ``rank + pp``, ... of
    ``stages`` (each stage's blocks, ``model.pipeline.stage_layers``): its stages' parameters sharded among the
    place's ranks as a whole model's are (the embedding on the first stage, the final norm and the head on the
    last: a tied head's copy too), the activations of the forward passes in flight there (GPipe and looped BFS: every
    micro-batch of every stage held; 1F1B: the places after it, at most the micro-batches; interleaved 1F1B: torch's
    warm-up forwards plus one, of the rank's largest stage), the head and loss on the last stage only (one
    micro-batch's under the 1F1B schedules), and per step, besides the rank's own collectives, each stage's sends to
    its neighbours (forward: the hidden states with the targets and, for sft, the position ids; backward: the hidden
    states' gradient) and, with tied embeddings, the all-reduce of the embedding's gradient between the end stages."""
    num_ranks, num_stages = layout.mesh.pp, len(stages)
    held = list(stages_of_rank(rank, num_ranks, num_stages // num_ranks))
    first, last = held[0] == 0, held[-1] == num_stages - 1
    own = _with_blocks(config, [i for index in held for i in stages[index]])
    whole = parameter_counts(own)
    embedding = config.vocab_size * config.hidden_size
    counts = dataclasses.replace(
        whole,
        embeddings=embedding * (first + last),  # an end stage's own: the embedding, the head (or its tied copy)
        norms=whole.norms - (0 if last else config.hidden_size),
    )
    parameters, gradients, optimizer_state = model_state_bytes(own, counts, layout, workload)
    per_stage = [activation_bytes(_with_blocks(config, list(stages[index])), layout, workload)[0] for index in held]
    head_and_loss = activation_bytes(own, layout, workload)[1]
    if not workload.loss_chunk_size:  # the stage's logits are not kept: log-softmax's output and two gradients
        head_and_loss = positions_of(workload) * config.vocab_size * 12
    micro, schedule = workload.grad_accum_steps, workload.pp_schedule
    if schedule in ("gpipe", "looped_bfs"):  # every forward before the backwards: each stage's every micro-batch
        in_flight, activations = micro * len(held), micro * sum(per_stage)
    elif schedule == "interleaved_1f1b":
        in_flight = min(interleaved_warmup(rank, num_ranks, len(held), micro) + 1, micro * len(held))
        activations = in_flight * max(per_stage)
    else:
        in_flight = min(micro, num_ranks - rank)
        activations = in_flight * per_stage[0]
    heads_in_flight = (micro if schedule in ("gpipe", "looped_bfs") else 1) if last else 0
    positions = positions_of(workload)
    collectives = step_collectives(own, counts, layout, workload, positions)
    mesh = layout.mesh
    # A neighbour stage's rank is one place's ranks away; with several stages per rank the last place also sends
    # to the first (stage P-1 to stage P), across the whole pipeline.
    link = layout.link(mesh.ranks_per_stage * 2 if len(held) == 1 else mesh.world_size)
    hidden = positions * config.hidden_size * workload.compute_bytes
    carried = positions * 8 * (2 if workload.carries_positions else 1)  # the targets (and position ids): int64
    sends = [(0 if index == num_stages - 1 else hidden + carried) + (0 if index == 0 else hidden) for index in held]
    collectives.append(Collective("PP send", 2, link, micro * sum(sends), point_to_point=True))
    if config.tied and (first or last):
        shards = mesh.num_fsdp_shards if layout.fsdp else 1
        ends = layout.link(mesh.world_size)
        tied = int(embedding / shards * workload.reduce_bytes)
        collectives.append(Collective("PP all-reduce (tied embedding)", 2, ends, tied, True))
    tables = 2 if config.rope_local_theta is not None else 1
    step_temporaries = adamw_step_temporaries(own, counts, layout, workload, gradients)
    step_temporaries += owners_exchange(own, counts, layout, workload)[0]
    return Footprint(
        parameters,
        gradients,
        optimizer_state,
        tables * config.max_position_embeddings * config.rope_dim * 4,
        0,
        gathered_bytes(counts, own, layout, workload),
        int(activations),
        heads_in_flight * head_and_loss,
        step_temporaries,
        micro > 1,
        collectives,
        stage=rank,
        micro_batches_held=in_flight,
    )


def interleaved_warmup(rank: int, num_ranks: int, stages_per_rank: int, num_micro_batches: int) -> int:
    """The forwards torch's interleaved 1F1B runs on pipeline rank ``rank`` before its first backward: its earlier
    stages' share of a round, two more per place before the last, at most every forward of the step (torch 2.13's
    ``_get_warmup_ops``, with its rounds of ``num_micro_batches // max(1, num_micro_batches // num_ranks)``)."""
    per_round = num_micro_batches // max(1, num_micro_batches // num_ranks)
    warmup = (stages_per_rank - 1) * per_round + 2 * (num_ranks - 1 - rank)
    return min(warmup, num_micro_batches * stages_per_rank)


def _with_blocks(config: ModelConfig, blocks: list[int]) -> ModelConfig:
    """``config`` with only ``blocks`` (by index) as its decoder layers: a pipeline rank's or stage's share."""
    types = None if config.layer_types is None else [config.layer_types[i] for i in blocks]
    return dataclasses.replace(config, num_hidden_layers=len(blocks), layer_types=types)


def tp_all_reduce_width(config: ModelConfig, forward_passes: int = 1) -> int:
    """Elements per position all-reduced per micro-batch under tensor parallelism: in each forward, one hidden
    state per row-parallel output (o_proj, a dense MLP's down: an MoE layer's experts are whole), except that a
    recomputed forward (``forward_passes`` 2: checkpointing) stops at its block's last saved tensor and so skips a
    dense MLP's down (torch's non-reentrant checkpoint stops early); in the backward, each column-parallel linear's
    input gradient: q, k, v and the attention gate (a hidden state each), MLA's q_b_proj (its ``q_lora_rank``
    latent, or q_proj's hidden state) and kv_b_proj (the ``kv_lora_rank`` latent), a dense MLP's gate and up."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    dense_layers = layers - config.num_moe_layers
    if config.attn_type == "mla":
        column = (config.q_lora_rank or hidden) + config.kv_lora_rank
    else:
        column = (3 + (1 if config.use_gated_attention else 0)) * hidden
    forward = (layers + dense_layers) * hidden + (forward_passes - 1) * layers * hidden
    backward = layers * column + dense_layers * 2 * hidden
    return forward + backward


def step_collectives(
    config: ModelConfig, counts: ParameterCounts, layout: Layout, workload: Workload, positions: int
) -> list[Collective]:
    """Each collective of one optimizer step, for one rank (``positions``: its positions per micro-batch)."""
    mesh, micro = layout.mesh, workload.grad_accum_steps
    found = []
    # LoRA: the frozen base is gathered as stored (QLoRA's 4-bit weights smaller), and only the float32 adapters
    # have gradients to reduce.
    adapters = workload.adapters
    adapter_bytes = 0 if adapters is None else adapter_parameters(config, adapters) * 4
    if layout.parallel_mode == "ddp" and mesh.world_size > 1:
        grads = counts.total * workload.reduce_bytes if adapters is None else adapter_bytes
        found.append(Collective("DDP all-reduce", mesh.world_size, layout.link(mesh.world_size), grads, True))
    if layout.fsdp:
        shards, span = mesh.num_fsdp_shards, mesh.num_fsdp_shards * mesh.tp
        gathers = micro * (2 if workload.reshard_after_forward else 1)
        reductions = micro if workload.sync_each_micro_batch else 1
        # A rank's experts have a group of their own: the expert shards (shards / ep), when there are several; a
        # group of one rank gathers and reduces nothing (HSDP's replicas of one shard, a pipeline stage's rank).
        groups = [("FSDP", shards, span, unsharded_parameters(counts, mesh, experts_gathered=mesh.ep == 1))]
        groups = groups if shards > 1 else []
        if mesh.ep > 1 and mesh.num_expert_shards > 1:
            groups.append(("FSDP (experts)", mesh.num_expert_shards, span, counts.routed_experts / mesh.ep))
        for name, size, group_span, unsharded in groups:
            link = layout.link(group_span)
            gathered, reduced = unsharded * workload.gather_bytes, unsharded * workload.reduce_bytes
            if adapters is not None:  # the adapters travel with the main group's blocks
                gathered -= quantized_savings(config, adapters, size, workload.gather_bytes) if name == "FSDP" else 0
                gathered += adapter_bytes if name == "FSDP" else 0
                reduced = adapter_bytes if name == "FSDP" else 0
            found += [
                Collective(f"{name} all-gather", size, link, int(gathers * gathered)),
                Collective(f"{name} reduce-scatter", size, link, int(reductions * reduced)),
            ]
        if mesh.replicas > 1:
            replicated = int(reductions * unsharded_parameters(counts, mesh) / shards * workload.reduce_bytes)
            link = layout.link(span * mesh.replicas)
            found.append(Collective("HSDP all-reduce", mesh.replicas, link, replicated, True))
    if handed := owners_exchange(config, counts, layout, workload)[1]:
        ranks = mesh.num_fsdp_shards * mesh.tp if layout.fsdp else mesh.tp if mesh.tp > 1 else mesh.world_size
        found.append(Collective("Muon owners' all-to-all", ranks, layout.link(ranks), handed))
    activation = positions * config.hidden_size * workload.compute_bytes
    layers = micro * config.num_hidden_layers
    if mesh.tp > 1:
        passes = 2 if workload.gradient_checkpointing else 1
        found.append(
            Collective(
                "TP all-reduce",
                mesh.tp,
                layout.link(mesh.tp),
                micro * tp_all_reduce_width(config, passes) * positions * workload.compute_bytes,
                True,
            )
        )
    if mesh.cp > 1:
        link = layout.link(mesh.cp * mesh.tp)
        # q, k, v and the output traded for heads and back, in the forward and the backward (and the recomputed
        # forward); keys and values keep their heads where those split over the group, else are repeated first
        heads = config.num_attention_heads // mesh.tp
        kv_heads = (config.num_key_value_heads or config.num_attention_heads) // mesh.tp
        kv_heads = kv_heads if kv_heads % mesh.cp == 0 else heads
        value_dim = config.v_head_dim or config.attention_head_dim
        width = heads * config.attention_head_dim + kv_heads * (config.attention_head_dim + value_dim)
        width += heads * value_dim
        passes = 3 if workload.gradient_checkpointing else 2
        handed = layers * passes * positions * width * workload.compute_bytes
        found.append(Collective("CP all-to-all", mesh.cp, link, handed))
        # the head's output gathered over the group, and its gradient summed back: the logits, or the fused loss's
        # float32 token losses (whose gradient reaches the head inside the fused forward)
        window = positions * mesh.cp
        if workload.loss_chunk_size:
            found.append(Collective("CP all-gather (token losses)", mesh.cp, link, micro * window * 4))
        else:
            logits = micro * window * config.vocab_size * workload.compute_bytes
            found += [
                Collective("CP all-gather (logits)", mesh.cp, link, logits),
                Collective("CP all-reduce (logits' gradient)", mesh.cp, link, logits, True),
            ]
    if mesh.ep > 1 and config.num_moe_layers:
        # each slot's hidden state out and back in the forward, their gradients back and out in the backward, and
        # the forward's two again where the backward recomputes it
        exchanges = 6 if workload.gradient_checkpointing else 4
        handed = micro * config.num_moe_layers * exchanges * config.n_activated_experts * activation
        found.append(Collective("EP all-to-all", mesh.ep, layout.link(mesh.ep * mesh.cp * mesh.tp), handed))
    return found
