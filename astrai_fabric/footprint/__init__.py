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

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.config.pipeline import stages_of_rank
from astrai_fabric.footprint.collectives import step_collectives, tp_all_reduce_width
from astrai_fabric.footprint.memory import (
    activation_bytes,
    adamw_step_temporaries,
    block_halves_saved,
    block_matrices,
    block_saved_elements,
    gathered_bytes,
    model_state_bytes,
    owners_exchange,
    quantized_savings,
)
from astrai_fabric.footprint.values import MATRIX_PARTS, Adapters, Collective, Footprint, Layout, Workload
from astrai_fabric.model.pipeline import stage_layers
from astrai_fabric.model.transformer import parameter_counts

__all__ = [
    "MATRIX_PARTS", "Adapters", "Collective", "Footprint", "Layout", "Workload", "activation_bytes",
    "adamw_step_temporaries", "block_halves_saved", "block_matrices", "block_saved_elements", "footprint",
    "model_state_bytes", "positions_of", "quantized_savings", "stage_footprint", "tp_all_reduce_width",
]  # fmt: skip


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
