"""The settings of a compiled training step, declared once.

``compile_train_step``'s keywords (and ``lower_train_step``'s) build a :class:`StepSettings`;
the compiled step, the lowering and the program read it. Bad values fail here, when the
settings are made, with a one-line ``ValueError`` naming the setting.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tpu_train.compile.cache import DEFAULT_WARN_AFTER
from tpu_train.compile.loss_graph import AUTODIFF_CHOICES

__all__ = ["StepSettings", "check_autocast_dtype"]

_COMPUTE_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32)


def check_autocast_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast_dtype must be torch.bfloat16 or torch.float16, got {dtype}")


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """How one training step is computed and compiled (see ``compile_train_step`` for each).

    ``mesh`` and ``plan``: a ``tpu_train.parallel`` mesh and sharding plan (both or neither)
    make the step one SPMD program over the mesh. ``warn_after``: the compile count past which
    the step's compile cache warns.
    """

    max_grad_norm: float | None = None
    grad_accum_steps: int = 1
    donate: bool = True
    warn_after: int = DEFAULT_WARN_AFTER
    mesh: Any = None
    plan: Any = None
    autocast_dtype: torch.dtype | None = None
    skip_non_finite: bool = False
    scan_layers: bool | None = None
    autodiff: str = "jax"
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.autodiff not in AUTODIFF_CHOICES:
            raise ValueError(f"autodiff must be one of {', '.join(map(repr, AUTODIFF_CHOICES))}, "
                             f"got {self.autodiff!r}")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {self.grad_accum_steps}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError("compute_dtype must be torch.bfloat16, torch.float16, torch.float32 "
                             f"or None, got {self.compute_dtype}")
        check_autocast_dtype(self.autocast_dtype)
        norm = self.max_grad_norm
        normal = {"max_grad_norm": None if norm is None else float(norm),
                  "grad_accum_steps": int(self.grad_accum_steps), "donate": bool(self.donate),
                  "skip_non_finite": bool(self.skip_non_finite),
                  "scan_layers": None if self.scan_layers is None else bool(self.scan_layers)}
        for name, value in normal.items():
            object.__setattr__(self, name, value)  # frozen: the normal forms, set once here
