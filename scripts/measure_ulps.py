#!/usr/bin/env python
"""Measure how far the JAX lowerings of the elementwise transcendental functions (XLA's CPU
backend) are from PyTorch on CPU, in units of the dtype's unit roundoff u.

For each function a dense sweep of inputs over the domain the tests use (tests/ops) is run
through the lowering (as tests/ops/lowering_check.py does) and through torch on CPU, and the
float64 result of torch is the reference. Reported per function and dtype, all as the max
over the sweep of |y - r| / (u * (1 + |r|)), i.e. the ``ulps`` that
``assert_close(atol=ulps*u, rtol=ulps*u)`` needs (the atol part covers outputs that pass
through zero, where a relative error is meaningless):

* ``vs_torch``: lowering against torch (what the tests compare);
* ``xla``, ``torch``: each against the float64 reference.

Prints one JSON line, {"machine": ..., "jax": ..., "torch": ..., "ulps": {name: {dtype: {...}}}}.
These figures are a measurement on one machine: tests/tolerances.py keeps a safety factor over them.
``--special`` measures instead the special functions of tests/ops/test_special.py (float32, the
dtype those tests use) over that file's domains.

The lowerings run on the platform ``TPU_TRAIN_PLATFORM`` names (cpu unless set). ``--out FILE``
measures both sets and writes them as one JSON object, the file tests/tolerances.py derives the
platform's tolerances from (tests/measured_ulps/<platform>.json; docs/testing.md)::

    python scripts/measure_ulps.py [--points 262144] [--special]
    TPU_TRAIN_PLATFORM=tpu python scripts/measure_ulps.py --out tests/measured_ulps/tpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu")

import jax  # noqa: E402
import torch  # noqa: E402

from tests.ops.lowering_check import to_jax, to_torch  # noqa: E402
from tpu_train.device import runtime  # noqa: E402
from tpu_train.ops import pointwise, special  # noqa: E402,F401  (registers the lowerings)
from tpu_train.ops.registry import aten, get_lowering  # noqa: E402

# Domains as in tests/ops/test_pointwise.py::test_float_unary.
UNARY = {name: (-3.0, 3.0) for name in (
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal",
    "sin", "cos", "tan", "atan", "sinh", "cosh", "tanh", "asinh", "erf", "erfc",
    "sigmoid", "lgamma", "digamma", "i0", "sinc")}
UNARY.update({"asin": (-0.9, 0.9), "acos": (-0.9, 0.9), "atanh": (-0.9, 0.9),
              "erfinv": (-0.9, 0.9), "acosh": (1.1, 5.0)})
POSITIVE = {"log", "log2", "log10", "sqrt", "rsqrt"}  # also swept over (0, 3]
BINARY = {"pow": ((0.0, 3.0), (0.0, 3.0)), "atan2": ((-4.0, 4.0), (1.0, 5.0)),
          "hypot": ((-4.0, 4.0), (1.0, 5.0)), "xlogy": ((-4.0, 4.0), (1.0, 5.0)),
          "div": ((-4.0, 4.0), (1.0, 5.0))}


# tests/ops/test_special.py's functions and domains: name -> (overload, [(low, high) per
# tensor argument], scalar arguments placed first / last, integer-valued arguments).
SPECIAL = {name: (getattr(aten, name).default, [dom]) for name, dom in {
    "special_erfcx": (-3.0, 10.0), "special_i0e": (-10.0, 10.0), "special_i1": (-8.0, 8.0),
    "special_i1e": (-10.0, 10.0), "special_ndtri": (0.01, 0.99), "special_log_ndtr": (-10.0, 5.0),
    "special_modified_bessel_i0": (-8.0, 8.0), "special_modified_bessel_i1": (-8.0, 8.0),
    "special_spherical_bessel_j0": (-20.0, 20.0)}.items()}
POLYNOMIALS = ["chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
               "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t",
               "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
               "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he",
               "laguerre_polynomial_l", "legendre_polynomial_p"]


def special_inputs(name: str, points: int) -> list[tuple]:
    """(overload, args) sweeps for one special function (float64 tensors, cast later)."""
    g = torch.Generator().manual_seed(0)

    def uniform(low, high):
        return torch.rand(points, generator=g, dtype=torch.float64) * (high - low) + low

    if name in SPECIAL:
        overload, [(low, high)] = SPECIAL[name]
        return [(overload, [torch.linspace(low, high, points, dtype=torch.float64)])]
    if name.startswith("polygamma"):  # polygamma_1 .. _3 over (-9.5, 9.5)
        n = int(name.rsplit("_", 1)[1])
        return [(aten.polygamma.default, [n, torch.linspace(-9.5, 9.5, points, dtype=torch.float64)])]
    if name == "zeta":  # zeta(3, q), q in (0.2, 5); zeta(x, 2), x in (1.5, 6)
        q = torch.linspace(0.2, 5.0, points, dtype=torch.float64)
        return [(aten.special_zeta.default, [torch.full_like(q, 3.0), q]),
                (aten.special_zeta.other_scalar,
                 [torch.linspace(1.5, 6.0, points, dtype=torch.float64), 2.0])]
    if name in ("igamma", "igammac"):  # a in (0.1, 5), x in (0, 6)
        return [(getattr(aten, name).default, [uniform(0.1, 5.0), uniform(0.0, 6.0)])]
    # The orthogonal polynomials: x in (-1.2, 1.2) against degrees -2 .. 11, as test_polynomials.
    packet = getattr(aten, f"special_{name}")
    x = torch.linspace(-1.2, 1.2, max(points // 14, 2), dtype=torch.float64)
    n = torch.arange(-2, 12, dtype=torch.float64)
    xs, ns = torch.broadcast_tensors(x[:, None], n[None, :])
    return [(packet.default, [xs.flatten(), ns.flatten()]), (packet.n_scalar, [x, 3]),
            (packet.x_scalar, [0.25, n])]


def measure_special(name: str, points: int) -> dict:
    u = torch.finfo(torch.float32).eps / 2
    worst = {"vs_torch": 0.0, "xla": 0.0, "torch": 0.0}
    for overload, args in special_inputs(name, points):
        xs = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        cpu = overload(*xs)
        got = to_torch(get_lowering(overload).fn(*[to_jax(x) for x in xs]), cpu.dtype)
        ref = overload(*[a.double() if isinstance(a, torch.Tensor) else a for a in xs])
        for key, (y, r) in {"vs_torch": (got, cpu.double()), "xla": (got, ref), "torch": (cpu, ref)}.items():
            worst[key] = max(worst[key], round(score(y, r, u), 2))
        if overload is aten.polygamma.default:
            # In units of u * kappa(x), kappa = 1 + (n+1)|x| / dist(x, Z) for x <= 0 (the
            # condition number next to the poles; see ELEMENTWISE_ULPS["polygamma"]).
            n, x = args[0], xs[1].double()
            kappa = torch.where(x <= 0, 1 + (n + 1) * x.abs() / (x - x.round()).abs(), torch.ones_like(x))
            y, r = got.double(), cpu.double()
            ok = torch.isfinite(y) & torch.isfinite(r) & torch.isfinite(kappa)
            err = (y - r).abs()[ok] / (u * (1 + r.abs()[ok]) * kappa[ok])
            worst["vs_torch_per_kappa"] = round(float(err.max()), 2)
    return {"float32": worst}


def score(y: torch.Tensor, ref: torch.Tensor, u: float) -> float:
    y, ref = y.double(), ref.double()
    ok = torch.isfinite(ref) & torch.isfinite(y)
    err = (y - ref).abs()[ok] / (u * (1 + ref.abs()[ok]))
    return float(err.max()) if err.numel() else 0.0


def measure(name: str, inputs: list[torch.Tensor], dtype: torch.dtype) -> dict:
    op = getattr(aten, name)
    overload = {"pow": "Tensor_Tensor", "xlogy": "Tensor", "div": "Tensor"}.get(name, "default")
    overload = getattr(op, overload)
    u = torch.finfo(dtype).eps / 2
    xs = [x.to(dtype) for x in inputs]
    cpu = overload(*xs)
    got = to_torch(get_lowering(overload).fn(*[to_jax(x) for x in xs]), cpu.dtype)
    ref = overload(*[x.double() for x in xs])
    return {"vs_torch": round(score(got, cpu.double(), u), 2),
            "xla": round(score(got, ref, u), 2), "torch": round(score(cpu, ref, u), 2)}


def measure_elementwise(points: int) -> dict:
    result = {}
    for name, (low, high) in {**UNARY, **BINARY}.items():
        result[name] = {}
        for dtype in (torch.float32, torch.bfloat16):
            if name in BINARY:
                (la, ha), (lb, hb) = BINARY[name]
                g = torch.Generator().manual_seed(0)
                inputs = [torch.rand(points, generator=g, dtype=torch.float64) * (ha - la) + la,
                          torch.rand(points, generator=g, dtype=torch.float64) * (hb - lb) + lb]
            else:
                x = torch.linspace(low, high, points, dtype=torch.float64)
                if name in POSITIVE:
                    x = torch.cat([x, torch.linspace(0, 3, points, dtype=torch.float64)[1:]])
                inputs = [x]
            result[name][str(dtype).removeprefix("torch.")] = measure(name, inputs, dtype)
    return result


SPECIAL_NAMES = [*SPECIAL, "polygamma_1", "polygamma_2", "polygamma_3", "zeta", "igamma", "igammac",
                 *POLYNOMIALS]


def provenance() -> dict:
    return {"platform": runtime.platform(), "device_kind": runtime.device_kind(0),
            "machine": platform.processor() or platform.machine(),
            "jax": jax.__version__, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 2^18: the sweep tests/tolerances.py's derivation rule was set on (denser sweeps find a
    # slightly worse point in the worst functions: digamma 23.0 u at 2^20 against 20.2).
    parser.add_argument("--points", type=int, default=1 << 18)
    parser.add_argument("--special", action="store_true", help="tests/ops/test_special.py's functions")
    parser.add_argument("--out", type=Path, default=None,
                        help="measure both sets and write them here as one JSON object")
    args = parser.parse_args()
    # The lowerings' arrays (to_jax) land on JAX's default device: the platform's first one.
    with jax.default_device(runtime.jax_device(0)):
        if args.out is not None:
            measured = {**provenance(), "points": args.points,
                        "ulps": measure_elementwise(args.points),
                        "special": {name: measure_special(name, args.points)
                                    for name in SPECIAL_NAMES}}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(measured, indent=1) + "\n")
            print(f"wrote {args.out}")
            return
        if args.special:
            result = {name: measure_special(name, args.points) for name in SPECIAL_NAMES}
        else:
            result = measure_elementwise(args.points)
    print(json.dumps({"machine": platform.processor() or platform.machine(),
                      "jax": jax.__version__, "torch": torch.__version__, "ulps": result}))


if __name__ == "__main__":
    main()
