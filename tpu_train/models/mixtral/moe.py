"""A mixture-of-experts feed-forward (Mixtral's): a linear router, top-k routing renormalised
over the chosen experts, SwiGLU experts, no token dropped, and the load-balancing loss.

The experts' weights are stacked, one tensor each for ``w1`` (gate), ``w3`` (up) and ``w2``
(down), ``[n_experts, out, in]``: each slice is the ``[out, in]`` weight of one expert's
``nn.Linear``, and a plan can split the leading (expert) dimension over devices.

Two forms compute the experts, with the same outputs:

* ``dense``: every expert on every token (batched matmuls over the expert dimension), each
  result weighted by the token's routing weight for that expert (zero for the experts it was not
  routed to). ``n_experts / top_k`` times the FLOPs of the routed computation, but only dense
  matmuls of static shapes.
* ``grouped``: the ``tokens x top_k`` assignments sorted by expert and each expert's rows
  multiplied by its weights in one grouped matmul (``tpu_train_ops::grouped_mm``, lowered to
  ``jax.lax.ragged_dot`` by ``tpu_train.ops``; a loop of ``mm`` on CPU tensors), then
  weighted and summed back per token. Only the routed FLOPs.

Plain PyTorch: no device, compile or parallel code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoEFeedForward", "grouped_matmul", "load_balancing_loss", "route"]

_GROUPED_MM_NAMESPACE = "tpu_train_ops"


def route(router_logits: torch.Tensor, top_k: int):
    """``(probabilities [tokens, experts], weights [tokens, top_k], experts [tokens, top_k])``.

    Softmax in float32 over every expert, the ``top_k`` largest kept and renormalised to sum
    to one (Mixtral's routing)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return probs, weights / weights.sum(dim=-1, keepdim=True), experts


def load_balancing_loss(router_logits: list[torch.Tensor], n_experts: int,
                        top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as Hugging Face computes it for Mixtral
    (``load_balancing_loss_func`` without an attention mask): over the tokens of every layer,
    ``n_experts * sum_e f_e * P_e`` with ``f_e`` the fraction of top-k assignments that chose
    expert ``e`` (each token counted ``top_k`` times) and ``P_e`` its mean router probability.
    It is ``top_k`` when the load is perfectly balanced."""
    counts = torch.zeros(n_experts, dtype=torch.float32, device=router_logits[0].device)
    prob_sums = torch.zeros_like(counts)
    rows = 0
    for logits in router_logits:
        probs, _, experts = route(logits, top_k)
        counts = counts + _one_hot(experts, n_experts).sum(dim=(0, 1))
        prob_sums = prob_sums + probs.sum(dim=0)
        rows += logits.shape[0]
    return n_experts * torch.sum((counts / rows) * (prob_sums / rows))


def _one_hot(indices: torch.Tensor, n: int) -> torch.Tensor:
    """float32 one-hot of ``indices`` along a new last dimension (a comparison: static shapes)."""
    return (indices.unsqueeze(-1) == torch.arange(n, device=indices.device)).float()


def _grouped_mm_op():
    """The grouped-matmul op, registered where ``tpu_train.ops`` is loaded (the tpu device and
    the compiled step need it); ``None`` in a process that only uses plain PyTorch."""
    namespace = getattr(torch.ops, _GROUPED_MM_NAMESPACE)
    try:
        return namespace.grouped_mm.default
    except AttributeError:
        return None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``[m, k] x [groups, k, n] -> [m, n]``: consecutive row blocks of ``x``, of
    ``group_sizes`` rows each, times ``w[group]``.

    On CPU tensors, a loop of ``mm`` (PyTorch's autograd differentiates it); elsewhere (the
    ``tpu`` device, and the fake tensors a compiled step is traced with) the
    ``tpu_train_ops::grouped_mm`` op, whose lowering JAX differentiates."""
    if x.device.type == "cpu":
        pieces, start = [], 0
        for group, size in enumerate(group_sizes.tolist()):
            pieces.append(x[start:start + size] @ w[group])
            start += size
        return torch.cat(pieces)
    op = _grouped_mm_op()
    if op is None:
        raise RuntimeError(f"the grouped matmul on {x.device} needs tpu_train's ops loaded "
                           "(import tpu_train), or moe_impl='dense'")
    return op(x, w, group_sizes)


class MoEFeedForward(nn.Module):
    """Top-``top_k`` routed SwiGLU experts. ``forward(x)`` returns ``(out, router_logits)``:
    ``out`` shaped like ``x`` and the router's logits ``[tokens, n_experts]`` (for
    :func:`load_balancing_loss`)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int,
                 impl: str = "dense"):
        super().__init__()
        if impl not in ("dense", "grouped"):
            raise ValueError(f"impl must be 'dense' or 'grouped', got {impl!r}")
        self.n_experts, self.top_k, self.impl = n_experts, top_k, impl
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        if not self.w1.is_meta:
            bound = 1 / math.sqrt(dim)
            for weight in (self.w1, self.w2, self.w3):
                nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        router_logits = self.gate(tokens)
        _, weights, experts = route(router_logits, self.top_k)
        if self.impl == "dense":
            out = self._dense(tokens, weights, experts)
        else:
            out = self._grouped(tokens, weights, experts)
        return out.reshape(shape), router_logits

    def _dense(self, x, weights, experts):
        # [tokens, n_experts]: the routing weight of each expert, zero where not chosen.
        combine = (_one_hot(experts, self.n_experts) * weights.unsqueeze(-1)).sum(dim=1)
        gate = torch.einsum("td,efd->etf", x, self.w1)
        up = torch.einsum("td,efd->etf", x, self.w3)
        each = torch.einsum("etf,edf->etd", F.silu(gate) * up, self.w2)
        return torch.einsum("etd,te->td", each, combine.to(each.dtype))

    def _grouped(self, x, weights, experts):
        flat = experts.reshape(-1)  # [tokens * top_k], token-major
        order = torch.argsort(flat, stable=True)
        rows = x[torch.div(order, self.top_k, rounding_mode="floor")]
        sizes = _one_hot(flat, self.n_experts).sum(dim=0).to(torch.int32)
        gate = grouped_matmul(rows, self.w1.transpose(1, 2), sizes)
        up = grouped_matmul(rows, self.w3.transpose(1, 2), sizes)
        each = grouped_matmul(F.silu(gate) * up, self.w2.transpose(1, 2), sizes)
        each = each * weights.reshape(-1)[order].unsqueeze(-1).to(each.dtype)
        # Back to token-major order: the inverse permutation, then each token's top_k rows summed.
        unsorted = each[torch.argsort(order)]
        return unsorted.reshape(x.shape[0], self.top_k, -1).sum(dim=1)
