"""Numeric tolerances for the tests, derived from the arithmetic, in one place.

A test that compares two implementations of the same float computation (XLA vs PyTorch's CPU
kernels, compiled vs eager) cannot expect equal bits: the two sum in different orders, fuse
differently, and XLA's CPU code generation differs between CPU models. What it can expect is
agreement to within the rounding error of the computation, which depends on the dtype, the
length of the reductions and, for training, on the number of steps and the learning rate —
never on the machine. Each call site says which of those it covers.

Model (all errors are normwise over a whole tensor: ||a - b|| / ||b||, or an RMS per element):

* Unit roundoff ``u = torch.finfo(dtype).eps / 2``: fp32 2^-24, bf16 2^-8, fp16 2^-11. One
  rounded operation is within u of the exact result where it is correctly rounded (the CPU
  client); on a platform whose float32 division / square root are not, measured against
  torch, every rounding bound below counts ``rounding_ulps`` u per rounding instead.
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
* A trained model's cross-entropy (0.5 next to logits of magnitude 10-30) is a difference of
  large terms, lse - z_y: its error is absolute, relative to the logits' size, not to the loss
  (``loss_atol``: the logits' normwise error averaged over the tokens, plus the cross-entropy's
  own exp / log error, which a mean does not average). An untrained model's loss (~log(vocab))
  is not small next to its logits: relative (``loss_rtol``, counting the cross-entropy's
  functions).
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
* Elementwise functions (``elementwise_rtol``): no reduction, so the two implementations differ
  by their functions' own accuracy. Correctly rounded IEEE operations (+ - * / sqrt, casts)
  are within u of the exact result, so a chain of r of them within ~r*u; the transcendental
  functions are polynomial approximations, XLA's own on its CPU/TPU backends (Eigen-style
  minimax polynomials for exp/log/tanh/erf, ...), glibc/Sleef on torch's CPU side, each a few
  u. ``ELEMENTWISE_ULPS`` lists, per function, how many u the XLA lowering and torch's CPU
  kernel are apart: MEASURED ON THE TEST PLATFORM (``TPU_TRAIN_PLATFORM``; the cpu figures
  on x86_64, jax 0.10.2, torch 2.13.0) over a dense sweep (2^18 points) of the domain the
  tests use, by ``scripts/measure_ulps.py`` (the max of |xla - torch| / (u * (1 + |torch|)),
  which is what assert_close(atol=rtol=ulps*u) checks), rounded up, and kept per platform in
  ``measured_ulps/<platform>.json``; other CPUs may pick other code paths, which SAFETY
  covers. bfloat16 / float16 are computed in float32 and rounded to the dtype once per op
  (both sides): two roundings of nearby float32 values are at most one ulp of the dtype
  apart, 2u, per rounding. Elementwise comparisons also need an atol where an output passes
  through zero (sin near pi, x - y cancelling): the rounding error is relative to the size of
  the inputs / intermediates, so each call site uses atol = rtol * that size.
* ``torch.testing.assert_close`` without explicit tolerances uses torch's per-dtype defaults
  (a few ulp of the dtype: derived from its resolution, not a machine); those calls are left
  as they are. tests/ops: the OpInfo harness (tests/ops/opinfo_harness.py) takes each op's
  own per-dtype ``toleranceOverride`` from torch's OpInfo database (derived per dtype by
  PyTorch, kept as they are). lowering_check's default and the tolerances of test_pointwise,
  test_activations, test_reduction, test_matmul and test_conv come from ``elementwise_rtol``
  (elementwise ops) and ``rtol_for`` (reductions, products, convolutions: n the reduction
  length, the inner dimension, or kernel volume x channels), each call site saying which.
  OpInfo gradients (tests/ops/opinfo_harness.py) get the forward's tolerance times sqrt(3)
  (depth 3: the forward's, the backward's and the cotangent's reductions), times the condition
  number of polygamma-type derivatives next to their poles (lgamma, digamma, polygamma).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.platforms import PLATFORM

# One safety factor for every rounding bound in the tests (see the docstring for what it covers).
SAFETY = 4.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the distance from 1.0 to the next float (fp32 2^-24, bf16 2^-8, fp16 2^-11)."""
    return torch.finfo(dtype).eps / 2


