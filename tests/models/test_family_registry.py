"""The model-family seam: the spec's checks, and the registry's lookups by name, config,
model and Hugging Face ``model_type``."""

import dataclasses
import json

import pytest
import torch

from tpu_train.models import (LLAMA, Llama, ModelFamily, Role, checkpoint_family, config_names,
                              family_for_hf, family_named, family_of, get_config, named_config,
                              register_family, unregister_family)

from tests.models.toy_family import TOY, ToyConfig


@pytest.fixture
def toy():
    yield register_family(TOY)
    unregister_family(TOY.name)


def test_llama_is_found_by_name_config_model_and_checkpoint_type(tmp_path):
    assert family_named("llama") is LLAMA and family_named("llama3_1_8b") is LLAMA
    with torch.device("meta"):
        model = Llama(get_config("debug_tiny"))
    assert family_of(model) is LLAMA and family_of(model.config) is LLAMA
    assert family_for_hf("llama") is LLAMA
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_family(tmp_path) is LLAMA
    assert named_config("debug_tiny", max_seq_len=64) == get_config("debug_tiny", max_seq_len=64)


def test_a_registered_family_joins_the_names(toy):
    assert "toy_mlp_tiny" in config_names() and "debug_tiny" in config_names()
    assert family_named("toy_mlp_tiny") is TOY
    with torch.device("meta"):
        model = TOY.build(TOY.config("toy_mlp_tiny"))
    assert family_of(model) is TOY
    # num_params is the sum of param_shapes, and param_shapes is what the model holds.
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert built == TOY.param_shapes(model.config)
    assert TOY.num_params(model.config) == sum(p.numel() for p in model.parameters())


def test_unknown_names_and_models_are_one_line_errors(tmp_path):
    with pytest.raises(KeyError, match="no model family or config named 'llama4'; families: "):
        family_named("llama4")
    with pytest.raises(LookupError, match="no model family for Linear .*register_family"):
        family_of(torch.nn.Linear(2, 2))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2",
                                                      "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config.json: unsupported architecture "
                                         r"\(model_type='gpt2', architectures=\['GPT2LMHeadModel'\]\)"
                                         r"; supported model types: llama"):
        checkpoint_family(tmp_path)


def test_a_family_cannot_take_anothers_names(toy):
    with pytest.raises(ValueError, match=r"the names \['toy_mlp_tiny'\] are already taken by "
                                         "toy_mlp"):
        register_family(dataclasses.replace(TOY, name="toy_two"))
    with pytest.raises(ValueError, match=r"the names \['debug_tiny'\] are already taken by "
                                         "llama"):
        register_family(dataclasses.replace(TOY, name="debug_tiny", configs={}))
    assert [f.name for f in (family_named("toy_mlp"), family_named("llama"))] == ["toy_mlp",
                                                                                  "llama"]


def test_registering_a_family_under_its_own_name_replaces_it(toy):
    other = dataclasses.replace(TOY, configs={"toy_mlp_small": ToyConfig(32, 1, 64, 512, 64)})
    register_family(other)
    assert family_named("toy_mlp_small") is other
    assert "toy_mlp_tiny" not in config_names()


def test_the_spec_checks_its_table_when_defined():
    with pytest.raises(ValueError, match="'colum' .* is not a parameter role; roles: "
                                         "embedding, column, row, output, replicated"):
        dataclasses.replace(TOY, param_roles=((r"up\.weight$", "colum"),))
    with pytest.raises(ValueError, match=r"bad parameter regex '\('"):
        dataclasses.replace(TOY, param_roles=(("(", Role.COLUMN),))
    with pytest.raises(ValueError, match=r"configs \['bad'\] are not ToyConfig instances"):
        dataclasses.replace(TOY, configs={"bad": get_config("debug_tiny")})
    with pytest.raises(ValueError, match="lower-case letters"):
        dataclasses.replace(TOY, name="Toy")
    with pytest.raises(TypeError, match="register_family takes a tpu_train.models.ModelFamily"):
        register_family("toy")
    assert isinstance(TOY, ModelFamily)


def test_roles_are_the_ones_the_parallel_layer_shards():
    from tpu_train.parallel.family_plans import ROLES, role_specs

    assert tuple(r.value for r in Role) == ROLES == tuple(role_specs())
