"""Numeric tolerances for the tests, derived from the arithmetic, in one place.

A test that compares two implementations of the same float computation (XLA vs PyTorch's CPU
kernels, compiled vs eager) cannot expect equal bits: the two sum in different orders, fuse
differently, and XLA's CPU code generation differs between CPU models. What it can expect is
agreement to within the rounding error of the computation, which depends on the dtype, the
length of the reductions and, for training, on the number of steps and the learning rate —
never on the machine. Each call site says which of those it covers.

Model (all errors are normwise over a whole tensor: ||a - b|| / ||b||, or an RMS per element):

* Unit roundoff ``u = torch.finfo(dtype).eps / 2``: fp32 2^-24, bf16 2^-8, fp16 2^-11.
* A reduction of length n (a sum, a dot product, a matmul with inner dimension n). The
  worst-case bound gamma_n = n*u / (1 - n*u) assumes every rounding error has the same sign;
  rounding errors behave like independent zero-mean variables, so the error grows like
  sqrt(n)*u (Higham & Mary, "A new approach to probabilistic rounding error analysis", SIAM J.
  Sci. Comput. 2019). A normwise comparison averages over many elements, so it sits at that
  typical value, not in its tail. We use ``SAFETY * sqrt(n) * u``, with n the LONGEST reduction
  in the computation; SAFETY (below, stated once) covers the two implementations' independent
  errors (sqrt(2)), a handful of chained reductions adding in quadrature, and the elementwise
  ops between them (exp, rsqrt, ... a few ulp each). For a long chain of reductions (deep
  networks), pass depth: the errors add in quadrature, sqrt(depth * n) * u.
* Training for N steps. Each step's rounding moves the parameters a little; with a stable
  trajectory (small learning rate) later steps neither undo nor amplify that, so the errors
  accumulate at most linearly in N (measured on the tiny Llama: parameter error / (lr * N)
  stays flat from 5 to 40 steps, loss error grows sub-linearly). Losses: ``N * rtol``.
* Optimizers linear in the gradient (SGD, momentum, weight decay): the update's relative error
  is the gradient's, so the accumulated update U = p_N - p_0 satisfies
  ||dU|| <= N * rtol * ||U|| (``update_rtol``).
* Adam/AdamW divide by sqrt(v)+eps, so each element's update is ~lr whatever its gradient's
  size: the gradient's absolute error (normwise: rtol * the tensor's RMS gradient) is divided
  by that element's |g|. An element whose gradient is a fraction r of the RMS gets relative
  error rtol / r; among numel roughly Gaussian gradients the smallest is r ~ 1/numel, so the
  RMS over the tensor of the update error is ~ rtol * sqrt(numel) (in units of lr), capped at 2
  (a noise-dominated gradient flips sign). Parameters are therefore compared with an absolute
  RMS tolerance relative to the total update size lr * N: ``param_atol``.
* Mixed precision (autocast to bf16/fp16, FSDP's bf16 compute) against float32, or two
  mixed-precision implementations: the products round their inputs and outputs to the low
  dtype but accumulate in float32 (softmax, cross-entropy and norms run in float32), so each
  contributes a few low-precision roundings whatever its length: ``rtol_for(dtype, 1, depth)``
  with depth the number of chained layers. The master weights and the optimizer stay float32,
  so that rounding enters each step's loss anew rather than accumulating: the loss is
  compared with ``loss_rtol(dtype, 1, 1, depth)`` at every step (the trajectory moves only by
  lr x the gradient's error; measured on W1, lr 1e-4, the bf16 loss is 1e-5 from float32 at
  step 1 and 1e-3 at step 20, against a bound of 3.1e-2).
* Sampling tolerances (frequencies of random draws, statistics of an initialization) are not
  rounding errors: those tests derive them from the standard error of the estimate.
* ``torch.testing.assert_close`` without explicit tolerances uses torch's per-dtype defaults
  (a few ulp of the dtype: derived from its resolution, not a machine); those calls are left
  as they are. The OpInfo harness (tests/ops/opinfo_harness.py) takes each op's own
  per-dtype ``toleranceOverride`` from torch's OpInfo database, but its fallback
  DEFAULT_TOLERANCES and GRAD_TOLERANCE_SCALE, lowering_check's default, test_pointwise's
  ``tolerance(dtype)`` (shared by the pointwise and reduction tests) and the linear-algebra
  tolerances are still hand-picked per dtype, not yet derived here; test_matmul's products
  are (``tolerances(dtype, k)`` there).
"""

from __future__ import annotations

import math

import torch

# One safety factor for every rounding bound in the tests (see the docstring for what it covers).
SAFETY = 4.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the distance from 1.0 to the next float (fp32 2^-24, bf16 2^-8, fp16 2^-11)."""
    return torch.finfo(dtype).eps / 2


def rtol_for(dtype: torch.dtype, reduction: int = 1, depth: int = 1) -> float:
    """Relative (normwise) difference between two implementations of one computation in
    ``dtype`` whose longest reduction (sum length / matmul inner dimension) is ``reduction``,
    with ``depth`` such reductions chained: SAFETY * sqrt(depth * reduction) * u."""
    return SAFETY * math.sqrt(depth * max(reduction, 1)) * unit_roundoff(dtype)


def loss_rtol(dtype: torch.dtype, steps: int, reduction: int, depth: int = 1) -> float:
    """Relative difference of the loss after ``steps`` training steps (linear accumulation of
    each step's rounding; ``steps=1`` is the forward alone)."""
    return max(steps, 1) * rtol_for(dtype, reduction, depth)


def update_rtol(dtype: torch.dtype, steps: int, reduction: int, depth: int = 1) -> float:
    """Relative error of the accumulated update p_N - p_0 of an optimizer linear in the
    gradient (SGD with momentum / weight decay) after ``steps`` steps."""
    return max(steps, 1) * rtol_for(dtype, reduction, depth)


def param_atol(dtype: torch.dtype, lr: float, steps: int, *, reduction: int, numel: int,
               depth: int = 1) -> float:
    """RMS-per-element tolerance on an Adam/AdamW-trained parameter tensor of ``numel``
    elements after ``steps`` steps at learning rate ``lr`` (peak): each step moves an element
    by ~lr and gets that wrong by at most min(2, sqrt(numel) * rtol) of it."""
    per_step = min(2.0, math.sqrt(numel) * rtol_for(dtype, reduction, depth))
    return lr * max(steps, 1) * per_step


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = ""):
    """||actual - expected|| <= rtol * ||expected|| over the whole tensor, in float64."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    err = float((a - e).norm() / e.norm().clamp_min(1e-30))
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.2e}"
