"""The per-platform accuracy measurements that tests/tolerances.py derives its elementwise
tolerances from (tests/measured_ulps/<platform>.json, written by scripts/measure_ulps.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests import tolerances

FILES = sorted(tolerances.MEASURED_ULPS_DIR.glob("*.json"))


def _measurement(worst: float, arithmetic: float = 0.0) -> dict:
    """A measurement with every function at ``worst`` u, division and reciprocal at
    ``arithmetic``."""
    names = {name for group in tolerances.ULPS_GROUPS.values() for name in group}
    figures = {name: {"float32": {"vs_torch": worst, "vs_torch_per_kappa": worst}}
               for name in names}
    for name in tolerances.ULPS_GROUPS["arithmetic"]:
        figures[name] = {"float32": {"vs_torch": arithmetic}}
    return {"ulps": figures, "special": {}}


def test_each_group_is_its_worst_function_rounded_up():
    ulps = tolerances.derive_ulps(_measurement(2.01))
    assert ulps["transcendental"] == ulps["chebyshev"] == ulps["polygamma"] == 3
    assert ulps["arithmetic"] == 1  # correctly rounded on both sides: 0 measured, 1 u allowed
    assert ulps["default"] == 3 + 2 * 1


def test_a_platform_whose_division_is_not_correctly_rounded_widens_arithmetic_and_default():
    ulps = tolerances.derive_ulps(_measurement(2.5, arithmetic=1.5))
    assert ulps["arithmetic"] == 2 and ulps["default"] == 3 + 2 * 2


def test_the_cpu_measurement_gives_the_figures_the_cpu_tests_were_set_with():
    cpu = json.loads(tolerances.measured_ulps_path("cpu").read_text())
    assert tolerances.derive_ulps(cpu) == {
        "arithmetic": 1, "transcendental": 3, "default": 5, "i0": 5, "digamma": 21, "lgamma": 46,
        "special": 7, "modified_bessel_i1": 14, "zeta": 6, "igamma": 21, "polygamma": 14,
        "chebyshev": 434, "polynomial": 22}


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_platform_file_covers_every_group_and_says_where_it_was_measured(path):
    measured = json.loads(path.read_text())
    assert measured["platform"] == path.stem
    assert measured["points"] == 1 << 18, "the derivation rule is set on a 2^18-point sweep"
    ulps = tolerances.derive_ulps(measured)
    assert set(ulps) == {*tolerances.ULPS_GROUPS, "default"}
    assert all(isinstance(v, int) and v >= 1 for v in ulps.values()), ulps


def test_a_platform_without_a_measurement_names_the_command_that_writes_it():
    with pytest.raises(FileNotFoundError, match=r"TPU_TRAIN_PLATFORM=abacus python "
                                                r"scripts/measure_ulps.py --out "
                                                r"tests/measured_ulps/abacus.json"):
        tolerances.load_ulps("abacus")


def test_every_float32_rounding_bound_counts_the_platforms_rounding(monkeypatch):
    one = tolerances.rtol_for(torch.float32, 32)
    bf16 = tolerances.rtol_for(torch.bfloat16, 32)
    monkeypatch.setitem(tolerances.ELEMENTWISE_ULPS, "arithmetic", 3)
    assert tolerances.rtol_for(torch.float32, 32) == 3 * one
    assert tolerances.rtol_for(torch.bfloat16, 32) == bf16  # one float32 -> bf16 rounding


def test_one_functions_figure_is_its_measurement_rounded_up():
    for path in FILES:
        measured = json.loads(path.read_text())["ulps"]["tanh"]["float32"]["vs_torch"]
        assert tolerances.function_ulps("tanh", path.stem) == math.ceil(measured)
    assert tolerances.function_ulps("tanh", "cpu") == 3
