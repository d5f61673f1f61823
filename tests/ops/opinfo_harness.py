"""Run PyTorch's own OpInfo database (``op_db``) on the ``tpu`` device against CPU PyTorch.

For one OpInfo entry and dtype, the first ``samples`` inputs from ``op.sample_inputs("cpu", ...)``
are run on CPU (the oracle) and, copied with ``.to("tpu")``, on the tpu device; outputs are moved
back and compared with ``torch.testing.assert_close`` (``equal_nan=True``). With ``grad=True``,
differentiable ops are also run backward: ``torch.autograd.grad`` of the floating outputs with a
fixed random cotangent, on both devices, and the input gradients are compared.

Each (op, variant) gets one status:

* ``pass``: every sample matched;
* ``fail``: the first sample that raised or mismatched, with the first line of the error;
* ``skip``: OpInfo has nothing to test (the dtype is not supported by the op on CPU, no samples
  for it, CPU PyTorch itself raises on the sample (CUDA-only ops), or, for gradients, the op is
  not differentiable at that dtype).

Ops whose output is random (``randn``, ``bernoulli``, dropout, ...) or undefined (``empty``,
``new_empty``, ...) cannot be compared value for value: for those only the structure, shapes and
dtypes of the outputs are compared, and gradients are not checked.

Nothing here raises out of :func:`run_op`: every error is caught and reported as ``fail``.
The CPU fallback (``TPU_TRAIN_CPU_FALLBACK``) is switched off so that a pass means the op ran
through a lowering or a decomposition on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import warnings
from typing import Any, Iterable

os.environ.pop("TPU_TRAIN_CPU_FALLBACK", None)
os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu")

import torch  # noqa: E402
from torch.testing._internal.common_utils import SEED, set_rng_seed  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402

import tpu_train  # noqa: E402,F401  (registers the tpu device)
from tests.tolerances import elementwise_rtol, rtol_for  # noqa: E402

DEVICE = "tpu"
DEFAULT_SAMPLES = 3

# Default tolerances where the OpInfo gives none (tests/tolerances.py): an OpInfo sample is at
# most an L x L tensor (L = 20, torch's sample size "L"), and an op may reduce all of it: a
# reduction of length L * L, computed in float32 for the 16-bit dtypes (ATen's CPU kernels and
# XLA accumulate them in float32), plus one elementwise function of the "default" accuracy
# rounded to the dtype; atol = rtol (OpInfo's inputs are of size ~1).
SAMPLE_REDUCTION = 20 * 20
# Gradients chain the forward's reduction with the backward's and the cotangent's: depth 3,
# so their tolerance is the forward's times sqrt(3) (tests/tolerances.py, rtol_for's depth).
GRAD_DEPTH = 3
GRAD_TOLERANCE_SCALE = math.sqrt(GRAD_DEPTH)
# Gradients that are polygamma functions, ill-conditioned next to their poles at the
# non-positive integers: d/dx lgamma = polygamma(0), d/dx digamma = polygamma(1), d/dx
# polygamma(n) = polygamma(n + 1). Their error there is the measured polygamma accuracy times
# the condition number kappa = 1 + (m + 1)|x| / dist(x, Z) of polygamma(m) (tests/tolerances.py,
# ELEMENTWISE_ULPS["polygamma"]); the tolerance is scaled by kappa's largest value on the sample.
POLYGAMMA_GRADIENT_ORDER = {"lgamma": lambda sample: 0, "digamma": lambda sample: 1,
                            "polygamma": lambda sample: int(sample.args[0]) + 1
                            if sample.args else 1}
# Outputs that are polygamma functions, by the same argument: next to a pole a float32 result
# (CPU's included) is off by its accuracy times kappa, so the forward tolerance is scaled by it.
POLYGAMMA_OUTPUT_ORDER = {"digamma": lambda sample: 0,
                          "polygamma": lambda sample: int(sample.args[0]) if sample.args else 0,
                          "special.polygamma": lambda sample: int(sample.args[0])
                          if sample.args else 0}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for ``dtype`` where the OpInfo gives none: rtol_for(compute dtype,
    SAMPLE_REDUCTION) + elementwise_rtol(dtype, "default"); exact for integers and bool."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0, 0.0
    real = {torch.complex32: torch.float16, torch.complex64: torch.float32,
            torch.complex128: torch.float64}.get(dtype, dtype)
    compute = torch.float32 if real in (torch.float16, torch.bfloat16) else real
    rtol = rtol_for(compute, SAMPLE_REDUCTION) + elementwise_rtol(real, "default")
    return rtol, rtol


DEFAULT_TOLERANCES = {dtype: default_tolerance(dtype) for dtype in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)}

# Ops with random outputs: only structure, shapes and dtypes are compared.
RANDOM_OPS = frozenset({
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
    "uniform", "rand_like", "randn", "randn_like", "randint", "randint_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.rrelu",
    # Its sample trains with dropout_p=0.5 (PyTorch's own test_compare_cpu skips it too);
    # tests/ops/test_transformer.py compares it with the CPU without dropout.
    "nn.functional.multi_head_attention_forward",
})

# Ops whose positional arguments (beyond the input) must stay on the CPU, as torch requires.
CPU_ARGS_OPS = frozenset({"tensor_split"})


class OracleError(Exception):
    """CPU PyTorch itself rejected the sample (e.g. CUDA-only ops): nothing to compare."""


def op_key(op) -> str:
    """``name`` or ``name.variant``: the identifier used in reports and the known-failures list."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def all_ops() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def compares_values(op) -> bool:
    """False for ops with random or undefined outputs (compared by shape and dtype only)."""
    key = op_key(op)
    return not (key in RANDOM_OPS or op.name in RANDOM_OPS or op.has_nondeterministic_output)


