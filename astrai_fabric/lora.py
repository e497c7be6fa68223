"""LoRA (Hu et al. 2021, arXiv:2106.09685): low-rank adapters on the model's linear layers, applied from outside the
model definition (like ``parallelize``), so ``model/`` stays plain.

A target layer ``y = x W^T + b`` becomes ``y = x W^T + b + (dropout(x) A^T B^T) * alpha / r`` with ``A [r, in]`` and
``B [out, r]``; ``W`` and ``b`` are frozen (``requires_grad`` False) and only ``A`` and ``B`` train. The adapter's
parameters sit on the layer itself, so the model's ``state_dict`` names them ``<layer>.lora_A`` / ``<layer>.lora_B``
exactly as AstrAI's ``astrai/model/components/lora.py`` does, and the base weights keep their names.

Targets are chosen by the layer's attribute name, AstrAI's rule: every linear layer called one of ``TARGETS``
(``gate`` therefore also takes a gated attention's gate and each MoE expert's gate, as in AstrAI); the MoE router is
never adapted. Departures from AstrAI:

- the adapters stay float32 whatever the base's precision (``bf16-true`` casts the base only), the usual choice
  for LoRA: updates of size ``lr * A`` vanish in bfloat16; AstrAI creates them in the weight's dtype;
- ``A`` is drawn from a generator seeded by ``(random_seed, layer name)``, so it does not depend on the device, the
  world size or the global RNG (AstrAI draws from the global RNG);
- dropout on the adapter's input (``--lora_dropout``, PEFT's placement) draws from the layer's own generator, which
  the loop reseeds per micro-batch (``randomness.ModuleNoise``): a resumed run drops what the uninterrupted one did.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai_fabric.config.lora import DEFAULT_TARGETS, TARGETS, check_scaling
from astrai_fabric.errors import CheckpointError, ConfigError
from astrai_fabric.model.layers import Linear
from astrai_fabric.quantize import dequantized
from astrai_fabric.randomness import derive_seed

INITS = ("astrai", "kaiming")
ADAPTER_KEYS = ("lora_A", "lora_B")
ADAPTER_DTYPE = torch.float32


@dataclass(frozen=True)
class LoRASpec:
    """The adapter's shape and training options (``adapter_config.json`` holds AstrAI's three, plus ours)."""

    r: int
    alpha: int = 32
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0
    init: str = "astrai"

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def adapter_config(self) -> dict[str, Any]:
        """AstrAI's ``LoRAConfig`` fields (``r``, ``alpha``, ``target_modules``) and our ``lora_dropout``, ``init``
        (AstrAI's ``load_lora`` reads only its own)."""
        return {
            "r": self.r,
            "alpha": self.alpha,
            "target_modules": list(self.targets),
            "lora_dropout": self.dropout,
            "init": self.init,
        }

    @classmethod
    def from_adapter_config(cls, raw: Any, source: str) -> LoRASpec:
        """An ``adapter_config.json`` (ours or AstrAI's ``save_lora``), checked field by field."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        problems = []
        r, alpha, targets = raw.get("r"), raw.get("alpha"), raw.get("target_modules")
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            problems.append(f"'r' must be a positive integer, got {r!r}")
        if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not alpha > 0:
            problems.append(f"'alpha' must be a positive number, got {alpha!r}")
        elif isinstance(r, int) and r >= 1 and (scaling_problem := check_scaling(alpha, r, "'alpha' / 'r'")):
            problems.append(scaling_problem)
        if not isinstance(targets, list) or not targets or any(t not in TARGETS for t in targets):
            problems.append(f"'target_modules' must be a non-empty list of {list(TARGETS)}, got {targets!r}")
        dropout, init = raw.get("lora_dropout", 0.0), raw.get("init", "astrai")
        if not isinstance(dropout, int | float) or isinstance(dropout, bool) or not 0 <= dropout < 1:
            problems.append(f"'lora_dropout' must be in [0, 1), got {dropout!r}")
        if init not in INITS:
            problems.append(f"'init' must be one of {list(INITS)}, got {init!r}")
        if problems:
            raise CheckpointError(f"{source}: " + "; ".join(problems))
        return cls(r, alpha, tuple(targets), float(dropout), init)


class LoRALinear(Linear):
    """A frozen ``Linear`` (the same weight and bias Parameters, not copies) plus its trainable adapter.

    ``adapter_enabled`` False computes the base layer alone (``adapters_off``). ``generator`` is the dropout's
    noise source (see ``randomness``). The base weight may be NF4 (QLoRA, ``quantize.py``).
    """

    generator: torch.Generator | None = None

    def __init__(self, base: Linear, spec: LoRASpec, seed: int, name: str) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.init_std = getattr(base, "init_std", 0.02)
        self.weight = base.weight.requires_grad_(False)
        self.bias = base.bias.requires_grad_(False) if base.bias is not None else None
        self.r, self.scaling, self.dropout = spec.r, spec.scaling, spec.dropout
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(spec.r, self.in_features, device=device, dtype=ADAPTER_DTYPE))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, spec.r, device=device, dtype=ADAPTER_DTYPE))
        self.adapter_enabled = True
        if device.type != "meta":
            self.reset_adapter(spec.init, seed, name)

    @torch.no_grad()
    def reset_adapter(self, init: str, seed: int, name: str) -> None:
        for part, value in self.initial_adapter(init, seed, name).items():
            getattr(self, part).copy_(value)

    def initial_adapter(self, init: str, seed: int, name: str) -> dict[str, Tensor]:
        """The adapter a run starts from, on the CPU, whatever device the layer is on: ``B = 0``, so training
        starts at the base model; ``A`` is AstrAI's ``randn / r`` or PEFT's default, ``kaiming_uniform_(a=sqrt(5))``,
        which is ``U(-1/sqrt(in), 1/sqrt(in))``, drawn from a generator of (seed, layer name)."""
        generator = torch.Generator().manual_seed(derive_seed(seed, f"lora:{name}"))
        shape = (self.r, self.in_features)
        if init == "astrai":
            lora_a = torch.randn(shape, generator=generator) / self.r
        else:
            bound = 1 / math.sqrt(self.in_features)
            lora_a = torch.empty(shape).uniform_(-bound, bound, generator=generator)
        return {
            "lora_A": lora_a.to(ADAPTER_DTYPE),
            "lora_B": torch.zeros(self.out_features, self.r, dtype=ADAPTER_DTYPE),
        }

    def reset_parameters(self) -> None:
        """Only the base layer: a model materialised from the meta device gets its adapters from the file."""
        super().reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        h = x.to(self.lora_A.dtype)
        if self.training and self.dropout > 0:
            h = self._dropout(h)
        return out + (F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling).to(out.dtype)

    def _dropout(self, h: Tensor) -> Tensor:
        if self.generator is None:
            return F.dropout(h, self.dropout, training=True)
        # Back to the start of this micro-batch's stream before every draw: the forward that gradient checkpointing
        # recomputes (which restores only the global RNG) then drops the same entries as the first one did.
        self.generator.manual_seed(self.generator.initial_seed())
        keep = torch.empty_like(h).bernoulli_(1 - self.dropout, generator=self.generator)
        return h * keep / (1 - self.dropout)

    def merged_weight(self) -> Tensor:
        """``W + (B A) * alpha / r``, computed in float32 and returned in ``W``'s dtype."""
        return merge_weight(self.weight.detach(), self.lora_A.detach(), self.lora_B.detach(), self.scaling)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        # A precision's `module.to(bfloat16)` casts the base only: the adapters stay float32 (module docstring).
        super()._apply(fn, recurse)
        for name in ADAPTER_KEYS:
            param = getattr(self, name)
            if param.dtype != ADAPTER_DTYPE and not param.is_meta:
                param.data = param.data.to(ADAPTER_DTYPE)
        return self


def merge_weight(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """``W + (B A) * scaling`` in float32, cast back to ``W``'s dtype (an NF4 ``W``: dequantised first)."""
    return (dequantized(weight).float() + (lora_b.float() @ lora_a.float()) * scaling).to(weight.dtype)


def inject(model: nn.Module, spec: LoRASpec, seed: int) -> list[str]:
    """Replace every target linear layer of ``model`` by a ``LoRALinear`` and freeze everything else; return the
    adapted layers' names. A target that names no layer of this model is a ``ConfigError`` (AstrAI only warns)."""
    model.requires_grad_(False)
    chosen = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and not isinstance(module, LoRALinear) and name.rpartition(".")[2] in spec.targets
    ]
    found = {name.rpartition(".")[2] for name, _ in chosen}
    if absent := [t for t in spec.targets if t not in found]:
        present = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, Linear)} & set(TARGETS)
        raise ConfigError(f"lora_targets {absent}: this model has no such linear layer (it has {sorted(present)})")
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module, spec, seed, name))
    return [name for name, _ in chosen]


