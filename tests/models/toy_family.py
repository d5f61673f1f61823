"""A model family defined outside the package, through the public seam only: a small
language model of residual MLP blocks (no attention), for the tests that the trainer, the
parallel plans and the planner ask a family rather than knowing one.

Its blocks live in ``model.blocks`` (not ``layers``) and its parameter names are its own, so
nothing can reach them by Llama's conventions.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tpu_train.models import ModelFamily, Role, SplitSizes


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    dim: int
    n_blocks: int
    hidden: int
    vocab_size: int
    max_seq_len: int


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MlpBlock(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.norm = Norm(config.dim)
        self.up = nn.Linear(config.dim, config.hidden, bias=False)
        self.down = nn.Linear(config.hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class ToyLM(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(MlpBlock(config) for _ in range(config.n_blocks))
        self.final_norm = Norm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, **_) -> torch.Tensor:
        # Position and document inputs of packed rows change nothing: no token sees another.
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def init_weights(model: ToyLM, seed: int = 0, device=None) -> ToyLM:
    model = model.to_empty(device=device or "cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def param_shapes(c: ToyConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"embed.weight": (c.vocab_size, c.dim)}
    for i in range(c.n_blocks):
        shapes.update({f"blocks.{i}.norm.weight": (c.dim,),
                       f"blocks.{i}.up.weight": (c.hidden, c.dim),
                       f"blocks.{i}.down.weight": (c.dim, c.hidden)})
    shapes.update({"final_norm.weight": (c.dim,), "head.weight": (c.vocab_size, c.dim)})
    return shapes


def flops_per_token(c: ToyConfig, seq_len: int) -> int:
    return 6 * (c.n_blocks * 2 * c.dim * c.hidden + c.vocab_size * c.dim)


TOY = ModelFamily(
    name="toy_mlp",
    config_class=ToyConfig,
    configs={"toy_mlp_tiny": ToyConfig(dim=64, n_blocks=2, hidden=128, vocab_size=512,
                                       max_seq_len=64)},
    build=ToyLM,
    init_weights=init_weights,
    blocks=lambda model: model.blocks,
    param_roles=(
        (r"(^|\.)embed\.weight$", Role.EMBEDDING),
        (r"(^|\.)up\.weight$", Role.COLUMN),
        (r"(^|\.)down\.weight$", Role.ROW),
        (r"(^|\.)(final_)?norm\.weight$", Role.REPLICATED),
        (r"(^|\.)head\.weight$", Role.OUTPUT),
    ),
    split_sizes=lambda c: SplitSizes(width={"dim": c.dim}, heads={},
                                     hidden={"hidden": c.hidden, "vocab_size": c.vocab_size}),
    param_shapes=param_shapes,
    flops_per_token=flops_per_token,
)
