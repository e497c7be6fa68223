"""``parallel_mode`` → a Fabric: the only place strategies, devices and precision are chosen.

- ``none`` → one process on one device;
- ``ddp`` → ``DDPStrategy`` with AstrAI's ``gradient_as_bucket_view=True, broadcast_buffers=False``;
- ``fsdp`` → ``ModelParallelStrategy`` running ``parallelize`` (FSDP2 ``fully_shard`` on every decoder block and
  the root), with explicit mesh sizes (Lightning's ``"auto"`` would put every rank on the tensor axis of one node,
  leaving FSDP a data mesh of one rank and every rank all the data); ``--fsdp_shard_size`` below the data-parallel
  size makes it HSDP, ``--cp_size`` adds context parallelism, ``--ep_size`` expert parallelism (``mesh.MeshLayout``).

Any mode with a world of one process trains on a single device; ``astrai-fabric evaluate`` gets DDP's process group
and launcher only (``evaluation_fabric``). Launching: the CLI launches ``nprocs`` local
ranks itself; under ``fabric run``, torchrun or SLURM the processes already exist, the environment fixes the
world size, and ``fabric.launch()`` must not be called (it raises there).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, NamedTuple

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

from astrai_fabric.errors import ConfigError
from astrai_fabric.loggers import build_loggers
from astrai_fabric.parallel.mesh import MeshLayout, mesh_layout
from astrai_fabric.parallel.parallelize import APPLIED_LAYOUT, parallelize


@dataclass(frozen=True)
class Topology:
    """Where the ranks come from and how many there are."""

    devices: int
    """Ranks per node."""
    num_nodes: int
    launched_externally: bool
    """True under ``fabric run``, torchrun or SLURM: the processes exist already."""

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def resolve_topology(nprocs: int = 1, num_nodes: int = 1) -> Topology:
    """Ranks per node and nodes, from the launcher's environment when there is one, else from ``--nprocs`` and
    ``--num_nodes``."""
    env = os.environ
    if env.get("LT_CLI_USED") == "1":  # fabric run
        topology = Topology(int(env.get("LT_DEVICES", "1")), int(env.get("LT_NUM_NODES", "1")), True)
    elif TorchElasticEnvironment.detect():  # torchrun
        local = int(env["LOCAL_WORLD_SIZE"])
        topology = Topology(local, int(env["WORLD_SIZE"]) // local, True)
    elif SLURMEnvironment.detect():
        nodes = int(env.get("SLURM_NNODES", "1"))
        topology = Topology(int(env["SLURM_NTASKS"]) // nodes, nodes, True)
    else:
        return Topology(nprocs, num_nodes, False)
    # Only a value given that says otherwise conflicts: the defaults (1) mean "what the launcher decides", and
    # --nprocs may be the ranks per node or (as AstrAI's docs have it) the world size.
    conflicts = []
    if nprocs != 1 and nprocs not in (topology.devices, topology.world_size):
        conflicts.append(f"--nprocs {nprocs}")
    if num_nodes != 1 and num_nodes != topology.num_nodes:
        conflicts.append(f"--num_nodes {num_nodes}")
    if conflicts:
        warnings.warn(
            f"the launcher runs {topology.devices} rank(s) per node on {topology.num_nodes} node(s); "
            f"{' and '.join(conflicts)} {'is' if len(conflicts) == 1 else 'are'} ignored",
            stacklevel=2,
        )
    return topology


def planned_accelerator(device_type: str | None) -> str:
    """``--device_type``, else what ``fabric run --accelerator`` chose, else cuda when available; a plan may name a
    device this machine lacks (``--dry_run`` plans clusters), a run may not (``resolve_accelerator``)."""
    launcher_choice = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}.get(os.environ.get("LT_ACCELERATOR", ""))
    return device_type or launcher_choice or ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_accelerator(device_type: str | None) -> str:
    """The run's device kind (``planned_accelerator``), refused when this machine has none of it."""
    accelerator = planned_accelerator(device_type)
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device_type cuda: no CUDA device is available here (use --device_type cpu)")
    return accelerator


def resolve_precision(precision: str, accelerator: str) -> str:
    """``auto``: AstrAI's pure bf16 on CUDA; float32 on CPU, where bf16 matrix products are slow."""
    if precision == "auto":
        return "bf16-true" if accelerator == "cuda" else "32-true"
    return precision