def rtol_for(dtype: torch.dtype, reduction: int = 1, depth: int = 1,
             functions: tuple[str, ...] = (), platform: str = PLATFORM) -> float:
    """Relative (normwise) difference between two implementations of one computation in
    ``dtype`` whose longest reduction (sum length / matmul inner dimension) is ``reduction``,
    with ``depth`` such reductions chained: SAFETY * sqrt(depth * reduction) * u * r, r the
    platform's rounding in units of u (``rounding_ulps``). ``functions``: the elementwise
    functions (names of ``measured_ulps``) applied once each along the chain, each adding its
    own measured error, SAFETY * ulps * u(float32) (they are computed in float32): on a TPU
    tanh alone is 399 u, next to a few u of rounding. ``platform``: whose measurements (the
    test platform's unless named)."""
    functions_error = (sum(function_ulps(name, platform) for name in functions)
                       * unit_roundoff(torch.float32))
    return SAFETY * (math.sqrt(depth * max(reduction, 1)) * unit_roundoff(dtype)
                     * rounding_ulps(dtype, platform) + functions_error)


def rounding_ulps(dtype: torch.dtype, platform: str = PLATFORM) -> int:
    """How many u one rounded operation of the test platform is from torch's CPU result: the
    model above counts roundings of u each (correctly rounded + - * / sqrt), which holds on the
    CPU client (1); a TPU's float32 division, reciprocal and square root are not correctly
    rounded (measured 2-3 u), so there each rounding counts ELEMENTWISE_ULPS["arithmetic"].
    16-bit dtypes are computed in float32 and rounded once to the dtype: u of the dtype."""
    if dtype != torch.float32:
        return 1
    return (ELEMENTWISE_ULPS if platform == PLATFORM else load_ulps(platform))["arithmetic"]


# How many u (unit roundoff of float32) the XLA lowering of each elementwise function is from
# torch's CPU kernel, float32, over the tests' domains, per platform: derived from the figures
# scripts/measure_ulps.py measured on it ("vs_torch"), kept in measured_ulps/<platform>.json,
# by one rule for every platform: a group's figure is its worst function's, rounded up.
# "arithmetic" is one correctly rounded operation (1; more where the platform's division or
# reciprocal measures worse); "default" is one function of the "transcendental" group with an
# arithmetic rounding either side (what a lowering written as a short jnp expression does),
# used where a test does not name its function. On the cpu platform (x86_64, jax 0.10.2,
# torch 2.13.0) this gives: arithmetic 1, transcendental 3 (measured up to 2.6), default 5,
# i0 5 (4.5), digamma 21 (20.2, XLA's series vs cephes), lgamma 46 (45.9, absolute, next to the
# zeros at 1 and 2), special 7 (0.4 .. 6.3), modified_bessel_i1 14 (13.6), zeta 6 (5.7),
# igamma 21 (18.9 igamma, 20.1 igammac), polygamma 14, chebyshev 434 (63.8 .. 433.1),
# polynomial 22 (hermite 0: identical code on both sides; laguerre 21.1, legendre 20.5).
MEASURED_ULPS_DIR = Path(__file__).with_name("measured_ulps")
ULPS_GROUPS = {
    "arithmetic": ("reciprocal", "div"),
    "transcendental": ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
                       "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh",
                       "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "sigmoid", "sinc",
                       "pow", "atan2", "hypot", "xlogy"),
    "i0": ("i0",), "digamma": ("digamma",), "lgamma": ("lgamma",),
    # tests/ops/test_special.py's functions over its domains (``measure_ulps.py --special``):
    "special": ("special_erfcx", "special_i0e", "special_i1", "special_i1e", "special_ndtri",
                "special_log_ndtr", "special_modified_bessel_i0",
                "special_spherical_bessel_j0"),
    "modified_bessel_i1": ("special_modified_bessel_i1",),
    "zeta": ("zeta",), "igamma": ("igamma", "igammac"),
    # polygamma(n, x), n = 1..3, in units of u * kappa(x), kappa = 1 + (n+1)|x| / dist(x, Z) for
    # x <= 0 (its condition number next to the poles at the non-positive integers; torch's
    # reflection formula rounds pi*x, so it is only backward stable), 1 for x > 0 (as a plain
    # ulp figure, n = 1 reaches 4e5 next to a pole): "vs_torch_per_kappa".
    "polygamma": ("polygamma_1", "polygamma_2", "polygamma_3"),
    # The orthogonal polynomials of degree -2 .. 11 on x in [-1.2, 1.2], computed by their
    # three-term recurrences.
    "chebyshev": ("chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
                  "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t",
                  "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
                  "shifted_chebyshev_polynomial_w"),
    "polynomial": ("hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
                   "legendre_polynomial_p"),
}


def derive_ulps(measured: dict) -> dict[str, int]:
    """ELEMENTWISE_ULPS from one platform's measurement (the JSON ``measure_ulps.py --out``
    writes): each group's worst float32 "vs_torch" figure, rounded up."""
    figures = {**measured["ulps"], **measured["special"]}
    ulps = {}
    for group, names in ULPS_GROUPS.items():
        key = "vs_torch_per_kappa" if group == "polygamma" else "vs_torch"
        ulps[group] = math.ceil(max(figures[name]["float32"][key] for name in names))
    ulps["arithmetic"] = max(1, ulps["arithmetic"])
    ulps["default"] = ulps["transcendental"] + 2 * ulps["arithmetic"]
    return ulps


