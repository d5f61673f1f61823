#!/usr/bin/env python
"""Training-step benchmark on workload W1: tpu eager (strict, fused) vs tpu compiled vs JAX.

W1 is a Llama-style decoder (dim 512, 4 layers, 8 heads, 4 kv heads, SwiGLU hidden 1408, vocab
8192, RMSNorm, RoPE) trained on causal-LM cross-entropy with AdamW (lr 1e-4, weight decay 0.1),
batch 4 x 256 tokens. All modes start from the same initial weights and see the same batches;
their steps are interleaved, the order rotating by one mode each step (eager, compiled, jax;
compiled, jax, eager; ...), so that machine noise and the position after another mode hit every
mode alike.

* ``eager``: the model on the ``tpu`` device, ``loss.backward()`` and ``optimizer.step()`` op by op;
* ``fused``: the same eager code in fused eager mode (``tpu_train.eager_mode("fused")``): the
  step's ops are recorded and run as one region when the step's values are read;
* ``compiled``: the same model and optimizer through ``tpu_train.compile.compile_train_step``;
* ``compiled_torch_autodiff``: the same with ``autodiff="torch"`` (PyTorch's backward traced
  instead of JAX differentiating the traced forward);
* ``jax``: the same network written directly in JAX with ``optax.adamw``, one ``jax.jit`` step
  with donated parameters and optimizer state, returning the loss and the global gradient
  norm (``optax.global_norm``) as the compiled step does; compiled with XLA's defaults, as a
  user's JAX code is (the compiled step adds one CPU-client option of the runtime,
  ``tpu_train.device.runtime.compiler_options``: no copies of donated parameters).

Prints ONE JSON line: per mode the fastest and median step seconds (step 1, which compiles,
excluded), tokens/s at the median, trace + compile seconds, resident memory, the loss at the
first and last step; and the compiled/jax ratios. Usage::

    python scripts/bench_train_step.py [--dtype fp32|bf16] [--only eager,fused,compiled,jax] [--steps N]
    python scripts/bench_train_step.py --isolated R [--only ...] [--steps N]
    python scripts/bench_train_step.py --size w1|350m|1b [--precision fp32|bf16] [--only eager,fused,compiled,jax,jax_ahead]

``--size`` compares, interleaved as above, the modes of a model size of
``scripts/jax_llama.py`` (``w1``, ``350m``, ``1b``) at ``--precision`` (default bf16):
``compiled``, the step exactly as ``tpu-train model=llama_<size> trainer.mode=compiled
trainer.precision=...`` builds it (``scripts/train_step_modes.py``: the size's model option,
AdamW on the trainer's parameter groups, clipping to 1.0, a constant lr; what ``tpu-train``
reaches on that model option: ``scripts/bench_cli_sizes.py``) and ``jax``, the hand-written
JAX reference at the same precision with the same optimizer settings, by default; ``eager``
and ``fused`` on request, the trainer's step at ``trainer.mode=eager|fused``. The trainer's
modes get their batches as its loop gives them: each placed as the step reads it
(``TrainStep.put_batch``), the next one once a step is dispatched and before its loss is read.
``jax`` puts its batch on the device at its call; ``jax_ahead`` (on request) is the reference
with its batches put as the loop puts the trainer's. Every mode's step is
timed until its loss is read on the host (``train_step_modes.wait_for_loss``: one
device-to-host read per step on each side, as in ``tpu-train``'s loop; ``--wait ready`` only
waits until the outputs are ready instead). Per mode: fastest /
median step, tokens/s, MFU
((6 N_matmul + 12 layers seq dim) x tokens / step / the chip's peak bf16 FLOP/s; null where
the chip's peak is unknown, e.g. on a CPU), trace / compile seconds, first / last loss; the
device's memory (``memory_stats``: in use after each mode's set-up, and the process's peak);
and the compiled/jax and fused/compiled ratios. At ``1b`` the two modes' float32 weights and AdamW state do not
fit one 16 GB chip together: run ``--only compiled`` and ``--only jax`` separately.

Every script runs on the best platform present (a TPU, else a GPU, else the CPU; set
``TPU_TRAIN_PLATFORM`` to choose) and reports the platform, the chip and its peak.

``--isolated R`` (with or without ``--size``) measures what one process cannot separate: each
mode runs alone in a fresh subprocess (``--only MODE``), R rounds with the modes interleaved
(compiled, jax, compiled with a warm persistent cache, compiled, ...; each child's compile
seconds go to stderr as it ends), and the report gives per mode the min and median
over rounds of the process's peak RSS and of trace + compile seconds, the compiled/jax ratios
of both (cold: no persistent cache) and the warm/cold ratio of the compiled step.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import resource
import shutil
import statistics
import sys
import time

import numpy as np

# The sibling modules (jax_llama, train_step_modes), also under ``python -m scripts....``.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCH, SEQ = 4, 256
LR, WEIGHT_DECAY, BETAS, EPS = 1e-4, 0.1, (0.9, 0.999), 1e-8
MODES = ("eager", "fused", "compiled", "compiled_torch_autodiff", "jax")
DEFAULT_MODES = ("eager", "compiled", "jax")


def w1_config():
    from tpu_train.models import LlamaConfig

    return LlamaConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192,
                       ffn_hidden_dim=1408, max_seq_len=SEQ)


def make_batches(steps: int, vocab: int, seed: int = 0, batch: int = BATCH,
                 seq: int = SEQ) -> list[dict]:
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        t = rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int64)
        batches.append({"tokens": t[:, :-1].copy(), "labels": t[:, 1:].copy()})
    return batches


def lm_loss(model, batch):
    import torch.nn.functional as F

    logits = model(batch["tokens"])
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())


def rss_mb() -> float:
    """Current resident set size of this process (MiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------------ modes


class TorchMode:
    """Shared set-up of the two torch modes: a tpu copy of the model and a torch AdamW."""

    def __init__(self, cpu_model, dtype):
        import torch

        import tpu_train

        self.torch = torch
        self.device = tpu_train.device(0)
        self.model = copy.deepcopy(cpu_model).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                           weight_decay=WEIGHT_DECAY)
        self.compile_s = 0.0

    def to_device(self, batch):
        return {k: self.torch.from_numpy(v).to(self.device) for k, v in batch.items()}

    def block(self, loss):
        import jax

        from tpu_train.device import storage_of

        jax.block_until_ready([storage_of(p).buffer for p in self.model.parameters()]
                              + [storage_of(loss).buffer])


