"""aten → JAX lowerings, one function per op, grouped by family (see ``registry``).

Importing this package registers every family. ``registry.lowered_ops()`` lists the table.
"""

import importlib

FAMILIES = [
    "pointwise", "activations", "comparison", "conversion", "reduction", "random", "foreach",
    "matmul", "grouped_matmul", "linalg_factor", "ldl", "nn", "conv", "resample", "attention", "transformer", "shape",
    "indexing", "scatter",
    "special", "bessel", "embedding_bag", "fractional_pool", "histogram", "allclose", "rrelu",
    "segment_reduce", "grid_sample3d", "grid_sample2d", "upsample_aa", "ctc", "margin_losses",
    "linear_cross_entropy", "fft", "sorting", "misc",
    # Last: registers only what no family above lowers.
    "compile_extras",
]

for _family in FAMILIES:
    importlib.import_module(f"{__name__}.{_family}")
