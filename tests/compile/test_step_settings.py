"""The compiled step's settings: one object, checked when made, shared by the compiled step and
the lowering (nothing here compiles)."""

import pytest
import torch

from tpu_train.compile import StepSettings, compile_train_step, lower_train_step

BAD = [
    (dict(grad_accum_steps=0), "grad_accum_steps must be >= 1, got 0"),
    (dict(max_grad_norm=-1.0), "max_grad_norm must be > 0 or None, got -1.0"),
    (dict(autodiff="tf"), "autodiff must be one of 'jax', 'torch', got 'tf'"),
    (dict(compute_dtype=torch.int8), "compute_dtype must be torch.bfloat16, torch.float16, "
                                     "torch.float32 or None, got torch.int8"),
    (dict(autocast_dtype=torch.float32), "autocast_dtype must be torch.bfloat16 or "
                                         "torch.float16, got torch.float32"),
]


def _model_and_optimizer():
    model = torch.nn.Linear(2, 2)  # never moved: the settings are refused before it is read
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model, batch):
    return model(batch["x"]).sum()


@pytest.mark.parametrize("keywords, message", BAD, ids=[next(iter(k)) for k, _ in BAD])
def test_a_bad_setting_is_one_line_naming_it_wherever_it_is_given(keywords, message):
    model, optimizer = _model_and_optimizer()
    batch = {"x": torch.ones(2, 2)}
    for make in (lambda: StepSettings(**keywords),
                 lambda: compile_train_step(model, optimizer, _loss, **keywords),
                 lambda: lower_train_step(model, optimizer, _loss, batch, **keywords)):
        with pytest.raises(ValueError) as raised:
            make()
        assert str(raised.value) == message


def test_a_misspelt_lowering_keyword_is_refused_by_name():
    model, optimizer = _model_and_optimizer()
    with pytest.raises(TypeError, match="max_grad_nrom"):
        lower_train_step(model, optimizer, _loss, {"x": torch.ones(2, 2)}, max_grad_nrom=1.0)


def test_values_are_kept_in_their_normal_forms_and_the_step_keeps_the_object():
    settings = StepSettings(max_grad_norm=1, grad_accum_steps=2.0, donate=0, scan_layers=1,
                            skip_non_finite=1)
    assert (settings.max_grad_norm, settings.grad_accum_steps, settings.donate,
            settings.scan_layers, settings.skip_non_finite) == (1.0, 2, False, True, True)
    assert type(settings.max_grad_norm) is float and type(settings.grad_accum_steps) is int
    with pytest.raises(AttributeError):
        settings.donate = True  # frozen: one step's settings do not change under it
    model, optimizer = _model_and_optimizer()
    step = compile_train_step(model, optimizer, _loss, max_grad_norm=1, grad_accum_steps=2)
    assert step.settings == StepSettings(max_grad_norm=1.0, grad_accum_steps=2)
