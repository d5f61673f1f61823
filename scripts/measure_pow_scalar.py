#!/usr/bin/env python
"""Measure ``number ** tensor`` (aten.pow.Scalar) on the device against float64 NumPy.

For each base, the max error in float32 ulps (spacing at the exact value) and how many results
are off by more than half an ulp, over whole exponents 1..2000 and some large and negative ones
(results in float32's normal range only: XLA flushes subnormals), of

* ``device``: ``base ** torch.arange(...)`` on the tpu device (the lowering: whole exponents
  by float-float multiplication, tpu_train/ops/scalar_power.py), against the base's double
  value;
* ``jnp_power``: plain ``jnp.power(float32(base), e)`` on the same platform, against the power
  of the base's float32 value (PyTorch's own pow rounds the base to float32 first), i.e. the
  platform's pow error alone;

and RAdam's rho_t = rho_inf - 2 t b**t / (1 - b**t) for b = 0.999 at steps 1..10 as the
compiled step computes it (float32 tensors on the device) and in float64: the rectified branch
is taken where rho_t > 5 (rho_5 = 4.996). Also the eager time of one call and its copy to the host,
scalar and 1M-element exponents, for the lowering and for jnp.power.

Prints one JSON line. The lowerings run on the platform ``TPU_TRAIN_PLATFORM`` names (cpu
unless set), in this one process::

    python scripts/measure_pow_scalar.py
    TPU_TRAIN_PLATFORM=tpu python scripts/measure_pow_scalar.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TPU_TRAIN_PLATFORM", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import tpu_train  # noqa: E402

BASES = [0.999, 0.9, 0.95, 0.99, 0.9999, 1.0001, 2.0, -0.5, 1e-3, 10.0, -1.1]
EXPONENTS = np.concatenate([np.arange(1, 2001), [4096, 12345, 10**5, 2**20 + 1, 2**23, 2**24],
                            -np.arange(1, 101), [-1000, -(10**5)]]).astype(np.float32)
TINY, HUGE = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in units of float32's spacing at ``exact`` (normal numbers)."""
    _, exponent = np.frexp(exact)
    return np.abs(got.astype(np.float64) - exact) / np.ldexp(1.0, exponent - 24)


def summary(got: np.ndarray, exact: np.ndarray) -> dict:
    normal = (np.abs(exact) >= TINY) & (np.abs(exact) <= HUGE)
    error = ulps(got[normal], exact[normal])
    return {"max_ulps": round(float(error.max()), 4), "over_half": int((error > 0.5).sum()),
            "n": int(normal.sum())}


def timed(fn, repeats: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return round((time.perf_counter() - start) / repeats * 1e6, 1)


def main() -> None:
    device = tpu_train.device(0)
    exponent = torch.from_numpy(EXPONENTS).to(device)
    jax_exponent = jnp.asarray(EXPONENTS)
    plain = jax.jit(lambda b, e: jnp.power(b, e))
    errors = {}
    with np.errstate(over="ignore", under="ignore"):
        for base in BASES:
            exact = np.power(np.float64(base), EXPONENTS.astype(np.float64))
            exact32 = np.power(np.float64(np.float32(base)), EXPONENTS.astype(np.float64))
            got = (base ** exponent).cpu().numpy()
            reference = np.asarray(plain(jnp.float32(base), jax_exponent))
            errors[repr(base)] = {"device": summary(got, exact),
                                  "jnp_power": summary(reference, exact32)}

    beta2 = 0.999
    rho_inf = 2 / (1 - beta2) - 1
    step = torch.arange(1, 11, dtype=torch.float32).to(device)
    power = beta2 ** step
    rho = (rho_inf - 2 * step * power / (1 - power)).cpu().tolist()
    exact_rho = [rho_inf - 2 * t * beta2 ** t / (1 - beta2 ** t) for t in range(1, 11)]

    timing = {}
    for size in (1, 1 << 20):
        e = torch.randint(1, 3000, (size,)).float().to(device)
        je = jnp.asarray(np.random.default_rng(0).integers(1, 3000, size).astype(np.float32))
        timing[str(size)] = {
            "device_us": timed(lambda: (0.999 ** e).cpu()),
            "jnp_power_us": timed(lambda: np.asarray(plain(jnp.float32(0.999), je)))}
    print(json.dumps({
        "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
        "errors": errors,
        "radam_rho": {"device": [round(r, 5) for r in rho],
                      "float64": [round(r, 5) for r in exact_rho],
                      "rectified_device": [r > 5 for r in rho],
                      "rectified_float64": [r > 5 for r in exact_rho]},
        "eager_time": timing}))


if __name__ == "__main__":
    main()
