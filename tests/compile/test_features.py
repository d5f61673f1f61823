"""Gradient accumulation, clipping, donation and the write-back into the user's tensors."""

import copy
import re

import pytest
import torch

import tpu_train  # noqa: F401
from tpu_train.device import runtime, storage_of
from tpu_train.compile import MissingLoweringError, UnsupportedOptimizerError, compile_train_step
from tpu_train.compile.program import natural_layout

from tests.tolerances import CROSS_ENTROPY_FUNCTIONS, loss_rtol, param_atol, rtol_for

from .helpers import (DEVICE, MLP_FUNCTIONS, MLP_N, OPTIMIZERS, assert_params_within, mlp,
                      mlp_batches, mlp_loss, optimizer_lr, param_bound, relative_error, run_compiled,
                      run_reference, to_device)

# Tolerances from the float32 arithmetic (tests/tolerances.py). Longest reductions in an MLP
# step: the mean-squared error over batch x 5 outputs (8 x 5 = 40; 16 x 5 = 80), the matmuls'
# inner dimensions 12 / 32 / 64 and the batch. With clipping, the squared-norm sum over the
# largest parameter tensor (32 x 32 = 1024) scales every gradient.
F32 = torch.float32
NORM_N = 32 * 32
# helpers.mlp's elementwise functions (GELU's erf, tanh), each adding its measured error
# (tests/tolerances rtol_for); with a cross-entropy, its exp and log too.
FUNCTIONS = MLP_FUNCTIONS
CE_FUNCTIONS = (*MLP_FUNCTIONS, *CROSS_ENTROPY_FUNCTIONS)


class _Named:
    """One tensor seen through ``named_parameters`` (for assert_params_within)."""

    def __init__(self, **tensors):
        self.tensors = tensors

    def named_parameters(self):
        return iter(self.tensors.items())


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_grad_accumulation_equals_one_big_batch(opt_name):
    batches = mlp_batches(4, batch=16)
    model, make_opt = mlp(), OPTIMIZERS[opt_name]
    big, big_model, _, _ = run_compiled(model, make_opt, mlp_loss, batches)
    accumulated, acc_model, _, step = run_compiled(model, make_opt, mlp_loss, batches,
                                                   grad_accum_steps=4)
    # 4 steps; MSE over 16 x 5 outputs (the longest reduction); the grad norm adds its squared
    # sum over the largest tensor (1024).
    n = 16 * 5
    for i, (a, b) in enumerate(zip(accumulated, big)):
        assert a["loss"] == pytest.approx(b["loss"], rel=loss_rtol(F32, i + 1, n,
                                                                   functions=FUNCTIONS))
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=loss_rtol(
            F32, i + 1, max(n, NORM_N), functions=FUNCTIONS))
    assert_params_within(acc_model, big_model,
                         param_bound(opt_name, model, 4, n, functions=FUNCTIONS))
    assert len(step.compilations) == 1


def test_grad_accumulation_rejects_indivisible_batches():
    model = mlp().to(DEVICE)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_loss,
                              grad_accum_steps=3)
    with pytest.raises(ValueError, match=r"batch\['x'\] has shape \(8, 12\).*multiple"):
        step(to_device(mlp_batches(1)[0]))


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_clipping_matches_clip_grad_norm(max_norm):
    batches = mlp_batches(6)
    model, make_opt = mlp(), OPTIMIZERS["sgd"]
    losses, cpu_model, _, _ = run_reference(model, make_opt, mlp_loss, batches, device="cpu",
                                            max_grad_norm=max_norm)
    metrics, compiled_model, _, _ = run_compiled(model, make_opt, mlp_loss, batches,
                                                 max_grad_norm=max_norm)
    # 6 SGD steps; the clip coefficient's norm sums over 1024 squares (the longest reduction).
    assert_params_within(compiled_model, cpu_model,
                         param_bound("sgd", model, 6, NORM_N, functions=FUNCTIONS))
    # The reported norm is the pre-clipping total norm, as clip_grad_norm_ returns it.
    reference = copy.deepcopy(model)
    mlp_loss(reference, batches[0]).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    # One backward (MSE over 40) and the norm's squared sum over 1024 elements.
    assert metrics[0]["grad_norm"] == pytest.approx(float(expected),
                                                    rel=rtol_for(F32, NORM_N, functions=FUNCTIONS))
    if max_norm < 1:
        assert float(expected) > max_norm  # the small bound really clips


