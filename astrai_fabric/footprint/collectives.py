"""A step's collectives per rank: each kind, its group, the link it crosses and the bytes this rank hands it (the
package's docstring says how they are counted)."""

from __future__ import annotations

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.footprint.memory import owners_exchange, quantized_savings, unsharded_parameters
from astrai_fabric.footprint.values import Collective, Layout, Workload, adapter_parameters
from astrai_fabric.model.transformer import ParameterCounts


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
