"""The values a footprint is computed from and made of: the layout (``Layout``), the step's work (``Workload``),
LoRA's adapters, the blocks' linears, and the result (``Footprint``, its ``Collective`` s)."""

from __future__ import annotations

from dataclasses import dataclass, field

from astrai_fabric.config.model import ModelConfig
from astrai_fabric.parallel.mesh import MeshLayout

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
