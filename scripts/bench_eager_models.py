"""Eager training steps of a transformers model on ``tpu`` against the same model in torch on CPU.

Exact command (from the repository root)::

    python scripts/bench_eager_models.py               # --repeats 9
    python scripts/bench_eager_models.py --quick       # a smoke run, not a measurement
    python scripts/bench_eager_models.py --fused-max-ops 150,300,8192   # + fused region bounds

The model is transformers' ``LlamaForCausalLM`` with a tiny config (hidden 128, 2 layers,
4 heads / 2 kv heads, MLP 256, vocabulary 1000), batch 4, sequence 64, AdamW, labels = the
inputs. One step = forward + loss + backward + ``AdamW.step`` + ``zero_grad``; a tpu step waits
for its loss and every parameter (no host copy; in fused mode that runs the recorded region).
Sides, each with the same initial weights: eager tpu in ``strict`` mode, eager tpu in ``fused``
mode, and torch on CPU with one intra-op thread. Steps rotate over the sides (the order rotates
too) after 2 warm-up steps each, so drift on a shared machine hits all of them. The losses after
the same number of steps are printed as a sanity check, with the number of aten ops one tpu step
dispatches and the machine's load average before and after. ``--fused-max-ops`` adds one more
fused side per region bound (``TPU_TRAIN_FUSED_MAX_OPS`` during its steps), in the same rotation;
``--dispatch-thread`` one more strict side whose program calls run on a dispatch thread
(``TPU_TRAIN_DISPATCH_THREAD``'s mode, on during its steps only); ``--backward-op-by-op`` one
more strict side whose backward ops run one program each (``lazy.batch_backward`` off during
its steps: strict mode as it was before it recorded a backward pass as one program).

One JSON line on stdout, with the platform it ran on (``jax_platform``: the best one present,
or ``TPU_TRAIN_PLATFORM``'s).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tpu_train  # noqa: E402,F401  (registers the tpu device)
from tpu_train.device import dispatch_thread, lazy, runtime, storage_of  # noqa: E402

CONFIG = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
BATCH, SEQ = 4, 64


class Step:
    def __init__(self, model: torch.nn.Module, device: torch.device, ids: torch.Tensor,
                 mode: str = "strict", max_ops: int | None = None, thread: bool = False,
                 backward_op_by_op: bool = False):
        self.device, self.mode, self.max_ops, self.thread = device, mode, max_ops, thread
        self.backward_op_by_op = backward_op_by_op
        self.model = model.to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
        self.ids = ids.to(device)
        self.loss = None

    def __call__(self) -> float:
        if self.max_ops is not None:  # read when fused mode is entered
            os.environ["TPU_TRAIN_FUSED_MAX_OPS"] = str(self.max_ops)
        else:
            os.environ.pop("TPU_TRAIN_FUSED_MAX_OPS", None)
        dispatch_thread.drain()  # the previous side's calls are not this side's time
        dispatch_thread.enabled = self.thread
        start = time.perf_counter()
        with tpu_train.eager_mode(self.mode):
            if self.backward_op_by_op:  # the mode's own setting comes back with the mode
                lazy.batch_backward = False
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if self.device.type == "tpu":
                jax.block_until_ready([storage_of(loss.detach()).buffer]
                                      + [storage_of(p.detach()).buffer
                                         for p in self.model.parameters()])
        self.loss = loss.detach()
        elapsed = time.perf_counter() - start
        dispatch_thread.drain()
        dispatch_thread.enabled = False
        return elapsed


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _summary(samples: list[float]) -> dict:
    return {"min": round(min(samples), 4), "median": round(statistics.median(samples), 4)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per side")
    parser.add_argument("--quick", action="store_true", help="2 steps per side, 1 warm-up")
    parser.add_argument("--fused-max-ops", default="",
                        help="comma-separated region bounds: one more fused side each")
    parser.add_argument("--dispatch-thread", action="store_true",
                        help="one more strict side, its program calls on a dispatch thread")
    parser.add_argument("--backward-op-by-op", action="store_true",
                        help="one more strict side, its backward ops one program each")
    args = parser.parse_args(argv)
    bounds = [int(n) for n in args.fused_max_ops.split(",") if n]
    import transformers

    repeats, warm_up = (2, 1) if args.quick else (args.repeats, 2)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    torch.manual_seed(0)
    cpu_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ),
                        generator=torch.Generator().manual_seed(1))
    tpu = Step(copy.deepcopy(cpu_model), torch.device("tpu", 0), ids)
    fused = Step(copy.deepcopy(cpu_model), torch.device("tpu", 0), ids, mode="fused")
    bounded = [Step(copy.deepcopy(cpu_model), torch.device("tpu", 0), ids, mode="fused",
                    max_ops=n) for n in bounds]
    threaded = [Step(copy.deepcopy(cpu_model), torch.device("tpu", 0), ids, thread=True)
                ] if args.dispatch_thread else []
    op_by_op = [Step(copy.deepcopy(cpu_model), torch.device("tpu", 0), ids,
                     backward_op_by_op=True)] if args.backward_op_by_op else []
    cpu = Step(cpu_model, torch.device("cpu"), ids)
    sides = [tpu, fused, cpu, *bounded, *threaded, *op_by_op]
    for _ in range(warm_up):  # the first steps compile every op and create the optimizer state
        for side in sides:
            side()
    with _OpCounter() as counter:
        tpu()
    for side in sides[1:]:  # keep every side at the same number of steps
        side()
    samples = {id(side): [] for side in sides}
    for r in range(repeats):
        turn = r % len(sides)
        for side in sides[turn:] + sides[:turn]:
            samples[id(side)].append(side())
    a, f, b = (_summary(samples[id(side)]) for side in (tpu, fused, cpu))
    result = {
        "benchmark": "bench_eager_models",
        "model": "transformers.LlamaForCausalLM", "config": CONFIG, "batch": BATCH, "seq": SEQ,
        "optimizer": "AdamW", "quick": bool(args.quick), "repeats": repeats,
        "torch": torch.__version__, "jax": jax.__version__, "transformers": transformers.__version__,
        "jax_platform": runtime.platform(), "jax_device": runtime.device_kind(0),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "aten_ops_per_tpu_step": counter.count,
        "tpu_eager_s": a, "tpu_fused_s": f, "torch_cpu_s": b,
        "ratio_min": round(a["min"] / b["min"], 2),
        "ratio_median": round(a["median"] / b["median"], 2),
        "fused_ratio_min": round(f["min"] / b["min"], 2),
        "fused_ratio_median": round(f["median"] / b["median"], 2),
        "loss_tpu": float(tpu.loss.cpu()), "loss_tpu_fused": float(fused.loss.cpu()),
        "loss_cpu": float(cpu.loss),
    }
    if bounded:
        result["fused_by_max_ops"] = {
            str(side.max_ops): {**(s := _summary(samples[id(side)])),
                                "ratio_min": round(s["min"] / b["min"], 2),
                                "ratio_median": round(s["median"] / b["median"], 2)}
            for side in bounded}
    for key, extra in (("tpu_eager_dispatch_thread_s", threaded),
                       ("tpu_eager_backward_op_by_op_s", op_by_op)):
        if extra:  # each against torch's CPU step and against strict mode
            s = _summary(samples[id(extra[0])])
            result[key] = {**s, "ratio_min": round(s["min"] / b["min"], 2),
                           "ratio_median": round(s["median"] / b["median"], 2),
                           "over_strict_min": round(s["min"] / a["min"], 3),
                           "over_strict_median": round(s["median"] / a["median"], 3),
                           "loss": float(extra[0].loss.cpu())}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