class EagerMode(TorchMode):
    def step(self, batch):
        loss = lm_loss(self.model, self.to_device(batch))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class FusedMode(EagerMode):
    def step(self, batch):
        import tpu_train

        with tpu_train.eager_mode("fused"):  # leaving the mode runs the step's region
            return super().step(batch)


class CompiledMode(TorchMode):
    def __init__(self, cpu_model, dtype, autodiff="jax"):
        super().__init__(cpu_model, dtype)
        from tpu_train.compile import compile_train_step

        self.step_fn = compile_train_step(self.model, self.optimizer, lm_loss, autodiff=autodiff)

    def step(self, batch):
        loss = self.step_fn(self.to_device(batch))["loss"]
        records = self.step_fn.compilations
        self.compile_s = sum(r.total_s for r in records)
        self.stages = {"trace_s": round(sum(r.trace_s for r in records), 3),
                       "lower_s": round(sum(r.lower_s for r in records), 3),
                       "xla_compile_s": round(sum(r.compile_s for r in records), 3),
                       "graph_nodes": records[-1].graph_nodes if records else 0}
        return loss


class JaxMode:
    """W1 written directly in JAX + optax, from the torch model's initial weights."""

    def __init__(self, cpu_model, dtype):
        import jax
        import jax.numpy as jnp
        import optax

        from tpu_train.device import runtime
        from tpu_train.device.tensor import host_array

        self.jax, self.jnp = jax, jnp
        self.device = runtime.jax_device(0)
        cfg = cpu_model.config
        self.cfg = cfg
        params = {}
        for name, tensor in cpu_model.state_dict().items():
            if name.startswith("rope_"):
                continue
            value = host_array(tensor)
            if value.ndim == 2 and not name.startswith("tok_embeddings"):
                value = np.ascontiguousarray(value.T)  # [in, out]: x @ w
            params[name] = jax.device_put(value, self.device)
        self.params = params
        self.cos = jax.device_put(host_array(cpu_model.rope_cos[:SEQ].float()), self.device)
        self.sin = jax.device_put(host_array(cpu_model.rope_sin[:SEQ].float()), self.device)
        self.opt = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
        self.opt_state = jax.device_put(self.opt.init(params), self.device)
        self.compiled = None
        self.compile_s = 0.0

    def _rms(self, x, w):
        jnp = self.jnp
        x32 = x.astype(jnp.float32)
        normed = x32 * jax_rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.norm_eps)
        return w * normed.astype(x.dtype)

    @staticmethod
    def _linear(x, w):
        # A 2-D dot with one contracting dim: the weight gradient then is a plain [in, N] x
        # [N, out] dot. Dotting the 3-D activation directly gives the weight gradient two
        # contracting dims (batch and sequence), for which XLA materializes a transpose.
        return (x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[:-1] + (w.shape[1],))

    def _rotary(self, x):
        jnp = self.jnp
        half = x.shape[-1] // 2
        cos, sin = self.cos.astype(x.dtype), self.sin.astype(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _loss(self, params, tokens, labels):
        jax, jnp, cfg = self.jax, self.jnp, self.cfg
        b, t = tokens.shape
        hd, rep = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
        h = params["tok_embeddings.weight"][tokens]
        mask = jnp.tril(jnp.ones((t, t), bool))
        for i in range(cfg.n_layers):
            p = lambda n: params[f"layers.{i}.{n}"]  # noqa: E731
            x = self._rms(h, p("attention_norm.weight"))
            q = self._linear(x, p("attention.wq.weight")).reshape(b, t, cfg.n_heads, hd)
            k = self._linear(x, p("attention.wk.weight")).reshape(b, t, cfg.n_kv_heads, hd)
            v = self._linear(x, p("attention.wv.weight")).reshape(b, t, cfg.n_kv_heads, hd)
            q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
            q, k = self._rotary(q), self._rotary(k)
            k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
            scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hd)
            scores = jnp.where(mask, scores, -jnp.inf)
            attn = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype) @ v
            attn = attn.transpose(0, 2, 1, 3).reshape(b, t, cfg.n_heads * hd)
            h = h + self._linear(attn, p("attention.wo.weight"))
            x = self._rms(h, p("ffn_norm.weight"))
            ff = (jax.nn.silu(self._linear(x, p("feed_forward.w1.weight")))
                  * self._linear(x, p("feed_forward.w3.weight")))
            h = h + self._linear(ff, p("feed_forward.w2.weight"))
        h = self._rms(h, params["norm.weight"])
        logits = self._linear(h, params["output.weight"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    def _train_step(self, params, opt_state, tokens, labels):
        import optax

        loss, grads = self.jax.value_and_grad(self._loss)(params, tokens, labels)
        # The compiled step returns the global gradient norm with the loss (a trainer logs
        # it every step): the same outputs here, so both programs do the same work.
        grad_norm = optax.global_norm(grads)
        updates, opt_state = self.opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grad_norm

    def step(self, batch):
        jax = self.jax
        tokens = jax.device_put(batch["tokens"].astype(np.int32), self.device)
        labels = jax.device_put(batch["labels"].astype(np.int32), self.device)
        if self.compiled is None:
            start = time.perf_counter()
            lowered = jax.jit(self._train_step, donate_argnums=(0, 1)).lower(
                self.params, self.opt_state, tokens, labels)
            lowered_at = time.perf_counter()
            self.compiled = lowered.compile()
            self.compile_s = time.perf_counter() - start
            self.stages = {"trace_lower_s": round(lowered_at - start, 3),
                           "xla_compile_s": round(time.perf_counter() - lowered_at, 3)}
        self.params, self.opt_state, loss, _ = self.compiled(self.params, self.opt_state,
                                                             tokens, labels)
        return loss

    def block(self, loss):
        self.jax.block_until_ready((self.params, loss))


def jax_rsqrt(x):
    import jax

    return jax.lax.rsqrt(x)


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--only", action="append", metavar="MODE[,MODE...]",
                        help=f"run only these modes ({', '.join(MODES)}; repeatable); default: "
                             f"{', '.join(DEFAULT_MODES)} interleaved")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--isolated", type=int, metavar="R", default=0,
                        help="R rounds of one subprocess per mode: peak RSS and compile time")
    parser.add_argument("--size", choices=("w1", "350m", "1b"),
                        help="compare the trainer's compiled step with the JAX reference on "
                             "this model size (scripts/jax_llama.py)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16",
                        help="with --size: trainer.precision, and the reference's (default bf16)")
    parser.add_argument("--remat", choices=("full", "dots"),
                        help="with --size: rematerialize each layer of the JAX reference")
    parser.add_argument("--seq", type=int, metavar="N",
                        help="with --size: sequences of N tokens instead of the size's")
    parser.add_argument("--batch", type=int, metavar="N",
                        help="with --size: N sequences a step instead of the size's")
    parser.add_argument("--trainer-remat", choices=("none", "full", "save_dots", "save_qkv_proj"),
                        help="with --size: trainer.remat of the compiled_scan mode")
    parser.add_argument("--scan-override", action="append", default=[], metavar="KEY=VALUE",
                        help="with --size: another override of the compiled_scan mode's trainer "
                             "config (repeatable), e.g. optim.state_dtype=bf16")
    parser.add_argument("--layers", type=int, metavar="N",
                        help="with --size: N decoder layers instead of the size's own")
    parser.add_argument("--wait", choices=("loss", "ready"), default="loss",
                        help="with --size: end each timed step by reading its loss on the host "
                             "(default, as tpu-train's loop does) or only by waiting until its "
                             "outputs are ready (no read)")
    args = parser.parse_args(argv)
    if args.only:
        args.only = [name for item in args.only for name in item.split(",") if name]
    if args.size and not args.isolated:
        return sized(parser, args)
    if args.only:
        unknown = sorted(set(args.only) - set(MODES))
        if unknown:
            parser.error(f"--only: unknown mode(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(MODES)}")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 compiles and is not timed)")
    if args.isolated:
        return isolated(args)
    import torch

    import tpu_train  # noqa: F401
    from tpu_train.models import Llama

    cfg = w1_config()
    cpu_model = Llama(cfg)
    cpu_model.init_weights(seed=0, device="cpu")
    if args.dtype == "bf16":
        cpu_model = cpu_model.to(torch.bfloat16)
    batches = make_batches(args.steps, cfg.vocab_size)
    classes = {"eager": EagerMode, "fused": FusedMode, "compiled": CompiledMode, "jax": JaxMode,
               "compiled_torch_autodiff": lambda model, dtype: CompiledMode(model, dtype, "torch")}
    names = args.only or list(DEFAULT_MODES)
    modes, results = {}, {}
    for name in names:
        before = rss_mb()
        modes[name] = classes[name](cpu_model, args.dtype)
        results[name] = {"times": [], "losses": [], "rss_setup_mb": rss_mb() - before}
    del cpu_model
    run_interleaved(modes, results, batches)
    tokens = BATCH * SEQ
    report = {"workload": args.size or "W1",
              **({"precision": args.precision} if args.size else {"dtype": args.dtype}),
              "steps": args.steps,
              "device": _device_description(), **_device_facts(),
              "peak_rss_mb": round(peak_rss_mb(), 1), "modes": {}}
    for name, r in results.items():
        timed = r["times"][1:]
        median = statistics.median(timed)
        report["modes"][name] = {
            "fastest_s": round(min(timed), 4), "median_s": round(median, 4),
            "tokens_per_s": round(tokens / median, 1),
            "first_step_s": round(r["times"][0], 3),
            "trace_compile_s": round(modes[name].compile_s, 3),
            "rss_setup_mb": round(r["rss_setup_mb"], 1),
            **getattr(modes[name], "stages", {}),
            "loss_step1": float(np.asarray(to_numpy(r["losses"][0]))),
            f"loss_step{args.steps}": float(np.asarray(to_numpy(r["losses"][-1]))),
        }
    if "compiled" in report["modes"] and "fused" in report["modes"]:
        f, c = report["modes"]["fused"], report["modes"]["compiled"]
        report["fused_over_compiled"] = {"fastest": round(f["fastest_s"] / c["fastest_s"], 3),
                                         "median": round(f["median_s"] / c["median_s"], 3)}
    if "compiled" in report["modes"] and "jax" in report["modes"]:
        c, j = report["modes"]["compiled"], report["modes"]["jax"]
        report["compiled_over_jax"] = {"fastest": round(c["fastest_s"] / j["fastest_s"], 3),
                                       "median": round(c["median_s"] / j["median_s"], 3)}
    print(json.dumps(report))
    return report


