"""LoRA: low-rank adapters wrapped around ``nn.Linear`` modules, without editing model code.

``LoRALinear`` keeps the wrapped layer's ``weight`` (and ``bias``) under the same names, so a
wrapped model's state dict is the original one plus ``lora_a``/``lora_b`` entries: Hugging Face
weights load into it unchanged, and :func:`merge_lora` gives back a plain model for export.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn


class LoRALinear(nn.Module):
    """``y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T`` with ``W`` frozen.

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
        self.rank = rank
        self.scaling = alpha / rank
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = nn.functional.linear(x, self.weight, self.bias)
        update = nn.functional.linear(nn.functional.linear(self.dropout(x), self.lora_a),
                                      self.lora_b)
        return base + self.scaling * update

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` equal to this layer in eval mode."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            delta = (self.lora_b.float() @ self.lora_a.float()) * self.scaling
            linear.weight.copy_((self.weight.float() + delta).to(self.weight.dtype))
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


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` in ``model`` by its merged ``nn.Linear`` (in place)."""
    for _, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, child_name, child.merged())
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model

