"""Qwen2.5, Mistral and Mixtral on the tpu device: a transformers-written checkpoint, loaded
through its family's registered format and moved to the device, gives transformers' logits on
the CPU within a bound derived from the float32 forward (on the CPU client the device is exact
to float32 rounding; on a TPU its elementwise functions add their measured error)."""

from __future__ import annotations

import pytest
import torch

import tpu_train  # noqa: F401  (the tpu device)
from tpu_train.models import checkpoint_family

from tests.tolerances import assert_rel_close, llama_functions, rtol_for

from .hf_reference import FAMILY_SHAPE, hf_mistral, hf_qwen2, random_tokens, randomized
from .test_mixtral import hf_mixtral_dir

SEQ = 40  # past three Mistral windows of 12


def _qwen2(directory):
    model = hf_qwen2()
    model.save_pretrained(directory)
    return model


def _mistral(directory):
    model = hf_mistral()
    model.save_pretrained(directory)
    return model


def _mixtral(directory):
    # Every weight random (transformers' initialization leaves logits below 1: a vacuous
    # relative comparison), the router's included, so that its top-2 choices are clear ones.
    model = randomized(hf_mixtral_dir(directory), seed=0)
    model.save_pretrained(directory)
    return model


# family: (writes a transformers checkpoint to a directory and returns the model, longest
# reduction of the forward, elementwise functions beyond a Llama's)
FAMILIES = {
    "qwen2": (_qwen2, FAMILY_SHAPE["intermediate_size"], ()),
    "mistral": (_mistral, FAMILY_SHAPE["intermediate_size"], ()),
    # The router's softmax over the experts, once per layer.
    "mixtral": (_mixtral, 80, ("exp", "exp")),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_transformers_checkpoint_on_the_device_gives_transformers_logits(family, tmp_path):
    write, reduction, extra_functions = FAMILIES[family]
    reference = write(tmp_path).eval()
    spec = checkpoint_family(tmp_path)
    assert spec.name == family or family in spec.hf.model_types
    model = spec.hf.load(tmp_path, dtype=torch.float32).eval().to("tpu")
    assert next(model.parameters()).device.type == "tpu"
    tokens = random_tokens(2, SEQ)
    with torch.no_grad():
        ours = model(tokens.to("tpu"))
        expected = reference(tokens).logits
    assert ours.device.type == "tpu" and ours.shape == expected.shape
    assert expected.abs().max() > 1.0  # not a vacuous comparison of near-zero logits
    layers = reference.config.num_hidden_layers
    rtol = rtol_for(torch.float32, reduction, depth=2 * layers,
                    functions=llama_functions(layers) + extra_functions)
    assert_rel_close(ours, expected, rtol, f"{family} logits on the device")