def test_write_back_keeps_tensor_identity_and_views_see_updates():
    model = mlp().to(DEVICE)
    weight = model[0].weight
    alias = weight.detach()  # shares the parameter's storage
    row = weight.detach()[1]  # a strided view into it
    before = weight.detach().cpu().clone()
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), mlp_loss)
    step(to_device(mlp_batches(1)[0]))
    assert model[0].weight is weight
    after = weight.detach().cpu()
    assert not torch.equal(after, before)
    assert torch.equal(alias.cpu(), after)
    assert torch.equal(row.cpu(), after[1])


def test_parameters_that_are_views_into_one_buffer():
    """Parameters that do not own their storage are written back through their geometry."""
    reference = mlp()
    model = copy.deepcopy(reference).to(DEVICE)
    named = [(module, name, p) for module in model.modules()
             for name, p in module.named_parameters(recurse=False)]
    flat = torch.cat([p.detach().reshape(-1) for _, _, p in named])
    offset = 0
    for module, name, p in named:  # every parameter becomes a view into one flat buffer
        n = p.numel()
        setattr(module, name, torch.nn.Parameter(flat[offset:offset + n].view_as(p)))
        offset += n
    params = list(model.parameters())
    assert all(storage_of(p) is storage_of(flat) for p in params)
    make_opt = OPTIMIZERS["adamw"]
    step = compile_train_step(model, make_opt(model.parameters()), mlp_loss)
    batches = mlp_batches(3)
    for batch in batches:
        step(to_device(batch))
    _, cpu_model, _, _ = run_reference(reference, make_opt, mlp_loss, batches, device="cpu")
    bound = param_bound("adamw", reference, 3, MLP_N,  # 3 AdamW steps, MSE over 8 x 5
                        functions=FUNCTIONS)
    assert_params_within(model, cpu_model, bound)
    # The flat buffer itself holds the new values.
    flat_weight = flat[:params[0].numel()].view_as(params[0])
    assert_params_within(_Named(w=flat_weight), _Named(w=cpu_model[0].weight), bound)


def _step_argument(parameter):
    """The array a single-device step is given for ``parameter`` (which owns its storage): the
    storage's flat buffer on the CPU client, the tensor-shaped one elsewhere (on a TPU: the
    step's natural layout, program.natural_layout). Reading ``.buffer`` there would flatten it
    into a copy the step never sees."""
    storage = storage_of(parameter)
    if natural_layout(runtime.platform()):
        return storage.shaped(tuple(parameter.shape))
    return storage.buffer


def test_without_donation_old_arrays_stay_valid():
    model = mlp().to(DEVICE)
    old = _step_argument(model[0].weight)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_loss,
                              donate=False)
    step(to_device(mlp_batches(1)[0]))
    assert not old.is_deleted()
    model_donated = mlp().to(DEVICE)
    old = _step_argument(model_donated[0].weight)
    compile_train_step(model_donated, torch.optim.SGD(model_donated.parameters(), lr=0.1),
                       mlp_loss)(to_device(mlp_batches(1)[0]))
    assert old.is_deleted()


def test_frozen_parameters_and_param_groups():
    reference = mlp()
    for p in reference[0].parameters():
        p.requires_grad_(False)

    def make_opt(params):
        params = [p for p in params if p.requires_grad]
        return torch.optim.AdamW([{"params": params[:2], "lr": 1e-2},
                                  {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}])

    batches = mlp_batches(5)
    _, cpu_model, _, _ = run_reference(reference, make_opt, mlp_loss, batches, device="cpu")
    metrics, compiled_model, _, _ = run_compiled(reference, make_opt, mlp_loss, batches)
    # 5 AdamW steps at the larger group's lr 1e-2; MSE over 8 x 5.
    assert_params_within(compiled_model, cpu_model, lambda name, ref: param_atol(
        F32, 1e-2, 5, reduction=MLP_N, numel=ref.numel(), functions=FUNCTIONS))
    assert torch.equal(compiled_model[0].weight.cpu(), reference[0].weight)


def test_unsupported_optimizer_and_bad_loss_are_clear_errors():
    model = mlp().to(DEVICE)
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS"):
        compile_train_step(model, torch.optim.LBFGS(model.parameters()), mlp_loss)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              lambda m, b: m(b["x"]))
    with pytest.raises(TypeError, match="0-dim floating-point"):
        step(to_device(mlp_batches(1)[0]))
    assert issubclass(MissingLoweringError, NotImplementedError)


