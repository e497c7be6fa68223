"""Building blocks with AstrAI's parameter names, shapes and initialisation (AstrAI's ``astrai/model/components``).

Every module with weights has ``reset_parameters`` so a model built on the meta device can be materialised
(Fabric calls it per module); the order in which ``AutoRegressiveLM`` calls them consumes the random stream exactly
as AstrAI's constructor does, so the same seed gives the same initial weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


class Linear(nn.Linear):
    """``y = x W^T (+ b)`` with ``W ~ N(0, init_std)``: AstrAI's own Linear (no bias by default).

    An ``nn.Linear`` (tensor parallelism's styles accept only those) that, like AstrAI's, draws no random numbers
    when constructed: ``nn.Linear.__init__`` is skipped, so initialisation happens once, in ``reset_parameters``
    called by the model, and consumes the random stream exactly as AstrAI's does.
    """

    def __init__(self, in_dim: int, out_dim: int, bias: bool = False, init_std: float = 0.02) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.init_std = in_dim, out_dim, init_std
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim))
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.weight.shape[1])
            nn.init.uniform_(self.bias, -bound, bound)


class Embedding(nn.Module):
    """Token embedding, ``N(0, 0.02)``, with AstrAI's NEFTune: Gaussian noise ``alpha / sqrt(seq_len)``.

    AstrAI departs from the NEFTune paper (uniform noise scaled by ``alpha / sqrt(seq_len * hidden)``); we keep
    AstrAI's form so a recipe means the same thing in both trainers. The noise comes from ``generator``, which the
    trainer sets and reseeds from the run's position (``astrai_fabric.randomness``); None draws from the global RNG.
    ``scaled`` multiplies the embeddings by ``sqrt(hidden_size)`` first (Gemma).
    """

    generator: torch.Generator | None = None

    def __init__(self, vocab_size: int, hidden_size: int, neftune_alpha: float = 0.0, scaled: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.neftune_alpha = neftune_alpha
        # Gemma multiplies by sqrt(hidden_size) made a float32 tensor, then cast to the weight's dtype
        # (transformers' Gemma2TextScaledWordEmbedding); 1 leaves the embeddings exactly as they are.
        self.scale = hidden_size**0.5 if scaled else 1.0

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: Tensor) -> Tensor:
        out = F.embedding(input_ids, self.weight)
        if self.scale != 1.0:
            out = out * torch.tensor(self.scale, dtype=torch.float32).to(out.dtype)
        if self.training and self.neftune_alpha > 0:
            noise = torch.randn(out.shape, generator=self.generator, device=out.device, dtype=out.dtype)
            out = out + (self.neftune_alpha / math.sqrt(out.size(1))) * noise
        return out


class RMSNorm(nn.Module):
    """``x / rms(x) * w`` with ``w`` starting at ones (AstrAI's); with ``unit_offset``, ``x / rms(x) * (1 + w)`` with
    ``w`` starting at zeros (Gemma's ``Gemma2RMSNorm``)."""

    def __init__(self, dim: int, eps: float | None, unit_offset: bool = False) -> None:
        super().__init__()
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        if self.unit_offset:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        scale = 1 + self.weight if self.unit_offset else self.weight
        return F.rms_norm(x, self.weight.shape, scale, self.eps)


def rope_table(
    dim: int, max_len: int, base: float, frequency_scaling: dict | None = None, length: int | None = None
) -> Tensor:
    """``[max_len, dim/2, 2]`` float32 table of (cos, sin); angles computed in float64 as AstrAI does.

    ``frequency_scaling`` is a config's ``rope_frequency_scaling`` (Hugging Face's ``linear``, ``llama3``, ``yarn``,
    ``longrope`` or ``dynamic``); yarn and longrope also scale cos and sin by their ``rope_attention_factor``, as
    transformers does. ``length`` is the longest position + 1 of the forward pass the table serves, which the
    length-dependent kinds read (``length_dependent``); None means a forward no longer than the original length.
    """
    kind = frequency_scaling["rope_type"] if frequency_scaling is not None else None
    past_original = length_dependent(frequency_scaling) and length is not None
    past_original = past_original and length > frequency_scaling["original_max_position_embeddings"]
    if kind == "dynamic" and past_original:
        base = dynamic_ntk_base(base, dim, frequency_scaling, length)
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if kind == "yarn":
        inv_freq = yarn_frequencies(inv_freq, frequency_scaling, base)
    elif kind == "longrope":
        factors = frequency_scaling["long_factor" if past_original else "short_factor"]
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    elif kind in ("linear", "llama3"):
        inv_freq = scale_frequencies(inv_freq, frequency_scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq).float()
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    attention_factor = rope_attention_factor(frequency_scaling)
    return table if attention_factor == 1.0 else table * attention_factor


def length_dependent(scaling: dict | None) -> bool:
    """Whether a scaling's frequencies depend on the forward pass's length (transformers' ``dynamic_rope_update``):
    ``longrope`` switches from its short to its long factors, ``dynamic`` raises its base, once the longest position
    + 1 exceeds ``original_max_position_embeddings``."""
    return scaling is not None and scaling["rope_type"] in ("longrope", "dynamic")


def dynamic_ntk_base(base: float, dim: int, scaling: dict, length: int) -> float:
    """Dynamic NTK's base for a forward of ``length`` > the original length ``L`` (the facts of transformers'
    ``_compute_dynamic_ntk_parameters``): ``base * (factor * length / L - (factor - 1)) ** (dim / (dim - 2))``,
    which is ``base`` at ``length = L`` and grows with the length (bloc97 and emozilla's "dynamically scaled NTK")."""
    factor, original_len = scaling["factor"], scaling["original_max_position_embeddings"]
    return base * (factor * length / original_len - (factor - 1)) ** (dim / (dim - 2))


def yarn_frequencies(inv_freq: Tensor, scaling: dict, base: float) -> Tensor:
    """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023, arXiv:2309.00071, section 3.2), with the facts of
    transformers' ``_compute_yarn_parameters``: pair ``i`` keeps its frequency where it turns more than ``beta_fast``
    times over ``original_max_position_embeddings``, is divided by ``factor`` where it turns fewer than
    ``beta_slow`` times, and blends linearly in ``i`` between. With ``truncate`` (the default) the blend's ends are
    rounded outwards to whole pairs; both are clipped to ``[0, dim - 1]``."""
    dim = 2 * inv_freq.numel()
    original_len = scaling["original_max_position_embeddings"]

    def pair_turning(rotations: float) -> float:
        """The (fractional) pair index whose frequency turns ``rotations`` times over the original length."""
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(scaling["beta_fast"]), pair_turning(scaling["beta_slow"])
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a ramp of zero width
    interpolated = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling["factor"] * interpolated + inv_freq * (1 - interpolated)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``sqrt(1/t) = 0.1 ln(factor) + 1`` (arXiv:2309.00071, eq. 22), the log scaled by
    ``mscale`` (DeepSeek's generalisation); 1 for ``factor <= 1``."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What a ``yarn`` or ``longrope`` scaling multiplies cos and sin by (so every rotated q.k product by its
    square), as transformers computes it: ``attention_factor`` when given; else, for yarn, ``yarn_mscale(factor,
    mscale) / yarn_mscale(factor, mscale_all_dim)`` when both are set (and not 0), else ``yarn_mscale(factor)``; for
    longrope, ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 for ``factor <= 1``; LongRoPE,
    Ding et al. 2024, arXiv:2402.13753, as Phi-3 uses it); 1 for the other kinds."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if scaling["rope_type"] == "longrope":
        original_len = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_len))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def scale_frequencies(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Hugging Face's frequency scaling, by ``rope_type`` (transformers' ``modeling_rope_utils.py``).

    ``linear`` (position interpolation, Chen et al. 2023, arXiv:2306.15595): every frequency divided by ``factor``.
    ``llama3`` (Meta's Llama 3.1 ``apply_scaling``): wavelengths longer than ``original / low_freq_factor`` are
    divided by ``factor``, those shorter than ``original / high_freq_factor`` kept, and in between a linear blend
    in ``original / wavelength``. Neither rescales the attention (its ``attention_factor`` is 1).
    """
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= original_len / low) & (wavelen >= original_len / high)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Looks up (cos, sin) for position ids; NTK ``rope_scaling`` raises the base as AstrAI does, and Hugging Face's
    ``frequency_scaling`` (``rope_table``) rescales the frequencies, per forward length for longrope and dynamic.

    The table is a non-persistent buffer (never in a ``state_dict``). Departure from AstrAI: it stays float32 when
    the model is cast to bf16 (AstrAI's ``.to(bfloat16)`` quantises cos/sin too, an error of up to ~4e-3).
    """

    def __init__(
        self,
        dim: int,
        max_len: int,
        base: float = 10000.0,
        rope_scaling: dict | None = None,
        frequency_scaling: dict | None = None,
    ) -> None:
        super().__init__()
        self.dim, self.max_len = dim, max_len
        self.base, self.frequency_scaling = base, frequency_scaling
        if rope_scaling is not None and rope_scaling.get("type", "ntk") == "ntk":
            # AstrAI treats any dict without "type" (e.g. HF's {"rope_type": ...}) as NTK and ignores other types.
            self.base = base * rope_scaling.get("factor", 1.0) ** (dim / (dim - 2))
        # A length-dependent scaling (``length_dependent``) switches at the original length: forwards up to it
        # read the table built here; longer ones longrope's second table, or dynamic NTK's built for their length.
        self.switch_length = None
        if length_dependent(frequency_scaling):
            self.switch_length = frequency_scaling["original_max_position_embeddings"]
        self.register_buffer("freqs_cis", self._table(), persistent=False)
        self.register_buffer("freqs_cis_long", self._long_table(), persistent=False)

    def _table(self) -> Tensor:
        return rope_table(self.dim, self.max_len, self.base, self.frequency_scaling)

    def _long_table(self) -> Tensor | None:
        """longrope's table for forwards longer than the original length (its long factors), else None."""
        if self.switch_length is None or self.frequency_scaling["rope_type"] != "longrope":
            return None
        return rope_table(self.dim, self.max_len, self.base, self.frequency_scaling, length=self.switch_length + 1)

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """Recompute the tables (after ``to_empty``, or on ``device`` for a model built on the meta device)."""
        device = device or self.freqs_cis.device
        self.freqs_cis = self._table().to(device)
        if self.freqs_cis_long is not None:
            self.freqs_cis_long = self._long_table().to(device)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        super()._apply(fn, recurse)
        if self.freqs_cis.dtype != torch.float32 and not self.freqs_cis.is_meta:
            self.reset_parameters()
        return self

    def forward(self, batch_size: int, seq_len: int, position_ids: Tensor | None = None) -> Tensor:
        """The rotation factors ``[batch, seq, dim/2]`` complex64 (``rope_factors``); ``position_ids=None`` means
        ``0..seq_len-1`` for every row.

        Under a length-dependent scaling the frequencies are those of this forward's length, its largest position
        + 1 over the batch, as transformers' ``dynamic_rope_update`` takes it (read on the host: one sync)."""
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=self.freqs_cis.device).expand(batch_size, -1)
        table = self.freqs_cis
        if self.switch_length is not None:
            length = int(position_ids.max()) + 1
            if length > self.switch_length and self.freqs_cis_long is not None:
                table = self.freqs_cis_long
            elif length > self.switch_length:  # dynamic NTK: its base depends on the very length
                table = rope_table(self.dim, length, self.base, self.frequency_scaling, length).to(table.device)
        return rope_factors(table[position_ids].float())