def initial_adapter_state(model: nn.Module, spec: LoRASpec, seed: int) -> dict[str, Tensor]:
    """Every layer's starting adapter under AstrAI's keys, full size on the CPU: what a model injected on the meta
    device (FSDP) is filled with once sharded, so every world size starts from the same adapter."""
    return {
        f"{name}.{part}": value
        for name, layer in lora_layers(model)
        for part, value in layer.initial_adapter(spec.init, seed, name).items()
    }


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def is_adapter_key(key: str) -> bool:
    return key.rpartition(".")[2] in ADAPTER_KEYS


def adapter_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter entries of a model's ``state_dict`` (AstrAI's keys ``<layer>.lora_A`` / ``<layer>.lora_B``)."""
    return {k: v for k, v in state_dict.items() if is_adapter_key(k)}


def base_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state_dict.items() if not is_adapter_key(k)}


def load_adapter(model: nn.Module, adapter: Mapping[str, Tensor], source: str) -> None:
    """Copy adapter tensors into an injected model; the keys and shapes must match exactly."""
    expected = adapter_state_dict(model.state_dict())
    missing, unexpected = sorted(set(expected) - set(adapter)), sorted(set(adapter) - set(expected))
    wrong = [k for k in expected if k in adapter and tuple(adapter[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or wrong:
        detail = [
            f"{label} {keys[:4]}"
            for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shapes", wrong))
            if keys
        ]
        raise CheckpointError(f"{source}: does not fit this model's adapters: " + "; ".join(detail))
    layers = dict(lora_layers(model))
    with torch.no_grad():
        for key, value in adapter.items():
            layer, _, part = key.rpartition(".")
            getattr(layers[layer], part).copy_(value)


def merge_state_dict(state_dict: Mapping[str, Tensor], adapter: Mapping[str, Tensor], scaling: float) -> dict:
    """A base ``state_dict`` with an adapter merged in (``W + B A * scaling``); adapter keys must name base layers."""
    merged = dict(state_dict)
    for key in adapter:
        if key.endswith(".lora_A"):
            layer = key[: -len(".lora_A")]
            if f"{layer}.weight" not in merged or f"{layer}.lora_B" not in adapter:
                raise CheckpointError(f"adapter key {key}: no base weight {layer}.weight or no {layer}.lora_B")
            merged[f"{layer}.weight"] = merge_weight(
                merged[f"{layer}.weight"], adapter[key], adapter[f"{layer}.lora_B"], scaling
            )
    return merged


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, in place: ``LoRALinear`` layers become plain ``Linear`` again."""
    for name, layer in lora_layers(model):
        plain = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, init_std=layer.init_std)
        plain.weight = nn.Parameter(layer.merged_weight(), requires_grad=False)
        plain.bias = layer.bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
    return model


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: adapters switched off and eval mode (no dropout, no NEFTune) for the block, then restored.

    DPO's and GRPO's reference with LoRA: the network being trained, without a second copy in memory.
    """
    layers = [m for _, m in lora_layers(model)]
    was_training = model.training
    model.eval()
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_enabled = True
        model.train(was_training)


def reference_context(model: nn.Module, reference: nn.Module | None) -> AbstractContextManager:
    """How DPO/GRPO run their reference: a separate model as it is, or (None) ``model`` with its adapters off."""
    return nullcontext() if reference is not None else adapters_off(model)
