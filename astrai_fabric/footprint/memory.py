"""A step's memory per rank, by part: model states, gathered parameters, activations (what autograd saves, counted
from our modules), the head and loss, the optimizer step's intermediates and Muon's owner exchange (the package's
docstring says what each counts)."""

from __future__ import annotations

import functools

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.footprint.values import MATRIX_PARTS, Adapters, Layout, Workload, adapter_parameters, block_linears
from astrai_fabric.model.transformer import ParameterCounts
from astrai_fabric.optim import STATE_BUFFERS
from astrai_fabric.optim.muon import OWNER_ROUND_BYTES
from astrai_fabric.optim.muon_owners import assign_owners, newton_schulz_flops
from astrai_fabric.parallel.mesh import MeshLayout
from astrai_fabric.quantize import BYTES_PER_WEIGHT, fits_blocks


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
