"""LoRA: low-rank adapters wrapped around ``nn.Linear`` modules, without editing model code,
and frozen base weights stored in int8.

``LoRALinear`` keeps the wrapped layer's ``weight`` (and ``bias``) under the same names, so a
wrapped model's state dict is the original one plus ``lora_a``/``lora_b`` entries: Hugging Face
weights load into it unchanged, and :func:`merge_lora` gives back a plain model for export.

An int8 base (:func:`quantize_frozen_linears`) replaces every frozen linear weight by int8
values ``q`` and one float32 scale per output channel ``s`` (symmetric absmax:
``s = max_j |w_ij| / 127``, ``q = round(w / s)``), stored as ``weight`` and ``weight_scale``.
The matmul reads ``q`` converted to the activations' dtype times ``s``
(:func:`dequantized_linear`): XLA fuses the conversion into the dot, so the dequantized matrix
is never stored, and the weight takes 1 byte per value instead of 2 or 4. Each weight is off by
at most half a step, ``s_i / 2``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# int8's symmetric range: -127..127 (-128 is left out so that the scale maps absmax exactly).
INT8_MAX = 127


# The most values quantized at once (64 MiB of float32 per temporary): a vocabulary-sized
# output head is quantized in row blocks, not converted to float32 whole.
QUANTIZE_PIECE_ELEMENTS = 2**24


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``weight`` ``[out, in]`` as int8 with one float32 scale per output row,
    ``weight ~= q * scale[:, None]`` within ``scale / 2`` per value. A row of zeros gets scale
    1 (its values stay exactly zero). Rows are independent, so a large weight is quantized a
    block of rows at a time (the same values)."""
    rows = max(1, QUANTIZE_PIECE_ELEMENTS // max(1, weight.shape[1]))
    if weight.shape[0] <= rows:
        return _quantize_block(weight)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows):
        q[start:start + rows], scale[start:start + rows] = _quantize_block(
            weight[start:start + rows])
    return q, scale


def _quantize_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias``; the weight converted to ``x``'s dtype."""
    if scale is None:
        return F.linear(x, weight, bias)
    dequantized = weight.to(x.dtype) * scale.to(x.dtype)[:, None]
    return F.linear(x, dequantized, bias)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _dequantized_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return weight
    return weight.to(scale.dtype) * scale[:, None]


class Int8Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored in int8 with per-output-channel scales."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        q, scale = quantize_rows(base.weight)
        self.weight = _frozen(q)
        self.weight_scale = _frozen(scale)
        self.bias = None if base.bias is None else _frozen(base.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dequantized_linear(x, self.weight, self.weight_scale, self.bias)

    def dequantized(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the dequantized weight (in the scale's dtype)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.weight.device, dtype=self.weight_scale.dtype)
        with torch.no_grad():
            linear.weight.copy_(_dequantized_weight(self.weight, self.weight_scale))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class LoRALinear(nn.Module):
    """``y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T`` with ``W`` frozen (in int8
    after :meth:`quantize_base`).

    ``B`` starts at zero, so a freshly wrapped model computes exactly what it did before.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.weight_scale: nn.Parameter | None = None
        self.rank = rank
        self.scaling = alpha / rank
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_b = nn.Parameter(torch.empty(self.out_features, rank, **factory))
        self.reset_parameters()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def reset_parameters(self) -> None:
        """The adapters' initial values (``A`` Kaiming-uniform from torch's global generator,
        ``B`` zero), as at construction: what a layer wrapped on the ``meta`` device is given
        once it is materialized (:func:`tpu_train.models.streaming.materialize_quantized`)."""
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        with torch.no_grad():
            self.lora_b.zero_()

    def quantize_base(self) -> None:
        """Store the frozen weight in int8 with per-output-channel scales (once)."""
        if self.weight_scale is not None:
            return
        q, scale = quantize_rows(self.weight)
        self.weight = _frozen(q)
        self.weight_scale = _frozen(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = dequantized_linear(x, self.weight, self.weight_scale, self.bias)
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)
        return base + self.scaling * update

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` equal to this layer in eval mode (in the adapters' dtype)."""
        dtype = self.lora_a.dtype
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.lora_a.device, dtype=dtype)
        with torch.no_grad():
            delta = (self.lora_b.float() @ self.lora_a.float()) * self.scaling
            weight = _dequantized_weight(self.weight, self.weight_scale).float()
            linear.weight.copy_((weight + delta).to(dtype))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


def apply_lora(model: nn.Module, targets: Sequence[str], rank: int, alpha: float,
               dropout: float = 0.0) -> list[str]:
    """Freeze ``model`` and wrap every ``nn.Linear`` whose attribute name is in ``targets``.

    Returns the qualified names of the wrapped modules; raises ``ValueError`` naming the
    available linear layer names when a target matches nothing.
    """
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    wrapped: list[str] = []
    matched: set[str] = set()
    linear_names: set[str] = set()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            linear_names.add(child_name)
            if child_name in targets:
                setattr(parent, child_name, LoRALinear(child, rank, alpha, dropout))
                wrapped.append(f"{parent_name}.{child_name}" if parent_name else child_name)
                matched.add(child_name)
    missing = sorted(set(targets) - matched)
    if missing:
        raise ValueError(
            f"LoRA targets {missing} match no nn.Linear in the model; linear layer names are: "
            f"{', '.join(sorted(linear_names))}"
        )
    return wrapped


def quantize_frozen_linears(model: nn.Module) -> list[str]:
    """Store every frozen linear weight of ``model`` in int8 (in place): the bases of its
    :class:`LoRALinear` layers, and each ``nn.Linear`` whose weight does not train (replaced
    by an :class:`Int8Linear`). One weight at a time, so the float copy of only one is ever
    added. Returns the qualified names of the quantized modules."""
    quantized: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, LoRALinear):
                child.quantize_base()
            elif isinstance(child, nn.Linear) and not child.weight.requires_grad:
                setattr(parent, child_name, Int8Linear(child))
            else:
                continue
            quantized.append(name)
    return quantized


def store_frozen_floats(model: nn.Module, dtype: torch.dtype) -> None:
    """Store the frozen floating parameters of ``model`` other than the int8 weights' scales
    (embeddings, norms) in ``dtype``: under bfloat16 compute, a frozen float32 embedding would
    keep the residual stream, and every matmul after it, in float32."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad or not param.is_floating_point() or name == "weight_scale":
                continue
            if param.dtype != dtype:
                setattr(module, name, _frozen(param.detach().to(dtype)))


def has_int8_base(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) or (isinstance(m, LoRALinear)
                                             and m.weight_scale is not None)
               for m in model.modules())


def adapters_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``state`` (``model``'s state dict) that train: what a checkpoint of a
    run with a frozen base keeps (the base is rebuilt from its source on resume)."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {key: value for key, value in state.items() if key in trainable}


def load_adapters_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load :func:`adapters_state`'s entries into ``model``; RuntimeError naming a trainable
    parameter that ``state`` lacks, or an entry ``model`` does not train."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(trainable - set(state)), sorted(set(state) - trainable)
    if missing or unexpected:
        raise RuntimeError(
            f"the checkpoint's adapters do not match the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}")
    model.load_state_dict(state, strict=False)


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` in ``model`` by its merged ``nn.Linear`` and every
    :class:`Int8Linear` by its dequantized one (in place)."""
    for _, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, child_name, child.merged())
            elif isinstance(child, Int8Linear):
                setattr(parent, child_name, child.dequantized())
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model