def run_interleaved(modes: dict, results: dict, batches: list) -> None:
    """One step of every mode per batch, the order rotating by one mode each step; each
    step's seconds (until the mode's ``block`` returns: its loss and update are done) and loss
    go to ``results[name]``."""
    for i, batch in enumerate(batches):
        order = list(modes.items())
        for name, mode in order[i % len(order):] + order[:i % len(order)]:
            start = time.perf_counter()
            loss = mode.step(batch)
            if i + 1 < len(batches) and hasattr(mode, "put_ahead"):
                mode.put_ahead(batches[i + 1])  # as the trainer's loop does
            mode.block(loss)
            results[name]["times"].append(time.perf_counter() - start)
            results[name]["losses"].append(loss)
            if i == 0:
                # The first step compiles: say so as it ends, a long silence is then a compile.
                print(f"{name}: first step {results[name]['times'][0]:.1f} s", file=sys.stderr,
                      flush=True)


SIZED_MODES = ("eager", "fused", "compiled", "compiled_scan", "jax", "jax_ahead", "jax_scan",
               "user_autocast", "user_compute", "user_autocast_ahead")
SIZED_DEFAULT = ("compiled", "jax")


def sized(parser, args) -> dict:
    """``--size``: the trainer's compiled step vs the JAX reference (module docstring)."""
    names = args.only or list(SIZED_DEFAULT)
    unknown = sorted(set(names) - set(SIZED_MODES))
    if unknown:
        parser.error(f"--only with --size: unknown mode(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(SIZED_MODES)}")
    import jax_llama
    import train_step_modes as tsm

    import tpu_train  # noqa: F401
    from tpu_train.models import Llama

    size = jax_llama.SIZES[args.size]
    for flag, field in (("layers", "n_layers"), ("seq", "seq"), ("batch", "batch")):
        value = getattr(args, flag)
        if value is not None:
            if value < 1:
                parser.error(f"--{flag} must be >= 1, got {value}")
            size = dataclasses.replace(size, **{field: value})
    facts = tsm.device_facts()
    if facts["device_count"] > 1:
        # The trainer's step would run data-parallel over all of them, the reference on one.
        parser.error(f"--size compares one device, but this process sees "
                     f"{facts['device_count']} {facts['platform']} devices; make one visible "
                     "(a TPU host: TPU_VISIBLE_CHIPS=0 TPU_PROCESS_BOUNDS=1,1,1 "
                     "TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1)")
    configs = {mode: tsm.trainer_config(args.precision, model=tsm.model_option(args.size),
                                        mode=mode) for mode in ("eager", "fused", "compiled")}
    # The trainer's step with its layers under one scan (trainer.scan_layers=true), and
    # trainer.remat as --trainer-remat says (the trainer's default otherwise).
    scan_extra = ["trainer.scan_layers=true"]
    if args.trainer_remat is not None:
        scan_extra.append(f"trainer.remat={args.trainer_remat}")
    scan_extra.extend(args.scan_override)
    configs["compiled_scan"] = tsm.trainer_config(
        args.precision, model=tsm.model_option(args.size), mode="compiled",
        extra=tuple(scan_extra))
    cpu_model = Llama(size.config())
    cpu_model.init_weights(seed=0, device="cpu")
    batches = make_batches(args.steps, size.vocab_size, batch=size.batch, seq=size.seq)
    build = {mode: (lambda cfg=cfg: tsm.TrainerMode(cpu_model, cfg, batches_ahead=True))
             for mode, cfg in configs.items()}
    for name, ahead in (("jax", False), ("jax_ahead", True)):
        build[name] = functools.partial(tsm.ReferenceMode, cpu_model, size,
                                        tsm.hyper_from(configs["compiled"]), args.precision,
                                        args.remat, batches_ahead=ahead)
    # MaxText's shape (scripts/jax_llama_scan.py): scanned layers, a remat policy (--remat,
    # else "dots"), splash attention on a TPU from seq 1,024.
    build["jax_scan"] = functools.partial(tsm.ReferenceMode, cpu_model, size,
                                          tsm.hyper_from(configs["compiled"]), args.precision,
                                          args.remat or "dots", scan=True)
    # A user's own loop (compile_train_step, torch AdamW, no trainer) under torch.autocast's
    # bf16 and under the trainer's compute dtype.
    import torch

    for name, dtype in (("user_autocast", {"autocast_dtype": torch.bfloat16}),
                        ("user_compute", {"compute_dtype": torch.bfloat16})):
        build[name] = functools.partial(tsm.UserLoopMode, cpu_model,
                                        tsm.hyper_from(configs["compiled"]), lm_loss, **dtype)
    # The autocast loop placing its next batch with step.put_batch while a step runs.
    build["user_autocast_ahead"] = functools.partial(
        tsm.UserLoopMode, cpu_model, tsm.hyper_from(configs["compiled"]), lm_loss,
        placement="ahead", autocast_dtype=torch.bfloat16)
    modes, results, memory = {}, {}, {}
    for name in names:
        modes[name] = build[name]()
        modes[name].wait = args.wait
        results[name] = {"times": [], "losses": []}
        memory[name] = tsm.device_memory()
    del cpu_model
    run_interleaved(modes, results, batches)
    report = {"size": args.size, "layers": size.n_layers, "precision": args.precision,
              "remat_jax": args.remat, "trainer_remat_scan": args.trainer_remat,
              "scan_overrides": args.scan_override,
              "wait": args.wait,
              "peak_rss_mb": round(peak_rss_mb(), 1),
              "steps": args.steps, "batch": size.batch, "seq": size.seq,
              "params": sum(int(np.prod(s)) for s in jax_llama.param_shapes(size.config()).values()),
              "model_flops_per_step": tsm.step_flops(size), **facts,
              "date": time.strftime("%Y-%m-%d"), "modes": {}}
    if facts["peak_bf16_tflops"] is None:
        report["mfu_note"] = f"MFU unknown: no peak FLOP/s for {facts['device_kind']!r}"
    for name, r in results.items():
        timed = r["times"][1:]
        median = statistics.median(timed)
        mfu = tsm.mfu(size, median, facts["peak_bf16_tflops"])
        report["modes"][name] = {
            "fastest_s": round(min(timed), 4), "median_s": round(median, 4),
            "tokens_per_s": round(size.tokens / median, 1),
            "mfu_median": None if mfu is None else round(mfu, 4),
            "first_step_s": round(r["times"][0], 3),
            "trace_compile_s": round(modes[name].compile_s, 3), **modes[name].stages,
            "device_memory_after_setup": memory[name],
            "loss_step1": float(np.asarray(to_numpy(r["losses"][0]))),
            f"loss_step{args.steps}": float(np.asarray(to_numpy(r["losses"][-1]))),
        }
    report["device_memory_end"] = tsm.device_memory()
    if "compiled" in report["modes"] and "fused" in report["modes"]:
        f, c = report["modes"]["fused"], report["modes"]["compiled"]
        report["fused_over_compiled"] = {"fastest": round(f["fastest_s"] / c["fastest_s"], 3),
                                         "median": round(f["median_s"] / c["median_s"], 3)}
    if "compiled" in report["modes"] and "jax" in report["modes"]:
        c, j = report["modes"]["compiled"], report["modes"]["jax"]
        report["compiled_over_jax"] = {
            "fastest": round(c["fastest_s"] / j["fastest_s"], 3),
            "median": round(c["median_s"] / j["median_s"], 3),
            "trace_compile": round(c["trace_compile_s"] / j["trace_compile_s"], 3)}
    if "compiled" in report["modes"] and "jax_ahead" in report["modes"]:
        c, j = report["modes"]["compiled"], report["modes"]["jax_ahead"]
        report["compiled_over_jax_ahead"] = {"fastest": round(c["fastest_s"] / j["fastest_s"], 3),
                                             "median": round(c["median_s"] / j["median_s"], 3)}
    for a, b in (("user_autocast", "jax"), ("user_compute", "jax"),
                 ("user_autocast_ahead", "jax"),
                 ("user_autocast", "compiled"), ("compiled_scan", "compiled"),
                 ("compiled_scan", "jax_scan"),
                 ("compiled", "jax_scan"), ("jax_scan", "jax")):
        if a in report["modes"] and b in report["modes"]:
            x, y = report["modes"][a], report["modes"][b]
            report[f"{a}_over_{b}"] = {
                "fastest": round(x["fastest_s"] / y["fastest_s"], 3),
                "median": round(x["median_s"] / y["median_s"], 3),
                "trace_compile": round(x["trace_compile_s"] / y["trace_compile_s"], 3),
                "first_step": round(x["first_step_s"] / y["first_step_s"], 3)}
    print(json.dumps(report))
    return report


