"""The sharding plan is chosen from the model's class, not hard-wired to Llama's names."""

import pytest
import torch
from jax.sharding import PartitionSpec

from tpu_train.models import Llama, get_config
from tpu_train.parallel.mesh import MeshError, MeshShape
from tpu_train.parallel.model_plans import plan_for_model, register_plan
from tpu_train.parallel.plans import PlanError, ShardingPlan


def test_llama_and_its_subclasses_get_the_llama_plan():
    class MyLlama(Llama):
        pass

    with torch.device("meta"):
        model = MyLlama(get_config("debug_tiny"))
    found = plan_for_model(model)
    assert found.family == "Llama" and found.make_plan().name == "llama_plan"
    with pytest.raises(MeshError, match="n_kv_heads=2"):
        found.check(model.config, MeshShape(1, 1, 4))


def test_an_unknown_model_is_an_error_naming_it():
    with pytest.raises(PlanError, match="no sharding plan for model type Sequential; plans exist "
                                        "for Llama"):
        plan_for_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_a_family_registers_its_own_plan():
    class TwoLayers(torch.nn.Module):
        pass

    plan = ShardingPlan([(r".*", PartitionSpec("fsdp"))], name="two_layers_plan")
    register_plan("TwoLayers", lambda: plan, lambda config, shape: None)
    assert plan_for_model(TwoLayers()).make_plan() is plan
