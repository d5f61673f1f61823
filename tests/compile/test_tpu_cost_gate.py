"""The TPU cost gate: the trainer's compiled step, compiled for a TPU v5e by XLA's TPU compiler
(libtpu, no chip), accesses at most 5 % more bytes and runs at most 2 % more FLOPs than the
hand-written JAX reference of the same model (``scripts/jax_llama.py``) compiled the same way,
by the compiler's cost analysis: deterministic, no chip, no timing noise. Both compile with
memory-space assignment off (``tpu_cost.OPTIONS``): its prefetch copies follow the compiler's
scheduling, not the program (``scripts/tpu_cost.py`` says what moved them by 12 %).

Two sizes (``scripts/tpu_cost.py``, which prints the same figures for these and larger sizes):
W1 (dim 512, 4 layers, vocab 8192, 4 x 256 tokens) and ``w1-512`` (W1's width, 2 layers,
2 x 512 tokens), where attention's ``seq x seq`` work and traffic count. Attention takes its
XLA form: the Pallas kernels have no cost estimate, so neither program may contain one, nor a
``while`` loop (whose body the analysis may count once), and the reference's FLOPs must cover
the analytic count of its matmuls: a gate that improves by hiding work fails here instead.

The four compiles (about 2 minutes on a 2-core host) run once, for the module. CI installs the
``tpu`` extra, so they run there; without libtpu the module is skipped, saying so.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tpu_train.ops.matmul import get_matmul_precision
from tests.markers import needs_libtpu

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    needs_libtpu,
    # The module's compiles run in the first test's setup.
    pytest.mark.timeout(1800),
]


def _load_tpu_cost():
    spec = importlib.util.spec_from_file_location("tpu_cost", ROOT / "scripts" / "tpu_cost.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["tpu_cost"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


tpu_cost = _load_tpu_cost()
PRECISION_BEFORE = get_matmul_precision()


@pytest.fixture(scope="module")
def reports() -> dict:
    return {name: tpu_cost.compare(name, "v5e") for name in tpu_cost.GATED}


def test_the_gate_covers_attention_at_512_tokens():
    assert "w1" in tpu_cost.GATED
    assert max(tpu_cost.SIZES[name].seq for name in tpu_cost.GATED) >= 512


def test_the_options_leave_out_memory_space_prefetches_only(reports):
    # Without memory-space assignment the programs have no asynchronous prefetch into the
    # chip's on-core memory; every other option is XLA's default.
    assert tpu_cost.OPTIONS == {"xla_msa_enable": False}
    # The compiles left the process's float32 matmul precision as they found it.
    assert get_matmul_precision() == PRECISION_BEFORE
    for report in reports.values():
        for side in ("ours", "reference"):
            assert report[side]["prefetches"] == 0, report


@pytest.mark.parametrize("name", tpu_cost.GATED)
def test_no_work_is_hidden_from_the_cost_analysis(reports, name):
    report = reports[name]
    for side in ("ours", "reference"):
        facts = report[side]
        assert facts["pallas_kernels"] == 0, (
            f"{name}: the {side} program runs {facts['pallas_kernels']} Pallas kernels, which "
            "XLA's cost analysis counts as nothing: gate a configuration without them")
        assert facts["while_loops"] == 0, (
            f"{name}: the {side} program has {facts['while_loops']} while loops, whose bodies "
            "the cost analysis may count once: gate a configuration without them")
    # Every matmul of forward and backward is counted; the elementwise work adds a few percent.
    assert 1.0 <= report["reference"]["flops"] / report["analytic_flops"] <= 1.05, report
    assert report["ours"]["flops"] >= report["analytic_flops"], report


@pytest.mark.parametrize("name", tpu_cost.GATED)
def test_bytes_accessed_within_5_percent_of_the_jax_reference(reports, name):
    report = reports[name]
    assert report["bytes_ratio"] <= tpu_cost.BYTES_LIMIT, (
        f"{name}: the compiled step accesses {report['ours']['bytes'] / 1e9:.3f} GB per step, "
        f"{report['bytes_ratio']:.3f}x the JAX reference's "
        f"{report['reference']['bytes'] / 1e9:.3f} GB (limit {tpu_cost.BYTES_LIMIT}x); "
        "python scripts/tpu_cost.py --size NAME --hlo-dir DIR writes both programs to compare")


@pytest.mark.parametrize("name", tpu_cost.GATED)
def test_flops_within_2_percent_of_the_jax_reference(reports, name):
    report = reports[name]
    assert report["flops_ratio"] <= tpu_cost.FLOPS_LIMIT, (
        f"{name}: the compiled step runs {report['ours']['flops'] / 1e9:.2f} GFLOP per step, "
        f"{report['flops_ratio']:.4f}x the JAX reference's "
        f"{report['reference']['flops'] / 1e9:.2f} (limit {tpu_cost.FLOPS_LIMIT}x)")