def rope_factors(table: Tensor) -> Tensor:
    """(cos, sin) pairs ``[..., dim/2, 2]`` float32 as the factors ``apply_rotary_emb`` multiplies by, ``cos + i sin``
    ``[..., dim/2]`` complex64 (AstrAI's ``torch.complex(cos, sin)``, the same numbers). Made once per forward
    (``RotaryEmbedding``) and shared by every layer. Complex, they are no floating-point tensor to FSDP's mixed
    precision, which casts a block's floating-point inputs: they stay float32, as AstrAI keeps them."""
    return torch.view_as_complex(table.float().contiguous())


def apply_rotary_emb(x: Tensor, rotary: Tensor) -> Tensor:
    """Rotate adjacent pairs ``(2i, 2i+1)`` of ``x [batch, seq, heads, dim]`` (interleaved, GPT-J/Meta style) by the
    factors ``rotary [batch, seq, dim/2]`` (``rope_factors``), in float32, the result in ``x``'s dtype.

    AstrAI's rotation exactly: each pair a complex number times its factor, one complex product over ``x`` (its
    backward another), where the same product in real arithmetic took three passes and a copy (measured 3x faster
    forward and backward on CPU: docs/performance.md). It is not Hugging Face's ``rotate_half``.
    """
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())  # a slice's pairs: a copy
    return torch.view_as_real(pairs * rotary.unsqueeze(-2)).flatten(-2).to(x.dtype)
