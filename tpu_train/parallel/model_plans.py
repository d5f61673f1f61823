"""Which sharding plan a model gets: plans are registered per model family, by class name.

The model files are plain PyTorch and know nothing of meshes, so the mapping lives here, beside
the plans: a family registers its plan factory and the check that its dimensions divide a
mesh. A model whose class (or any base class) is not registered gets an error naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .llama_plan import llama_plan
from .mesh import MeshShape, check_model_divisibility
from .mixtral_plan import mixtral_plan
from .plans import PlanError, ShardingPlan

__all__ = ["ModelPlan", "plan_for_model", "register_plan"]


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """A family's plan factory and its divisibility check ``check(model_config, MeshShape)``."""

    family: str
    make_plan: Callable[[], ShardingPlan]
    check: Callable[[Any, MeshShape], None]


_PLANS: dict[str, ModelPlan] = {}


def register_plan(family: str, make_plan: Callable[[], ShardingPlan],
                  check: Callable[[Any, MeshShape], None]) -> None:
    """Register the plan of model class ``family`` (its ``__name__``; subclasses inherit it)."""
    _PLANS[family] = ModelPlan(family, make_plan, check)


def plan_for_model(model: Any) -> ModelPlan:
    """The registered plan of ``model``'s class or its nearest registered base class."""
    for cls in type(model).__mro__:
        found = _PLANS.get(cls.__name__)
        if found is not None:
            return found
    raise PlanError(
        f"no sharding plan for model type {type(model).__name__}; plans exist for "
        f"{', '.join(sorted(_PLANS))} (register one with "
        "tpu_train.parallel.model_plans.register_plan)")


register_plan("Llama", llama_plan, check_model_divisibility)
register_plan("Mixtral", mixtral_plan, check_model_divisibility)