ASTRAI_NUM_WORKERS = 4
"""AstrAI's default ``num_workers``, the most the machine-decided default gives."""


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as torch's DataLoader counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_num_workers(num_workers: int | None, local_ranks: int) -> tuple[int, str]:
    """``--num_workers``, or by default AstrAI's 4 capped by the CPUs per local rank (more workers than CPUs only
    compete, and torch warns on every rank). Returns the number and how it was chosen, for the plan."""
    if num_workers is not None:
        return num_workers, f"{num_workers} worker process(es) per rank"
    cpus = available_cpus()
    chosen = min(ASTRAI_NUM_WORKERS, cpus // max(local_ranks, 1))
    return chosen, (
        f"{chosen} worker process(es) per rank (num_workers default: at most {ASTRAI_NUM_WORKERS}, {cpus} CPU(s) for "
        f"{local_ranks} local rank(s))"
    )


def planned_cpu_threads(num_threads: int | None, local_ranks: int) -> int:
    """torch's CPU threads per rank a run will have (see ``TrainArgs.num_threads``), for the dry run's plan."""
    if num_threads is not None:
        return num_threads
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    if local_ranks == 1:
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 1) // local_ranks)  # what Lightning's launcher sets for its ranks


def describe_cpu_threads(threads: int, given: bool) -> str:
    """The plan's line on CPU threads."""
    hint = (
        ""
        if given or threads == 1
        else " (--num_threads 1 can be several times faster for a small model on a busy machine)"
    )
    return f"{threads} per rank{hint}"