def isolated(args) -> dict:
    """Each mode alone in its own process, interleaved over rounds (module docstring).

    Every mode runs cold (``TPU_TRAIN_CACHE_DIR=off``: nothing is read from or written to a
    persistent compilation cache). With ``compiled`` among the modes, ``compiled_warm`` also
    runs each round against a cache directory that one untimed run filled before the rounds.
    """
    import subprocess
    import tempfile

    names = args.only or ["compiled", "jax"]
    runs = [(name, name) for name in names]
    cache_dir = tempfile.mkdtemp(prefix="bench_train_step_cache_")
    workload = ["--dtype", args.dtype]
    if args.size:  # the size's modes (``sized``), each child one of them
        workload = ["--size", args.size, "--precision", args.precision]
        workload += ["--layers", str(args.layers)] if args.layers is not None else []

    def run(mode: str, cache: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--only", mode, "--steps",
                              str(args.steps), *workload],
                             check=True, capture_output=True, text=True,
                             env=dict(os.environ, TPU_TRAIN_CACHE_DIR=cache)).stdout
        child = json.loads(out.strip().splitlines()[-1])
        figures = dict(child["modes"][mode], peak_rss_mb=child["peak_rss_mb"])
        print(json.dumps({"mode": mode, "cache": cache if cache == "off" else "warm",
                          "trace_compile_s": figures["trace_compile_s"]}),
              file=sys.stderr, flush=True)  # a run cut short still leaves its rounds
        return figures

    if "compiled" in names:
        runs.append(("compiled_warm", "compiled"))
    samples = {label: {"peak_rss_mb": [], "trace_compile_s": [], "median_s": []}
               for label, _ in runs}
    try:
        if "compiled" in names:
            run("compiled", cache_dir)  # fills the cache
        for _ in range(args.isolated):
            for label, mode in runs:
                child = run(mode, cache_dir if label == "compiled_warm" else "off")
                for key in samples[label]:
                    samples[label][key].append(child[key])
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    report = {"workload": args.size or "W1",
              **({"precision": args.precision} if args.size else {"dtype": args.dtype}),
              "steps": args.steps,
              "rounds": args.isolated, "date": time.strftime("%Y-%m-%d"),
              "load_after": [round(x, 2) for x in os.getloadavg()], "modes": {}}
    for name, figures in samples.items():
        report["modes"][name] = {
            key: {"min": round(min(v), 3), "median": round(statistics.median(v), 3),
                  "all": [round(x, 3) for x in v]} for key, v in figures.items()}

    def ratios(a: str, b: str, keys) -> dict:
        return {key: {stat: round(report["modes"][a][key][stat] / report["modes"][b][key][stat],
                                  3) for stat in ("min", "median")} for key in keys}

    if "compiled" in samples and "jax" in samples:
        report["compiled_over_jax"] = ratios("compiled", "jax", ("peak_rss_mb", "trace_compile_s"))
    if "compiled_warm" in samples:
        report["compiled_warm_over_cold"] = ratios("compiled_warm", "compiled",
                                                   ("trace_compile_s",))
    print(json.dumps(report))
    return report


def _device_facts() -> dict:
    import train_step_modes

    return train_step_modes.device_facts()


def _device_description() -> str:
    from tpu_train.device import runtime

    device = runtime.jax_device(0)
    return f"{runtime.platform()}: {device.device_kind}, {os.cpu_count()} host cores"


def to_numpy(loss):
    import torch

    if isinstance(loss, torch.Tensor):
        return loss.detach().cpu().float().numpy()
    return np.asarray(loss, dtype=np.float32)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