def measured_ulps_path(platform: str = PLATFORM) -> Path:
    return MEASURED_ULPS_DIR / f"{platform}.json"


def load_ulps(platform: str = PLATFORM) -> dict[str, int]:
    path = measured_ulps_path(platform)
    if not path.exists():
        raise FileNotFoundError(
            f"no measured accuracy for the {platform} platform (measured_ulps/{path.name}): "
            f"measure it there with TPU_TRAIN_PLATFORM={platform} python scripts/measure_ulps.py"
            f" --out tests/measured_ulps/{platform}.json")
    return derive_ulps(json.loads(path.read_text()))


ELEMENTWISE_ULPS = load_ulps()


def function_ulps(name: str, platform: str = PLATFORM) -> int:
    """One function's figure by the same rule as a group's (its measured float32 "vs_torch",
    rounded up): for a test whose error is that one function's, where its group's worst
    function would not say how far that test's results may be apart (on a TPU float32 tanh
    measures 399 u, its group's worst, xlogy, 2599)."""
    measured = json.loads(measured_ulps_path(platform).read_text())
    figures = {**measured["ulps"], **measured["special"]}
    return math.ceil(figures[name]["float32"]["vs_torch"])


def elementwise_rtol(dtype: torch.dtype, ulps: float | str = 1, roundings: int = 1) -> float:
    """Relative (elementwise) difference between two implementations of an elementwise
    computation with no reduction: SAFETY * ulps * u(compute dtype), ``ulps`` being the
    functions' accuracy in units of u (a number, or a key of ELEMENTWISE_ULPS). A 16-bit
    ``dtype`` is computed in float32 and rounded to ``dtype`` ``roundings`` times (once per op
    of a composite that may be rounded between ops), each rounding up to one ulp (2u) apart
    on the two sides: SAFETY * (ulps * u(float32) + 2 * roundings * u(dtype))."""
    if isinstance(ulps, str):
        ulps = ELEMENTWISE_ULPS[ulps]
    if dtype in (torch.bfloat16, torch.float16):
        return SAFETY * (ulps * unit_roundoff(torch.float32) + 2 * roundings * unit_roundoff(dtype))
    return SAFETY * ulps * unit_roundoff(dtype)


def loss_rtol(dtype: torch.dtype, steps: int, reduction: int, depth: int = 1,
              functions: tuple[str, ...] = ()) -> float:
    """Relative difference of the loss after ``steps`` training steps (linear accumulation of
    each step's rounding; ``steps=1`` is the forward alone); ``functions`` as :func:`rtol_for`'s.
    Relative to the loss: where it is not small next to the logits (an untrained model's
    ~log(vocab)); a trained model's small loss is a difference of large terms
    (:func:`loss_atol`). A cross-entropy counts ``CROSS_ENTROPY_FUNCTIONS``: relative to a
    loss ~log(vocab), the log's absolute error ulps * u * (1 + log s), s <= vocab, is ~its ulps."""
    return max(steps, 1) * rtol_for(dtype, reduction, depth, functions)


# The elementwise functions of a cross-entropy from logits (logsumexp's exp and log).
CROSS_ENTROPY_FUNCTIONS = ("exp", "log")


# The elementwise functions of one Llama decoder layer (tpu_train/models/llama/model.py): the two
# RMSNorms' rsqrt, the attention softmax's exp and SiLU's sigmoid; the model adds its final norm.
LLAMA_LAYER_FUNCTIONS = ("rsqrt", "exp", "sigmoid", "rsqrt")


def llama_functions(layers: int) -> tuple[str, ...]:
    """The elementwise functions along a ``layers``-deep Llama's forward, for ``functions=``."""
    return LLAMA_LAYER_FUNCTIONS * layers + ("rsqrt",)


def cross_entropy_atol(vocab: int, logit_max: float, tokens: int = 1,
                       platform: str = PLATFORM) -> float:
    """Absolute error of a mean over ``tokens`` tokens of the cross-entropy evaluated from given
    float32 logits, lse - z_y with lse = m + log(sum_i exp(z_i - m)), m = max z: each exp's
    relative error (its measured ulps) is the sum's, which its log turns into the same absolute
    error; the log's own error is absolute, ulps * u * (1 + |log s|) (what measure_ulps.py
    measures) with 1 <= s <= vocab. Those are the functions' approximation errors, systematic
    (the same polynomial at every token): a mean over tokens does not average them away. The
    additions round at the logsumexp's magnitude, |lse| <= logit_max + log(vocab), independently
    at each token: that rounding averages as 1 / sqrt(tokens)."""
    log_sum = math.log(vocab)
    functions = function_ulps("exp", platform) + function_ulps("log", platform) * (1 + log_sum)
    rounding = rounding_ulps(torch.float32, platform) * (logit_max + log_sum)
    per_token = functions + rounding / math.sqrt(max(tokens, 1))
    return SAFETY * per_token * unit_roundoff(torch.float32)


