"""Adam and AdamW that store their moments in a chosen dtype (bfloat16: half the bytes) while
the update itself is computed in float32.

``exp_avg`` / ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``) live in ``state_dtype``;
each step reads them upcast to float32, runs ``torch.optim``'s own Adam arithmetic
(:func:`torch.optim.adam.adam`) on float32 copies of the parameter, gradient and moments, and
writes the parameter back in its dtype and the moments in ``state_dtype`` (round to nearest
even). One parameter at a time, so the float32 copies add one parameter's worth of memory,
not a whole model's. The compiled step runs the same update in one program
(:class:`tpu_train.compile.functional_optim.AdamAdapter` with ``state_dtype``).

``torch.optim.Optimizer.load_state_dict`` casts floating state to the parameters' dtype; a
load hook casts the moments back, so a checkpoint of bfloat16 moments resumes exactly (the
round trip bf16 -> fp32 -> bf16 is lossless).
"""

from __future__ import annotations

import torch
import torch.optim.adam as torch_adam

__all__ = ["AdamStoredMoments", "AdamWStoredMoments", "MOMENT_KEYS", "stored_moments_class"]

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class _StoredMoments:
    """The mixin: ``state_dtype`` moments, a float32 update (module docstring)."""

    def __init__(self, params, *args, state_dtype: torch.dtype = torch.bfloat16, **kwargs):
        if not state_dtype.is_floating_point:
            raise ValueError(f"state_dtype must be a floating dtype; got {state_dtype}")
        super().__init__(params, *args, **kwargs)
        for group in self.param_groups:
            if group.get("foreach") or group.get("fused") or group.get("capturable"):
                raise ValueError(f"{type(self).__name__} runs the single-tensor update; "
                                 "foreach, fused and capturable are not supported")
        self.state_dtype = state_dtype
        self.register_load_state_dict_post_hook(_recast_moments)

    def _init_state(self, param: torch.Tensor, group: dict) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in MOMENT_KEYS[:3 if group["amsgrad"] else 2]:
                state[key] = torch.zeros_like(param, dtype=self.state_dtype,
                                              memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                state = self._init_state(param, group)
                keys = MOMENT_KEYS[:3 if group["amsgrad"] else 2]
                wide = param.float()  # the parameter itself when it is float32
                moments = [state[key].float() for key in keys]
                torch_adam.adam(
                    [wide], [param.grad.float()], moments[:1], moments[1:2], moments[2:],
                    [state["step"]], foreach=False, capturable=False, differentiable=False,
                    fused=None, decoupled_weight_decay=bool(group.get("decoupled_weight_decay",
                                                                      False)),
                    amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                    weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=group["maximize"])
                if wide is not param:
                    param.copy_(wide)
                for key, moment in zip(keys, moments):
                    state[key].copy_(moment)
        return loss


def _recast_moments(optimizer: _StoredMoments) -> None:
    for state in optimizer.state.values():
        for key in MOMENT_KEYS:
            if key in state and state[key].dtype != optimizer.state_dtype:
                state[key] = state[key].to(optimizer.state_dtype)


class AdamStoredMoments(_StoredMoments, torch.optim.Adam):
    """``torch.optim.Adam`` with moments stored in ``state_dtype`` (module docstring)."""


class AdamWStoredMoments(_StoredMoments, torch.optim.AdamW):
    """``torch.optim.AdamW`` with moments stored in ``state_dtype`` (module docstring)."""


def stored_moments_class(cls: type) -> type | None:
    """The stored-moments variant of ``torch.optim.Adam`` / ``AdamW`` (None for others)."""
    return {torch.optim.Adam: AdamStoredMoments, torch.optim.AdamW: AdamWStoredMoments}.get(cls)
