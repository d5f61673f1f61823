"""Eager per-op latency on the ``tpu`` device against direct pre-jitted JAX calls.

Exact command (from the repository root)::

    python scripts/bench_eager.py                 # --repeats 7
    python scripts/bench_eager.py --quick         # a smoke run (tiny batches), not a measurement
    python scripts/bench_eager.py --profile 2000   # also a cProfile table of small adds (stderr)
    python scripts/bench_eager.py --floor          # also what a Python-subclass device pays per add

Two measurements (three with ``--floor``), each interleaved A/B in one process (timings on a shared machine swing):

* **per-op latency**: add / matmul / softmax on float32 ``[n, n]`` operands, ``n`` = 128
  (small) and 1024 (medium). One *batch* is ``K`` back-to-back dependent ops
  (``x = op(x, y)``), then a wait on the last result, so asynchronous dispatch is paid for.
  A = torch ops on tpu tensors (the eager device path), B = the same computation as a
  ``jax.jit`` function, warmed up, called directly on ``jax.Array`` s of the same shape and
  dtype. Reported per case: min and median microseconds per op of A and B and the ratios
  A/B (of the mins and of the medians).
* **eager training step**: forward + backward + ``AdamW.step`` of a one-layer Llama block
  (dim 256, 4 heads, SwiGLU, RMSNorm, causal SDPA; batch 2, seq 64) on tpu vs the same model
  on torch CPU (reference only), min and median seconds per step; each tpu step waits for its
  loss and every parameter.

* ``--floor`` (the ``floor`` entry): a 128² add chain through stand-in subclasses that do less
  and less of an op (:func:`_floor_cases`): PyTorch's dispatch alone, plus a new output
  tensor, plus the pre-jitted JAX call; the least any device built as a Python tensor subclass
  pays per op on this machine, next to ``x + y`` on tpu tensors, all in one rotation.

One JSON line on stdout carries every figure plus the torch / jax versions, the device and the
machine's load average before and after the run. It runs on the best platform present (a TPU,
else a GPU, else the CPU; ``TPU_TRAIN_PLATFORM`` chooses) and says which (``jax_platform``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tpu_train  # noqa: E402,F401  (registers the tpu device)
from tpu_train.device import TpuTensor, storage_of  # noqa: E402

SIZES = {"small": 128, "medium": 1024}
OPS = ("add", "matmul", "softmax")


# ---------------------------------------------------------------------------------------------
# Waiting for the device
# ---------------------------------------------------------------------------------------------


def _buffers(tensor: torch.Tensor):
    return storage_of(tensor).buffer if isinstance(tensor, TpuTensor) else None


def wait_tpu(*tensors: torch.Tensor) -> None:
    """Block until the device values of ``tensors`` are computed (no host copy)."""
    buffers = [_buffers(t) for t in tensors]
    if all(b is not None for b in buffers):
        jax.block_until_ready(buffers)
    else:  # a device layer without the storage attribute: fall back to a host read
        for t in tensors:
            t.detach().to("cpu")


# ---------------------------------------------------------------------------------------------
# Per-op cases
# ---------------------------------------------------------------------------------------------


def _operands(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n), dtype=np.float32)
    # For matmul chains: scaled so repeated products keep a stable magnitude.
    y = (rng.standard_normal((n, n), dtype=np.float32) / np.sqrt(n)).astype(np.float32)
    return x, y


def _torch_op(name: str):
    if name == "add":
        return lambda x, y: x + y
    if name == "matmul":
        return lambda x, y: x @ y
    if name == "softmax":
        return lambda x, y: torch.softmax(x, dim=-1)
    raise ValueError(name)


def _jax_op(name: str):
    if name == "add":
        return jax.jit(lambda x, y: x + y)
    if name == "matmul":
        return jax.jit(lambda x, y: x @ y)
    if name == "softmax":
        return jax.jit(lambda x, y: jax.nn.softmax(x, axis=-1))
    raise ValueError(name)


def _jax_device():
    from tpu_train.device import runtime

    return runtime.jax_device(0)


class OpCase:
    def __init__(self, op: str, size: str, k: int, device: torch.device):
        self.op, self.size, self.k = op, size, k
        n = SIZES[size]
        x, y = _operands(n, seed=hash((op, size)) % 2**31)
        self.tx, self.ty = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        self.jx = jax.device_put(x, _jax_device())  # the device the tpu tensors sit on
        self.jy = jax.device_put(y, _jax_device())
        self.torch_fn, self.jax_fn = _torch_op(op), _jax_op(op)

    @property
    def name(self) -> str:
        return f"{self.op}_{self.size}"

    def tpu_batch(self) -> float:
        """Seconds per op for K dependent eager ops, including the wait for the last one."""
        fn, x, y = self.torch_fn, self.tx, self.ty
        start = time.perf_counter()
        for _ in range(self.k):
            x = fn(x, y)
        wait_tpu(x)
        return (time.perf_counter() - start) / self.k

    def jax_batch(self) -> float:
        fn, x, y = self.jax_fn, self.jx, self.jy
        start = time.perf_counter()
        for _ in range(self.k):
            x = fn(x, y)
        x.block_until_ready()
        return (time.perf_counter() - start) / self.k

    def warm_up(self, batches: int = 2) -> None:
        for _ in range(batches):
            self.tpu_batch()
            self.jax_batch()


# ---------------------------------------------------------------------------------------------
# Training step
# ---------------------------------------------------------------------------------------------


def _llama_config():
    from tpu_train.models import LlamaConfig

    return LlamaConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=512,
                       ffn_hidden_dim=768, max_seq_len=64, tie_embeddings=False)


class StepCase:
    """One eager training step of a 1-layer Llama block on ``device``."""

    def __init__(self, device: torch.device, batch: int = 2, seq: int = 64):
        from tpu_train.models import Llama

        cfg = _llama_config()
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Llama(cfg)
        model.init_weights(seed=0, device="cpu")
        self.model = model.to(device)
        self.device = device
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=generator)
        self.inputs = tokens[:, :-1].contiguous().to(device)
        self.labels = tokens[:, 1:].contiguous().to(device)
        self.vocab = cfg.vocab_size

    def step(self) -> float:
        start = time.perf_counter()
        logits = self.model(self.inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab),
                                                 self.labels.reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "tpu":
            wait_tpu(loss.detach(), *(p.detach() for p in self.model.parameters()))
        return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _summary(samples: list[float], scale: float) -> dict:
    return {"min": round(min(samples) * scale, 3),
            "median": round(statistics.median(samples) * scale, 3)}


def bench_ops(repeats: int, k_small: int, k_medium: int, device: torch.device,
              warm_up: int = 2) -> dict:
    cases = [OpCase(op, size, k_small if size == "small" else k_medium, device)
             for size in SIZES for op in OPS]
    for case in cases:
        case.warm_up(warm_up)
    tpu = {c.name: [] for c in cases}
    ref = {c.name: [] for c in cases}
    for r in range(repeats):
        for case in cases:
            # Alternate which side goes first so drift on a shared machine hits both.
            if r % 2 == 0:
                tpu[case.name].append(case.tpu_batch())
                ref[case.name].append(case.jax_batch())
            else:
                ref[case.name].append(case.jax_batch())
                tpu[case.name].append(case.tpu_batch())
    out = {}
    for case in cases:
        a, b = _summary(tpu[case.name], 1e6), _summary(ref[case.name], 1e6)
        out[case.name] = {
            "shape": [SIZES[case.size]] * 2, "dtype": "float32", "ops_per_batch": case.k,
            "tpu_eager_us": a, "jax_jit_us": b,
            "ratio_min": round(a["min"] / b["min"], 2),
            "ratio_median": round(a["median"] / b["median"], 2),
        }
    return out


def bench_step(repeats: int, device: torch.device, warm_up: int = 2) -> dict:
    tpu_case, cpu_case = StepCase(device), StepCase(torch.device("cpu"))
    for _ in range(warm_up):  # first steps compile every op and create the optimizer state
        tpu_case.step()
        cpu_case.step()
    tpu_s, cpu_s = [], []
    for r in range(repeats):
        if r % 2 == 0:
            tpu_s.append(tpu_case.step())
            cpu_s.append(cpu_case.step())
        else:
            cpu_s.append(cpu_case.step())
            tpu_s.append(tpu_case.step())
    a, b = _summary(tpu_s, 1.0), _summary(cpu_s, 1.0)
    for d in (a, b):
        d["min"], d["median"] = round(d["min"], 4), round(d["median"], 4)
    return {"model": "Llama 1 layer, dim 256, 4 heads, ffn 768, vocab 512",
            "batch": 2, "seq": 64, "optimizer": "AdamW",
            "tpu_eager_s": a, "torch_cpu_s": b,
            "ratio_min": round(a["min"] / b["min"], 2),
            "ratio_median": round(a["median"] / b["median"], 2)}


# ---------------------------------------------------------------------------------------------
# The floor: what any device built as a Python tensor subclass pays per op
# ---------------------------------------------------------------------------------------------


def _probe_class(dispatch):
    """A wrapper subclass on the tpu device that only holds a ``jax.Array`` (``.array``) and
    answers every op with ``dispatch(func, args)``: the least a Python-subclass device can be."""

    class Probe(torch.Tensor):
        __slots__ = ("array",)

        @staticmethod
        def __new__(cls, array, device):
            probe = torch.Tensor._make_wrapper_subclass(cls, (SIZES["small"],) * 2,
                                                       dtype=torch.float32, device=device)
            probe.array = array
            return probe

        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return dispatch(cls, args)

    return Probe


def _floor_cases(device: torch.device) -> dict:
    """name -> (chain step, first operands, wait): each case runs ``x = step(x, y)``.

    * ``jax_jit``: the pre-jitted JAX add alone (the per-op cases' reference);
    * ``dispatch_only``: PyTorch's dispatch of ``x + y`` to a Python subclass whose
      ``__torch_dispatch__`` returns a tensor made in advance;
    * ``dispatch_new_tensor``: the same, returning a new wrapper tensor each time (its creation
      and the release of the previous one);
    * ``dispatch_jax_call``: ``dispatch_only`` plus the pre-jitted JAX add inside
      ``__torch_dispatch__``;
    * ``dispatch_jax_new_tensor``: the JAX add inside ``__torch_dispatch__`` and a new wrapper
      holding its result: a whole op with nothing else (no key, no cache, no storage model);
    * ``tpu_add``: ``x + y`` on tpu tensors (what ``add_small`` measures).
    """
    n = SIZES["small"]
    x, y = _operands(n, seed=7)
    jx, jy = jax.device_put(x, _jax_device()), jax.device_put(y, _jax_device())
    add = jax.jit(lambda a, b: a + b)
    made = {}

    def returns_made(cls, args):
        return made[cls]

    def returns_new(cls, args):
        return cls(jy, device)

    def calls_jax(cls, args):
        add(args[0].array, args[1].array)
        return made[cls]

    def calls_jax_returns_new(cls, args):
        return cls(add(args[0].array, args[1].array), device)

    def probe_case(dispatch):
        probe = _probe_class(dispatch)
        made[probe] = probe(jx, device)
        return (lambda a, b: a + b), (probe(jx, device), probe(jy, device)), \
            (lambda value: jax.block_until_ready(value.array))

    tx, ty = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
    return {
        "jax_jit": (add, (jx, jy), lambda value: value.block_until_ready()),
        "dispatch_only": probe_case(returns_made),
        "dispatch_new_tensor": probe_case(returns_new),
        "dispatch_jax_call": probe_case(calls_jax),
        "dispatch_jax_new_tensor": probe_case(calls_jax_returns_new),
        "tpu_add": ((lambda a, b: a + b), (tx, ty), wait_tpu),
    }


def bench_floor(repeats: int, k: int, device: torch.device) -> dict:
    """Microseconds per op of each :func:`_floor_cases` case (chains of ``k`` dependent adds,
    128 x 128 float32, a wait at the end), the cases rotating in one process; each case's min
    and median over ``repeats`` rounds, and its ratio to ``jax_jit``."""
    cases = _floor_cases(device)
    names = list(cases)
    samples = {name: [] for name in names}

    def chain(name):
        step, (x, y), wait = cases[name]
        start = time.perf_counter()
        for _ in range(k):
            x = step(x, y)
        wait(x)
        return (time.perf_counter() - start) / k

    for name in names:  # warm-up: compiles the adds
        chain(name)
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(chain(name))
    out = {name: _summary(values, 1e6) for name, values in samples.items()}
    reference = out["jax_jit"]
    for name in names:
        out[name]["ratio_min"] = round(out[name]["min"] / reference["min"], 2)
        out[name]["ratio_median"] = round(out[name]["median"] / reference["median"], 2)
    return out


def profile_add(n_ops: int, device: torch.device, top: int = 25) -> None:
    """cProfile ``n_ops`` small eager adds (steady state); per-op microseconds to stderr."""
    import cProfile
    import pstats

    x = torch.randn(128, 128).to(device)
    y = torch.randn(128, 128).to(device)
    for _ in range(20):
        x = x + y
    wait_tpu(x)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n_ops):
        x = x + y
    wait_tpu(x)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = []
    for (path, line, func), (_, calls, tottime, cumtime, _) in stats.items():
        where = f"{Path(path).name}:{line}({func})" if path != "~" else func
        rows.append((cumtime, tottime, calls, where))
    print(f"# cProfile of {n_ops} eager 128x128 adds: cumulative / own us per op, calls per op",
          file=sys.stderr)
    for cumtime, tottime, calls, where in sorted(rows, reverse=True)[:top]:
        print(f"{cumtime / n_ops * 1e6:9.1f} {tottime / n_ops * 1e6:9.1f} {calls / n_ops:6.1f}  "
              f"{where}", file=sys.stderr)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="Eager tpu per-op latency vs pre-jitted JAX.")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved A/B rounds")
    parser.add_argument("--quick", action="store_true",
                        help="tiny batches and 2 rounds (a smoke run, not a measurement)")
    parser.add_argument("--k-small", type=int, default=50, help="ops per batch, small shapes")
    parser.add_argument("--k-medium", type=int, default=10, help="ops per batch, medium shapes")
    parser.add_argument("--step-repeats", type=int, default=None,
                        help="training steps per side (default: --repeats)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch intra-op threads for the CPU reference step (0: leave torch's "
                             "default; 1 avoids thread thrash on a small shared machine)")
    parser.add_argument("--floor", action="store_true",
                        help="also measure what a Python-subclass device pays per add before "
                             "any code of its own (the 'floor' entry)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also cProfile N small eager adds; the table goes to stderr")
    args = parser.parse_args(argv)
    repeats, k_small, k_medium = args.repeats, args.k_small, args.k_medium
    step_repeats = args.step_repeats or repeats
    if args.quick:
        repeats, k_small, k_medium, step_repeats = 2, 3, 2, 2
        SIZES["medium"] = 256  # compile and run time of a smoke run, not a measurement
    if args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)

    device = torch.device("tpu", 0)
    jax_device = _jax_device()  # the best platform present, or TPU_TRAIN_PLATFORM's
    load_before = os.getloadavg()
    result = {
        "benchmark": "bench_eager",
        "quick": bool(args.quick),
        "repeats": repeats,
        "torch": torch.__version__,
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        "device": str(device),
        "jax_platform": jax_device.platform,
        "jax_device": str(jax_device.device_kind),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ops": bench_ops(repeats, k_small, k_medium, device, warm_up=1 if args.quick else 2),
        "train_step": bench_step(step_repeats, device, warm_up=1 if args.quick else 2),
    }
    if args.floor:
        result["floor"] = bench_floor(max(repeats, 2) * 4, k_small, device)
    # A shared machine: the load says how much the figures can be trusted.
    result["load_average_before"] = [round(x, 2) for x in load_before]
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.profile:
        profile_add(args.profile, device)
    print(json.dumps(result), flush=True)
    return result


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()
