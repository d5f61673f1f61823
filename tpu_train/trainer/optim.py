"""The optimizers ``optim.name`` can name (:data:`~tpu_train.trainer.config.OPTIMIZERS`, the one
registry), built over the trainable parameters with weight decay on matrices only."""

from __future__ import annotations

import inspect

import torch

from tpu_train.compile.stored_moments import stored_moments_class

from .config import OPTIMIZERS, OptimConfig, StateDtype
from .errors import ConfigError
from .validation import state_dtype_problem


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: 2-D+ weights (decayed) and vectors such as norm scales and biases (not).

    Embedding tables are matrices but are not decayed: decay pulls rare tokens' rows to zero.
    """
    embedding_ids = {
        id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)
    }
    decayed, plain = [], []
    seen: set[int] = set()
    for parameter in model.parameters():
        if not parameter.requires_grad or id(parameter) in seen:
            continue
        seen.add(id(parameter))
        if parameter.ndim >= 2 and id(parameter) not in embedding_ids:
            decayed.append(parameter)
        else:
            plain.append(parameter)
    groups = [{"params": decayed, "weight_decay": weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The ``torch.optim`` class ``cfg.name`` names in :data:`OPTIMIZERS`, over the trainable
    parameters of ``model``, given the ``optim`` fields its constructor takes (``beta1`` /
    ``beta2`` as ``betas``, ``momentum`` where it has one). With ``optim.state_dtype`` other
    than ``param``, Adam/AdamW's variant that stores its moments in that dtype
    (:mod:`tpu_train.compile.stored_moments`), in eager and compiled steps alike."""
    if cfg.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.name!r} is not supported; valid names: "
                          f"{', '.join(OPTIMIZERS)}")
    cls = getattr(torch.optim, OPTIMIZERS[cfg.name])
    offered = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps,
               "momentum": cfg.momentum}
    accepted = set(inspect.signature(cls).parameters)
    state_dtype = StateDtype(cfg.state_dtype)
    if state_dtype is not StateDtype.param:
        problem = state_dtype_problem(cfg.name, state_dtype)
        if problem:
            raise ConfigError(problem)
        offered["state_dtype"] = {StateDtype.bf16: torch.bfloat16,
                                  StateDtype.fp32: torch.float32}[state_dtype]
        accepted.add("state_dtype")  # the variant takes the torch class's arguments and this
        cls = stored_moments_class(cls)
    groups = parameter_groups(model, cfg.weight_decay)
    if not groups:
        raise ConfigError("the model has no trainable parameters; nothing to optimize")
    return cls(groups, **{k: v for k, v in offered.items() if k in accepted})