def loss_atol(*, reduction: int, depth: int, functions: tuple[str, ...], logit_rms: float,
              logit_max: float, vocab: int, tokens: int, loss: float, steps: int = 1,
              dtype: torch.dtype = torch.float32, matmul_dtype: torch.dtype = torch.float32,
              platform: str = PLATFORM) -> float:
    """Absolute difference of a mean next-token cross-entropy ``loss`` over ``tokens`` labels
    between two implementations (the platform's XLA and torch's CPU kernels), after ``steps``
    training steps (1: the forward alone).

    A trained model's loss is small (0.5) next to its logits (|z| ~ 10-30): lse - z_y is a
    difference of large terms, so its error is relative to the logits, not to the loss.

    * The logits' error, normwise: ``rtol_for`` of the model's longest reduction, depth and
      elementwise ``functions``; where one side rounds its float32 dots' operands to
      ``matmul_dtype`` (bfloat16: a TPU's default matmul precision, one pass, float32
      accumulation) the mixed-precision model's ``rtol_for(matmul_dtype, 1, depth)`` more. Its
      RMS per element: sigma = rtol * ``logit_rms``.
    * One token's loss moves by sum_i p_i dz_i - dz_y = sum_(i != y) p_i dz_i - (1 - p_y) dz_y
      (the logsumexp's gradient is the softmax p): for independent dz its RMS is at most
      sqrt(2) sigma (1 - p_y), and 1 - p_y <= min(1, that token's loss). The mean over
      ``tokens`` tokens averages that to sqrt(2 min(1, loss) / tokens) sigma (independent
      roundings, as rtol_for's sqrt(n)).
    * Plus the cross-entropy's own error (:func:`cross_entropy_atol`, systematic).
    * Training steps: linear accumulation of each step's error (the module docstring), apart
      from the low-precision dots' rounding, which enters each step's loss anew. Adam's
      update errors enter the loss only through elements whose gradient is small (|g_i dp_i|
      <= lr * rtol * RMS(g) each): measured on the base model (lr 5e-4, 2-row batches), a
      1.4e-4 relative gradient error at every step moved the loss by at most 3.3e-5 in 4 steps,
      1 % of the TPU's bound for one forward at full matmul precision (2.8e-3)."""
    averaged = math.sqrt(2 * min(1.0, abs(loss)) / max(tokens, 1)) * logit_rms
    per_step = (averaged * rtol_for(dtype, reduction, depth, functions, platform)
                + cross_entropy_atol(vocab, logit_max, tokens, platform))
    # The low-precision dots' rounding enters each step's loss anew (the weights and the
    # optimizer stay float32: the module docstring's mixed-precision model).
    low_precision = (averaged * rtol_for(matmul_dtype, 1, depth, platform=platform)
                     if matmul_dtype != torch.float32 else 0.0)
    return max(steps, 1) * per_step + low_precision


def update_rtol(dtype: torch.dtype, steps: int, reduction: int, depth: int = 1,
                functions: tuple[str, ...] = ()) -> float:
    """Relative error of the accumulated update p_N - p_0 of an optimizer linear in the
    gradient (SGD with momentum / weight decay) after ``steps`` steps (``functions`` as
    :func:`rtol_for`'s)."""
    return max(steps, 1) * rtol_for(dtype, reduction, depth, functions)


def param_atol(dtype: torch.dtype, lr: float, steps: int, *, reduction: int, numel: int,
               depth: int = 1, functions: tuple[str, ...] = ()) -> float:
    """RMS-per-element tolerance on an Adam/AdamW-trained parameter tensor of ``numel``
    elements after ``steps`` steps at learning rate ``lr`` (peak): each step moves an element
    by ~lr and gets that wrong by at most min(2, sqrt(numel) * rtol) of it (``functions``: as
    :func:`rtol_for`'s, the model's elementwise functions)."""
    per_step = min(2.0, math.sqrt(numel) * rtol_for(dtype, reduction, depth, functions))
    return lr * max(steps, 1) * per_step


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = ""):
    """||actual - expected|| <= rtol * ||expected|| over the whole tensor, in float64."""
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    err = float((a - e).norm() / e.norm().clamp_min(1e-30))
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.2e}"
