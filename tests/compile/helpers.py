"""Shared set-up for compiled-step tests: the same training run on CPU PyTorch (the oracle),
eagerly on the tpu device, and compiled on the tpu device, from identical initial weights."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import tpu_train
from tests import tolerances
from tpu_train.compile import compile_train_step

DEVICE = tpu_train.device(0)


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 5))


def mlp_loss(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def lm_functions(layers: int) -> tuple[str, ...]:
    """The elementwise functions of a ``layers``-deep Llama trained with ``lm_loss`` (its layers'
    and its cross-entropy's), for tests/tolerances' ``functions=``: each adds its measured error
    (on a TPU the cross-entropy's log alone is 1370 u from torch's)."""
    return (*tolerances.llama_functions(layers), *tolerances.CROSS_ENTROPY_FUNCTIONS)


# The elementwise functions of ``mlp`` (GELU's erf, tanh; mlp_loss's mean-squared error has
# none) and of ``tiny_llama`` with ``lm_loss``.
MLP_FUNCTIONS = ("erf", "tanh")
MLP_N = 40  # the reduction of mlp_loss over mlp_batches: a mean over 8 x 5 outputs
TINY_LLAMA_FUNCTIONS = lm_functions(2)


def mlp_batches(n: int, batch: int = 8, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch, 12, generator=g), "y": torch.randn(batch, 5, generator=g)}
            for _ in range(n)]


def _llama(**config):
    from tpu_train.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(**config))
    model.init_weights(seed=0, device="cpu")
    return model


def tiny_llama():
    return _llama(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                  ffn_hidden_dim=176, max_seq_len=32)


def w1_llama():
    """Workload W1 (the one ``scripts/bench_train_step.py`` times): a Llama-style decoder with
    dim 512, 4 layers, 8 heads / 4 kv heads, SwiGLU hidden 1408, vocab 8192, seq 256."""
    return _llama(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192,
                  ffn_hidden_dim=1408, max_seq_len=256)


def lm_loss(model, batch):
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def lm_batches(n: int, batch: int = 2, seq: int = 32, seed: int = 1,
               vocab: int = 128) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append({"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()})
    return out


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=2e-3, betas=(0.8, 0.95), weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01,
                                          nesterov=True),
}


def to_device(batch, device=DEVICE):
    return {k: v.to(device) for k, v in batch.items()}


def run_reference(model, make_opt, loss_fn, batches, *, device, max_grad_norm=None,
                  make_sched=None):
    """An ordinary eager PyTorch loop on ``device``; returns (losses, model, optimizer)."""
    model = copy.deepcopy(model).to(device)
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None
    losses, lrs = [], []
    for batch in batches:
        lrs.append(opt.param_groups[0]["lr"])
        loss = loss_fn(model, to_device(batch, device))
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched:
            sched.step()
        losses.append(float(loss.detach().cpu()))
    return losses, model, opt, lrs


def run_compiled(model, make_opt, loss_fn, batches, *, max_grad_norm=None, make_sched=None,
                 **kwargs):
    """The same loop through compile_train_step; returns (metrics list, model, opt, step)."""
    model = copy.deepcopy(model).to(DEVICE)
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None
    step = compile_train_step(model, opt, loss_fn, scheduler=sched, max_grad_norm=max_grad_norm,
                              **kwargs)
    metrics = [step(to_device(batch)) for batch in batches]
    metrics = [{k: float(v.cpu()) for k, v in m.items()} for m in metrics]
    return metrics, model, opt, step


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` over a whole tensor (CPU, float64)."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def optimizer_lr(make_opt) -> float:
    return make_opt([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]["lr"]


def param_bound(opt_name: str, initial: torch.nn.Module, steps: int, reduction: int,
                dtype: torch.dtype = torch.float32, depth: int = 1,
                functions: tuple[str, ...] = ()):
    """The largest RMS-per-element difference allowed on each parameter after ``steps`` steps of
    OPTIMIZERS[opt_name] (see tests/tolerances.py): Adam/AdamW by lr * steps, SGD relative to the
    accumulated update p_N - p_0 (``initial`` holds p_0); ``functions``: the model's and its
    loss's elementwise functions. Returns bound(name, reference)."""
    if opt_name in ("adam", "adamw"):
        lr = optimizer_lr(OPTIMIZERS[opt_name])
        return lambda name, ref: tolerances.param_atol(dtype, lr, steps, reduction=reduction,
                                                       numel=ref.numel(), depth=depth,
                                                       functions=functions)
    start = {name: p.detach().cpu().double() for name, p in initial.named_parameters()}
    rtol = tolerances.update_rtol(dtype, steps, reduction, depth, functions)
    return lambda name, ref: rtol * _rms(ref.detach().cpu().double() - start[name])


def _rms(t: torch.Tensor) -> float:
    return float(t.norm() / max(t.numel(), 1) ** 0.5)


def assert_params_within(model, reference, bound):
    """Every parameter's RMS difference from the reference within ``bound(name, reference)``
    (e.g. from ``param_bound``)."""
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        limit = bound(name, q)
        err = _rms(p.detach().cpu().double() - q.detach().cpu().double())
        assert err <= limit, f"{name}: RMS difference {err:.2e} > {limit:.2e}"


def assert_params_close(model, reference, rtol: float):
    """Every parameter within ``rtol`` normwise relative error of the reference's."""
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        err = relative_error(p, q)
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.1e}"


def assert_losses_close(actual, expected, rtol: float):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * abs(e), f"step {i + 1}: loss {a} vs {e} (rtol {rtol:.1e})"