@dataclasses.dataclass
class Result:
    op: str
    status: str  # "pass" | "fail" | "skip"
    error: str = ""
    samples: int = 0
    values_compared: bool = True
    seconds: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def tolerances(op, dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol): the loosest toleranceOverride the OpInfo declares for ``dtype`` in any of its
    decorators, but never tighter than the defaults (``default_tolerance``)."""
    atol, rtol = default_tolerance(dtype)
    for decorate_info in getattr(op, "decorators", ()) or ():
        decorators = getattr(decorate_info, "decorators", (decorate_info,))
        for decorator in decorators:
            overrides = getattr(decorator, "d", None)
            if isinstance(overrides, dict) and dtype in overrides:
                tol = overrides[dtype]
                if hasattr(tol, "atol") and hasattr(tol, "rtol"):
                    atol, rtol = max(atol, tol.atol), max(rtol, tol.rtol)
    return atol, rtol


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    message = lines[0] if lines else ""
    # assert_close puts the useful part ("Mismatched elements: ...") on the following lines.
    if isinstance(exc, AssertionError) and len(lines) > 1:
        message = " ".join(lines[:3])
    # The device's "not implemented" errors end with advice on the CPU fallback: drop it.
    message = message.split(" Set TPU_TRAIN_CPU_FALLBACK")[0]
    line = f"{type(exc).__name__}: {message}"
    return line if len(line) <= 300 else line[:297] + "..."


def _is_cpu_device(value) -> bool:
    return (isinstance(value, torch.device) and value.type == "cpu") or value == "cpu"


def to_device(tree, device: str = DEVICE):
    """Copy every tensor in ``tree`` to ``device`` (gradient-requiring ones as new leaves);
    ``device="cpu"`` arguments (factory functions) are pointed at the device too."""

    def move(value):
        if isinstance(value, torch.Tensor):
            moved = value.detach().to(device)
            if value.requires_grad:
                moved.requires_grad_(True)
            return moved
        if isinstance(value, torch.device) and value.type == "cpu":
            return torch.device(device)
        return value

    return tree_map(move, tree)


def _device_kwargs(kwargs: dict, device: str) -> dict:
    moved = to_device(kwargs, device)
    if "device" in moved and _is_cpu_device(moved["device"]):
        moved["device"] = device
    return moved


def to_cpu(tree):
    return tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, tree)


def _compare(actual, expected, atol: float, rtol: float, values: bool, what: str) -> None:
    actual_leaves, actual_spec = tree_flatten(actual)
    expected_leaves, expected_spec = tree_flatten(expected)
    if len(actual_leaves) != len(expected_leaves):
        raise AssertionError(f"{what}: {len(actual_leaves)} outputs, CPU gives "
                             f"{len(expected_leaves)}")
    for i, (got, want) in enumerate(zip(actual_leaves, expected_leaves)):
        where = f"{what}[{i}]" if len(expected_leaves) > 1 else what
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                raise AssertionError(f"{where}: got {type(got).__name__}, CPU gives a tensor")
            if got.shape != want.shape or got.dtype != want.dtype:
                raise AssertionError(f"{where}: {got.dtype}{list(got.shape)}, CPU gives "
                                     f"{want.dtype}{list(want.shape)}")
            if not values or want.layout != torch.strided:
                continue
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True,
                                       check_device=False, check_stride=False,
                                       msg=lambda m, where=where: f"{where}: {m}")
        elif values and isinstance(want, (bool, int, float, complex)):
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=True,
                                       check_dtype=False,
                                       msg=lambda m, where=where: f"{where}: {m}")
        elif values and want is None and got is not None:
            raise AssertionError(f"{where}: got {type(got).__name__}, CPU gives None")


def _grad_inputs(sample) -> list:
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _grad_outputs(output) -> list:
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad
            and (t.is_floating_point() or t.is_complex())]


def _run_grad(op, sample, cotangents) -> list:
    output = sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))
    outputs = _grad_outputs(output)
    inputs = _grad_inputs(sample)
    if not outputs or not inputs:
        return []
    if cotangents is None:
        return outputs, inputs
    device = outputs[0].device
    grads = torch.autograd.grad(outputs, inputs,
                                [c.to(device) for c in cotangents[:len(outputs)]],
                                allow_unused=True)
    return list(grads)


def _check_sample_forward(op, sample, dtype) -> None:
    # Copy to the device before the CPU run, in case the op writes into its inputs.
    dev_input = to_device(sample.input)
    dev_args = sample.args if op.name in CPU_ARGS_OPS else to_device(sample.args)
    dev_kwargs = _device_kwargs(sample.kwargs, DEVICE)
    # Both results go through the sample's output_process_fn_grad, as in PyTorch's own
    # device-vs-CPU comparison (test_compare_cpu): for ops whose results are defined up to a
    # choice (eigenvector and singular vector signs) it keeps what is well defined.
    try:
        expected = sample.output_process_fn_grad(op(sample.input, *sample.args,
                                                    **sample.kwargs))
    except Exception as exc:  # noqa: BLE001
        raise OracleError(_first_line(exc)) from exc
    actual = sample.output_process_fn_grad(op(dev_input, *dev_args, **dev_kwargs))
    atol, rtol = tolerances(op, dtype)
    scale = _polygamma_condition(POLYGAMMA_OUTPUT_ORDER.get(op.name), sample)
    _compare(to_cpu(actual), expected, atol * scale, rtol * scale, compares_values(op), "output")


def _check_sample_grad(op, sample, dtype, seed: int) -> bool:
    """Compare input gradients; False when the sample has nothing to differentiate."""
    from torch.testing._internal.opinfo.core import SampleInput

    try:
        expected_pair = _run_grad(op, sample, None)
    except Exception as exc:  # noqa: BLE001
        raise OracleError(_first_line(exc)) from exc
    if not expected_pair:
        return False
    outputs, _ = expected_pair
    generator = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in outputs]
    # Fresh CPU run for the oracle (the first one only found the outputs).
    expected = _run_grad(op, sample, cotangents)
    args = sample.args if op.name in CPU_ARGS_OPS else to_device(sample.args)
    device_sample = SampleInput(to_device(sample.input), args=args,
                                kwargs=_device_kwargs(sample.kwargs, DEVICE),
                                output_process_fn_grad=sample.output_process_fn_grad)
    actual = _run_grad(op, device_sample, cotangents)
    atol, rtol = tolerances(op, dtype)
    scale = GRAD_TOLERANCE_SCALE * _polygamma_condition(POLYGAMMA_GRADIENT_ORDER.get(op.name),
                                                        sample)
    _compare(to_cpu(actual), expected, atol * scale, rtol * scale, True, "grad")
    return True


def _polygamma_condition(order, sample) -> float:
    """The largest condition number on the sample of polygamma(``order(sample)``), the function
    compared (1 where ``order`` is None: most ops)."""
    x = sample.input
    if order is None or not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return 1.0
    m = order(sample)
    x = x.detach().double()
    distance = (x - x.round()).abs().clamp_min(torch.finfo(torch.float64).tiny)
    kappa = torch.where(x <= 0, 1 + (m + 1) * x.abs() / distance, torch.ones_like(x))
    return float(kappa.max()) if kappa.numel() else 1.0


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _samples(op, dtype, requires_grad: bool, limit: int) -> Iterable:
    """The first ``limit`` of ``op.sample_inputs("cpu", dtype, requires_grad=...)``.

    ``OpInfo.sample_inputs`` wraps its generator in torch's ``TrackedInputIter``, which looks
    for the calling ``unittest.TestCase`` method with ``inspect.stack()`` (twice per call,
    ~0.15 s each under pytest: most of this sweep's time). Called from here it finds none and
    seeds torch's RNGs with ``common_utils.SEED`` before each sample, which is what this does.
    """
    samples = iter(op.sample_inputs_func(op, "cpu", dtype, requires_grad))
    for _ in range(limit):
        set_rng_seed(SEED)
        try:
            yield next(samples)
        except StopIteration:
            return


def run_op(op, dtype: torch.dtype = torch.float32, *, samples: int = DEFAULT_SAMPLES,
           grad: bool = False) -> Result:
    """Forward (``grad=False``) or gradient (``grad=True``) check of one OpInfo entry."""
    key = op_key(op)
    start = time.perf_counter()
    values = compares_values(op)

    def done(status, error="", n=0):
        return Result(key, status, error, n, values, round(time.perf_counter() - start, 3))

    try:
        if dtype not in op.supported_dtypes("cpu"):
            return done("skip", f"{dtype} not supported by the op on CPU")
        if grad:
            if not op.supports_autograd:
                return done("skip", "not differentiable")
            if not values:
                return done("skip", "random output: gradients not compared")
            if dtype not in op.supported_backward_dtypes("cpu"):
                return done("skip", f"no backward for {dtype} on CPU")
    except Exception as exc:  # noqa: BLE001
        return done("fail", "OpInfo: " + _first_line(exc))

    n = 0
    checked = 0
    torch.manual_seed(0)
    try:
        with _quiet():
            for n, sample in enumerate(_samples(op, dtype, grad, samples), start=1):
                if grad:
                    checked += _check_sample_grad(op, sample, dtype, seed=n)
                else:
                    _check_sample_forward(op, sample, dtype)
                    checked += 1
    except OracleError as exc:
        return done("skip", f"sample {n}: CPU PyTorch raised {exc}", n)
    except Exception as exc:  # noqa: BLE001  (anything the op raises is a result)
        return done("fail", f"sample {n}: " + _first_line(exc), n)
    if checked == 0:
        return done("skip", "no samples" if n == 0 else "no differentiable samples", n)
    return done("pass", "", n)


def find_op(key: str):
    for op in all_ops():
        if op_key(op) == key:
            return op
    raise KeyError(key)


def sweep(ops=None, dtype: torch.dtype = torch.float32, *, samples: int = DEFAULT_SAMPLES,
          grad: bool = False, progress=None) -> list[Result]:
    results = []
    for op in (ops if ops is not None else all_ops()):
        result = run_op(op, dtype, samples=samples, grad=grad)
        results.append(result)
        if progress is not None:
            progress(result)
    return results


def summarize(results: list[Result]) -> dict[str, Any]:
    total = len(results)
    passed = sum(r.status == "pass" for r in results)
    failed = sum(r.status == "fail" for r in results)
    skipped = sum(r.status == "skip" for r in results)
    tested = passed + failed
    return {
        "total": total,
        "pass": passed,
        "fail": failed,
        "skip": skipped,
        "pass_rate": round(passed / total, 4) if total else 0.0,
        "pass_rate_tested": round(passed / tested, 4) if tested else 0.0,
    }