@pytest.mark.parametrize("accum", [1, 2])
def test_buffers_mutated_by_the_forward_are_written_back(accum):
    """BatchNorm's running statistics (buffers the forward overwrites) are program outputs;
    with accumulation each micro-batch updates them in turn, as an eager loop does."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16),
                                    torch.nn.ReLU(), torch.nn.Linear(16, 5))
    batches = mlp_batches(4)
    make_opt = OPTIMIZERS["sgd"]
    cpu_model = copy.deepcopy(reference)
    opt = make_opt(cpu_model.parameters())
    for batch in batches:  # torch's accumulation idiom: backward of loss / k per micro-batch
        for x, y in zip(batch["x"].chunk(accum), batch["y"].chunk(accum)):
            (mlp_loss(cpu_model, {"x": x, "y": y}) / accum).backward()
        opt.step()
        opt.zero_grad()
    _, compiled_model, _, _ = run_compiled(reference, make_opt, mlp_loss, batches,
                                           grad_accum_steps=accum)
    # 4 SGD steps, MSE over 8 x 5 (the longest reduction; BatchNorm's over the batch of 8),
    # BatchNorm's rsqrt.
    assert_params_within(compiled_model, cpu_model,
                         param_bound("sgd", reference, 4, MLP_N, functions=("rsqrt",)))
    bn, expected = compiled_model[1], cpu_model[1]
    assert int(bn.num_batches_tracked.cpu()) == int(expected.num_batches_tracked) == 4 * accum
    # The running statistics are forward quantities after 4 steps, like the loss.
    stats_rtol = loss_rtol(F32, 4, MLP_N, functions=("rsqrt",))
    assert relative_error(bn.running_mean, expected.running_mean) <= stats_rtol
    assert relative_error(bn.running_var, expected.running_var) <= stats_rtol


def test_capturable_adamw_keeps_its_step_counters_on_the_device():
    reference, batches = mlp(), mlp_batches(5)
    _, cpu_model, cpu_opt, _ = run_reference(reference, OPTIMIZERS["adamw"], mlp_loss, batches,
                                             device="cpu")
    metrics, model, opt, _ = run_compiled(
        reference, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1, capturable=True),
        mlp_loss, batches)
    # 5 AdamW steps (lr 3e-3 as OPTIMIZERS["adamw"]), MSE over 8 x 5.
    assert_params_within(model, cpu_model,
                         param_bound("adamw", reference, 5, MLP_N, functions=FUNCTIONS))
    for state in opt.state.values():
        assert state["step"].device.type == "tpu"
        assert float(state["step"].cpu()) == 5.0


def _dropout_losses(seed, steps=4, accum=1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.Dropout(0.5),
                                torch.nn.Linear(64, 5)).to(DEVICE)
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), mlp_loss,
                              grad_accum_steps=accum)
    batch = to_device(mlp_batches(1)[0])
    torch.tpu.manual_seed(seed)
    return [float(step(batch)["loss"].cpu()) for _ in range(steps)], model, batch


@pytest.mark.parametrize("accum", [1, 2])
def test_random_ops_draw_fresh_reproducible_masks(accum):
    losses, model, batch = _dropout_losses(seed=3, accum=accum)
    again, _, _ = _dropout_losses(seed=3, accum=accum)
    other, _, _ = _dropout_losses(seed=4, accum=accum)
    assert losses == again  # the device RNG seed reproduces the step's randomness
    assert len(set(losses)) == len(losses)  # lr 0, same batch: only the masks change
    assert losses != other
    # In eval mode dropout is the identity: the compiled loss equals the eager one.
    model.eval()
    step = compile_train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), mlp_loss)
    expected = float(mlp_loss(model, batch).detach().cpu())
    # One forward: its longest reduction is the hidden size 64.
    assert float(step(batch)["loss"].cpu()) == pytest.approx(expected, rel=rtol_for(F32, 64))


def _summed_ce(model, batch):
    """(summed cross-entropy over labelled rows, number of labelled rows)."""
    logits = model(batch["x"])
    loss_sum = torch.nn.functional.cross_entropy(logits, batch["labels"], ignore_index=-100,
                                                 reduction="sum")
    return loss_sum, (batch["labels"] != -100).sum()


def test_loss_sum_and_count_weigh_every_item_equally_across_micro_batches():
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(4):
        labels = torch.randint(0, 5, (8,), generator=g)
        labels[torch.rand(8, generator=g) < 0.4] = -100  # uneven counts per micro-batch
        labels[0] = 1
        batches.append({"x": torch.randn(8, 12, generator=g), "labels": labels})
    reference, make_opt = mlp(), OPTIMIZERS["adamw"]
    cpu_model = copy.deepcopy(reference)
    opt = make_opt(cpu_model.parameters())
    expected_losses = []
    for batch in batches:  # the eager idiom: backward of sum / total count per micro-batch
        total = int((batch["labels"] != -100).sum())
        loss = 0.0
        for x, y in zip(batch["x"].chunk(4), batch["labels"].chunk(4)):
            part = _summed_ce(cpu_model, {"x": x, "labels": y})[0] / total
            part.backward()
            loss += float(part.detach())
        opt.step()
        opt.zero_grad()
        expected_losses.append(loss)
    metrics, model, _, _ = run_compiled(reference, make_opt, _summed_ce, batches,
                                        grad_accum_steps=4)
    # 4 AdamW steps; longest reduction: the hidden size 32 (CE over 5 classes, sums over 8 rows).
    for i, (got, want) in enumerate(zip([m["loss"] for m in metrics], expected_losses)):
        assert got == pytest.approx(want, rel=loss_rtol(F32, i + 1, 32, functions=CE_FUNCTIONS)), i
    assert_params_within(model, cpu_model,
                         param_bound("adamw", reference, 4, 32, functions=CE_FUNCTIONS))


def _copied_entry_parameters(hlo: str) -> list[str]:
    """Names of the program's own inputs that its optimized HLO copies (``copy(%input)``)."""
    entry = hlo[hlo.index("\nENTRY"):]
    inputs = re.findall(r"(%[\w.\-]+) = [^\n]* parameter\(\d+\)", entry)
    return [name for name in inputs if f"copy({name})" in entry]


