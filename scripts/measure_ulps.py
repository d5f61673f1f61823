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
These figures are a measurement on one CPU: tests/tolerances.py keeps a safety factor over them.

    python scripts/measure_ulps.py [--points 1048576]
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
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.ops.lowering_check import to_jax, to_torch  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=1 << 20)
    args = parser.parse_args()
    result = {}
    for name, (low, high) in {**UNARY, **BINARY}.items():
        result[name] = {}
        for dtype in (torch.float32, torch.bfloat16):
            if name in BINARY:
                (la, ha), (lb, hb) = BINARY[name]
                g = torch.Generator().manual_seed(0)
                inputs = [torch.rand(args.points, generator=g, dtype=torch.float64) * (ha - la) + la,
                          torch.rand(args.points, generator=g, dtype=torch.float64) * (hb - lb) + lb]
            else:
                x = torch.linspace(low, high, args.points, dtype=torch.float64)
                if name in POSITIVE:
                    x = torch.cat([x, torch.linspace(0, 3, args.points, dtype=torch.float64)[1:]])
                inputs = [x]
            result[name][str(dtype).removeprefix("torch.")] = measure(name, inputs, dtype)
    print(json.dumps({"machine": platform.processor() or platform.machine(),
                      "jax": jax.__version__, "torch": torch.__version__, "ulps": result}))


if __name__ == "__main__":
    main()