def local_ranks(fabric: Fabric) -> int:
    """Ranks on this machine (the ones sharing its CPUs)."""
    return max(1, fabric.world_size // getattr(fabric.strategy, "num_nodes", 1))


def precision_of(fabric: Fabric) -> str:
    """The precision the Fabric trains in (``32-true``, ``bf16-true``, ...)."""
    return str(fabric.strategy.precision.precision)


@dataclass(frozen=True)
class FabricArgs:
    """The flags ``build_fabric`` reads (``TrainArgs`` documents each; ``train.fabric_args`` takes them from it)."""

    parallel_mode: str
    device_type: str | None
    precision: str
    backend: str | None
    dist_timeout: float
    tp_size: int | None
    cp_size: int | None
    ep_size: int | None
    pp_size: int | None
    num_stages_per_rank: int
    """``--pp_stages_per_rank`` resolved for ``--pp_schedule`` (``TrainArgs.num_stages_per_rank``)."""
    fsdp_shard_size: int | None
    fsdp_reshard_after_forward: bool
    fsdp_param_dtype: str | None
    fsdp_reduce_dtype: str | None
    fsdp_cpu_offload: bool
    loggers: tuple[str, ...]
    """``--loggers``, writing under ``ckpt_dir`` (``loggers.build_loggers``)."""
    ckpt_dir: str
    logged_config: dict[str, Any]
    """The recipe's values, for the loggers that record a run's config (W&B)."""


def build_fabric(args: FabricArgs, topology: Topology) -> Fabric:
    """The Fabric ``args`` ask for over ``topology``'s ranks (not launched)."""
    accelerator = resolve_accelerator(args.device_type)
    world_size = topology.world_size
    if world_size == 1 and (args.tp_size or 1) > 1:
        raise ConfigError(f"tp_size {args.tp_size} needs at least {args.tp_size} processes (--nprocs)")
    layout = None
    if args.parallel_mode == "fsdp":
        layout = mesh_layout(world_size, args.tp_size, args.fsdp_shard_size, args.cp_size, args.ep_size, args.pp_size)
    if world_size == 1:
        strategy = "auto"
    elif args.parallel_mode == "none":
        raise ConfigError(
            f"parallel_mode none trains in one process, but {world_size} were requested (nprocs x num_nodes); "
            "use ddp or fsdp, or one process"
        )
    elif args.parallel_mode == "ddp":
        strategy = DDPStrategy(
            process_group_backend=args.backend,
            timeout=timedelta(seconds=args.dist_timeout),
            gradient_as_bucket_view=True,
            broadcast_buffers=False,
        )
    else:
        if args.fsdp_cpu_offload and accelerator == "cpu":
            raise ConfigError("fsdp_cpu_offload moves state from an accelerator to CPU memory; this run is on CPU")
        strategy = LayoutStrategy(
            layout,
            pp_stages_per_rank=args.num_stages_per_rank,
            reshard_after_forward=args.fsdp_reshard_after_forward,
            param_dtype=args.fsdp_param_dtype,
            reduce_dtype=args.fsdp_reduce_dtype,
            cpu_offload=args.fsdp_cpu_offload,
            process_group_backend=args.backend,
            timeout=timedelta(seconds=args.dist_timeout),
        )
    return Fabric(
        accelerator=accelerator,
        strategy=strategy,
        devices=topology.devices,
        num_nodes=topology.num_nodes,
        precision=resolve_precision(args.precision, accelerator),
        loggers=build_loggers(args.loggers, args.ckpt_dir, args.logged_config),
    )


def evaluation_fabric(nprocs: int, num_nodes: int, device_type: str | None) -> Fabric:
    """The ranks of ``astrai-fabric evaluate``: each holds the whole model and scores its share, so all they need is
    a process group (gloo on CPU, nccl on CUDA) and DDP's launcher; the model is never wrapped (nothing is trained)."""
    topology = resolve_topology(nprocs, num_nodes)
    accelerator = resolve_accelerator(device_type)
    backend = "nccl" if accelerator == "cuda" else "gloo"
    strategy = "auto" if topology.world_size == 1 else DDPStrategy(process_group_backend=backend)
    return Fabric(accelerator=accelerator, strategy=strategy, devices=topology.devices, num_nodes=topology.num_nodes)


def is_fsdp(fabric: Fabric) -> bool:
    """Whether the Fabric shards with FSDP2 (``ModelParallelStrategy``), whoever built it: the strategy decides,
    not ``parallel_mode``, which a Fabric handed to ``train`` ignores."""
    return isinstance(fabric.strategy, ModelParallelStrategy)


class LayoutStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` applying ``parallelize`` with one ``MeshLayout``, which it keeps: the layout is
    decided once, here, and read back from ``layout`` by everything after (the sampler, the loop, checkpoints, the
    checks of ``train(fabric, args)``). The CLI's ``--parallel_mode fsdp`` builds it; a program builds it for HSDP,
    context, expert or pipeline parallelism (a plain ``ModelParallelStrategy`` with a function of its own is plain
    FSDP and tensor parallelism as far as this package can know)."""

    def __init__(
        self,
        layout: MeshLayout,
        *,
        pp_stages_per_rank: int = 1,
        reshard_after_forward: bool = False,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        cpu_offload: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        self.layout = layout
        self.pp_stages_per_rank = pp_stages_per_rank if layout.pp > 1 else 1
        """Pipeline stages each pipeline rank holds (``--pp_stages_per_rank``); 1 without pipeline parallelism."""
        parallelize_fn = partial(
            parallelize,
            reshard_after_forward=reshard_after_forward,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            cpu_offload=cpu_offload,
            fsdp_shard_size=layout.shards,
            cp_size=layout.cp,
            ep_size=layout.ep,
            pp_size=layout.pp,
            pp_stages_per_rank=self.pp_stages_per_rank,
        )
        super().__init__(
            parallelize_fn,
            # explicit: Lightning's "auto" would put every rank on TP; its data axis holds stages and context too
            data_parallel_size=layout.pp * layout.num_dp_ranks * layout.cp,
            tensor_parallel_size=layout.tp,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )


def setup_frozen(fabric: Fabric, module: nn.Module) -> nn.Module:
    """A frozen module used next to the trained one (DPO/GRPO's reference model): sharded like it under FSDP, so
    memory does not double per rank; elsewhere moved and cast to the run's device and precision (DDP would refuse
    to wrap a module with nothing to train, and has nothing to synchronise)."""
    module = fabric.strategy.precision.convert_module(module.requires_grad_(False).eval())
    if is_fsdp(fabric):
        layout = layout_of(fabric)  # the trained model's, whole (a reference model is not split into stages)
        sizes = dict(fsdp_shard_size=layout.shards, cp_size=layout.cp, ep_size=layout.ep)
        return parallelize(module, fabric.strategy.device_mesh, reshard_after_forward=True, **sizes)
    return fabric.to_device(module)


def layout_of(fabric: Fabric) -> MeshLayout:
    """The layout a Fabric applies, whoever built it (``mesh.MeshLayout``): one process; a ``LayoutStrategy``'s
    own; under any other ``ModelParallelStrategy`` (a function of the user's own), plain FSDP over its data axis
    and its tensor size (launched: Lightning's sampler arguments say the data axis); DDP's (or any other
    strategy's) replicas of one shard each."""
    world_size, strategy = fabric.world_size, fabric.strategy
    if isinstance(strategy, LayoutStrategy):
        return strategy.layout
    if world_size == 1:
        return MeshLayout(replicas=1, shards=1)
    if not is_fsdp(fabric):
        return MeshLayout(replicas=world_size, shards=1)
    data_axis = strategy.distributed_sampler_kwargs["num_replicas"]
    return mesh_layout(world_size, world_size // data_axis)


def check_layout_flags(
    fabric: Fabric,
    fsdp_shard_size: int | None,
    cp_size: int | None,
    ep_size: int | None,
    pp_size: int | None,
    num_stages_per_rank: int = 1,
) -> None:
    """Refuse a layout flag other than what a Fabric built elsewhere applies (``train(fabric, args)``): its strategy
    decides the layout, as it decides ``parallel_mode``, and the flags also decide the plan and the checks, which
    would then describe another run. Known before launch: a ``LayoutStrategy`` says its layout; one process applies
    none; any other strategy applies no context, expert or pipeline parallelism, and shards as only it knows."""
    strategy = fabric.strategy
    layout = strategy.layout if isinstance(strategy, LayoutStrategy) else None
    if layout is None and fabric.world_size == 1:
        layout = MeshLayout(replicas=1, shards=1)
    if fsdp_shard_size is not None and (layout is None or layout.shards != fsdp_shard_size):
        raise ConfigError(
            f"fsdp_shard_size {fsdp_shard_size}: the Fabric given to train() decides the sharding, and its "
            f"{type(strategy).__name__} does not shard over {fsdp_shard_size} rank(s); build it with "
            "astrai_fabric.strategy.LayoutStrategy(mesh_layout(world_size, fsdp_shard_size="
            f"{fsdp_shard_size}), ...) or drop --fsdp_shard_size"
        )

    def build(name: str, value: int) -> str:
        return f"LayoutStrategy(mesh_layout(world_size, {name}={value}), ...)"

    flags = [
        ("cp_size", cp_size or 1, layout.cp if layout else 1, "context parallelism"),
        ("ep_size", ep_size or 1, layout.ep if layout else 1, "expert parallelism"),
        ("pp_size", pp_size or 1, layout.pp if layout else 1, "pipeline parallelism"),
    ]
    if (pp_size or 1) > 1:
        applied = getattr(strategy, "pp_stages_per_rank", 1)
        flags.append(("pp_stages_per_rank", num_stages_per_rank, applied, "the stages per pipeline rank"))
    for name, asked, applied, what in flags:
        if asked != applied:
            how = build(name, asked) if name != "pp_stages_per_rank" else f"LayoutStrategy(..., {name}={asked})"
            raise ConfigError(
                f"{name} {asked}: the Fabric given to train() decides {what}, and its {type(strategy).__name__} "
                f"applies {name} {applied}; build it with astrai_fabric.strategy.{how} or pass --{name} {applied}"
            )


def check_applied_layout(fabric: Fabric, model: nn.Module) -> None:
    """Refuse a model ``parallelize`` laid out otherwise than its Fabric says (``layout_of``): a plain
    ``ModelParallelStrategy`` given ``partial(parallelize, cp_size=2)`` would read other samples on each context
    rank than the model expects, silently. ``parallelize`` leaves its layout on the model (``APPLIED_LAYOUT``)."""
    applied = getattr(model, APPLIED_LAYOUT, None)
    if applied is not None and applied != (said := layout_of(fabric)):
        raise ConfigError(
            f"the Fabric's parallelize_fn lays the model out as {applied.describe()}, but its "
            f"{type(fabric.strategy).__name__} says {said.describe()}: build it with "
            "astrai_fabric.strategy.LayoutStrategy(layout, ...), which applies the layout it says"
        )


class DataParallel(NamedTuple):
    """This rank's place on the data axis: the ranks of one tensor-parallel or context group train on the same
    samples."""

    dp_rank: int
    """This rank's index among the data-parallel ranks."""
    num_dp_ranks: int
    """Data-parallel ranks: the ones that consume different samples (the world size over ``tp_size`` x
    ``cp_size``)."""


def data_parallel(fabric: Fabric, layout: MeshLayout | None = None) -> DataParallel:
    """Where this rank sits on the data axis (``DataParallel``), from the Fabric's layout (``layout``, where the
    caller read it already: ``MeshLayout.dp_rank``: the ranks of one context, tensor or pipeline group read the same
    samples)."""
    layout = layout or layout_of(fabric)
    return DataParallel(layout.dp_rank(fabric.global_rank), layout.num_dp_ranks)


def set_cpu_threads(num_threads: int | None) -> None:
    """``--num_threads`` for this process and, through ``OMP_NUM_THREADS``, for the ranks it launches (Lightning's
    launcher then keeps it). Only the command line does this (``train.execute``): importing the package changes no
    setting."""
    if num_threads is None:
        return
    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