def test_a_step_updates_its_donated_parameters_in_place_without_copying_them():
    """On the CPU client the step compiles with copy insertion's region analysis: XLA's default
    there copies every donated parameter and optimizer state that the step reads, then
    overwrites (tpu_train.device.runtime.compiler_options)."""
    _, _, _, step = run_compiled(mlp(), OPTIMIZERS["adamw"], mlp_loss, mlp_batches(1))
    (entry,) = step.cache.entries.values()
    assert _copied_entry_parameters(entry.executable.as_text()) == []


def _skipping_run_passes_the_nan_step_through():
    """Three steps with skip_non_finite, a NaN batch in the middle, against the two finite
    steps alone: the skipped step changed nothing (nor the step count). Returns the step."""
    batches = mlp_batches(3)
    batches[1] = {"x": batches[1]["x"], "y": torch.full_like(batches[1]["y"], float("nan"))}
    plain, plain_model, _, _ = run_compiled(mlp(), OPTIMIZERS["adamw"], mlp_loss,
                                            [batches[0], batches[2]], max_grad_norm=1.0)
    metrics, model, opt, step = run_compiled(mlp(), OPTIMIZERS["adamw"], mlp_loss, batches,
                                             max_grad_norm=1.0, skip_non_finite=True)
    assert [m["finite"] for m in metrics] == [1.0, 0.0, 1.0]
    assert [metrics[0]["loss"], metrics[2]["loss"]] == [m["loss"] for m in plain]
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.equal(p.cpu(), q.cpu()), name
    assert {int(s["step"]) for s in opt.state.values()} == {2}
    return step


def test_skip_non_finite_applies_finite_steps_and_passes_skipped_ones_through():
    step = _skipping_run_passes_the_nan_step_through()
    # A skipped step passes the donated buffers through (a conditional), so the program
    # copies no parameter or optimizer state to keep its old value.
    (entry,) = step.cache.entries.values()
    assert _copied_entry_parameters(entry.executable.as_text()) == []


@pytest.mark.parametrize("make_opt", [
    OPTIMIZERS["adamw"],
    # The first update overwrites the momentum buffer with the gradient (dampening unused):
    # a skipped first step must leave the buffers fresh for the next one.
    lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.5),
    # A traced optimizer (its step() in the program) with its own step counters.
    lambda params: torch.optim.Adamax(params, lr=2e-3),
], ids=["adamw", "sgd_dampening", "adamax_traced"])
def test_a_skipped_first_step_leaves_the_optimizer_as_before_it(make_opt):
    """The step counts advance before the finiteness flag is read and go back on a skipped
    step: a NaN first batch, then two finite ones, equals the two finite ones alone."""
    batches = mlp_batches(3)
    batches[0] = {"x": batches[0]["x"], "y": torch.full_like(batches[0]["y"], float("nan"))}
    plain, plain_model, plain_opt, _ = run_compiled(mlp(), make_opt, mlp_loss, batches[1:],
                                                    max_grad_norm=1.0)
    metrics, model, opt, _ = run_compiled(mlp(), make_opt, mlp_loss, batches,
                                          max_grad_norm=1.0, skip_non_finite=True)
    assert [m["finite"] for m in metrics] == [0.0, 1.0, 1.0]
    assert [m["loss"] for m in metrics[1:]] == [m["loss"] for m in plain]
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.equal(p.cpu(), q.cpu()), name
    assert [{k: float(v) for k, v in s.items() if k == "step"} for s in opt.state.values()] \
        == [{k: float(v) for k, v in s.items() if k == "step"} for s in plain_opt.state.values()]


def _counts(opt) -> list[float]:
    return [float(s["step"]) for s in opt.state.values()]


def test_a_skipped_last_update_is_put_back_wherever_the_step_counts_are_read_next():
    """The call does not wait for its flag: a skipped update's step counts go back when they
    are next needed. After a finite step and a NaN one the optimizer has taken one step, as
    its ``state_dict()`` says, an explicit ``settle()`` shows, an eager ``step()`` goes on
    from, and a loaded state replaces."""
    batches = mlp_batches(2)
    batches[1] = {"x": batches[1]["x"], "y": torch.full_like(batches[1]["y"], float("nan"))}

    def after_the_nan_step():
        model = mlp().to(DEVICE)
        opt = OPTIMIZERS["adamw"](model.parameters())
        step = compile_train_step(model, opt, mlp_loss, skip_non_finite=True)
        outs = [step(to_device(b)) for b in batches]
        assert [float(o["finite"]) for o in outs] == [1.0, 0.0]
        return model, opt, step

    _, opt, _ = after_the_nan_step()
    saved = copy.deepcopy(opt.state_dict())
    assert {float(s["step"]) for s in saved["state"].values()} == {1.0}
    _, opt, step = after_the_nan_step()
    step.settle()
    assert set(_counts(opt)) == {1.0}
    model, opt, _ = after_the_nan_step()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # eager, from the settled count
    assert set(_counts(opt)) == {2.0}
    _, opt, step = after_the_nan_step()
    saved["state"] = {k: dict(v, step=torch.tensor(7.0)) for k, v in saved["state"].items()}
    opt.load_state_dict(saved)
    step.settle()  # nothing left to put back over the loaded counts
    assert set(_counts(opt)) == {7.0}


def test_skip_non_finite_by_select_as_off_the_cpu_passes_skipped_steps_through(monkeypatch):
    """Off the CPU client a skipped update is undone by a select fused into the update
    (program.skips_by_select); the same program here must skip the same steps."""
    from tpu_train.compile import program

    monkeypatch.setattr(program, "skips_by_select", lambda platform: True)
    step = _skipping_run_passes_the_nan_step_through()
    (entry,) = step.cache.entries.values()
    assert " conditional(" not in entry.executable.as_text()


def test_a_bfloat16_models_metrics_keep_torchs_dtypes():
    """The program returns loss, gradient norm and lr as one float32 vector (one transfer a
    step); a bfloat16 model's gradient norm still comes back in bfloat16, as torch's
    ``clip_grad_norm_`` returns it, and equal to CPU torch's."""
    model = mlp().to(torch.bfloat16)
    batch = {k: v.to(torch.bfloat16) for k, v in mlp_batches(1)[0].items()}
    reference = copy.deepcopy(model)
    loss = mlp_loss(reference, batch)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    (metrics,), _, _, step = run_compiled(model, OPTIMIZERS["adamw"], mlp_loss, [batch],
                                          max_grad_norm=1.0)
    out = step(to_device(batch))
    assert {k: v.dtype for k, v in out.items()} == {
        "loss": torch.float32, "grad_norm": torch.bfloat16, "lr": torch.float32}
    # Each side reduces in float32 and rounds to bfloat16 once: two bfloat16 ulps apart at most.
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=2 ** -7)
    assert metrics["loss"] == pytest.approx(loss.detach().item(), rel=2 ** -7)
    assert metrics["lr"] == pytest.approx(optimizer_lr(OPTIMIZERS["adamw"]))
