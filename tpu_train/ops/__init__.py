"""aten → JAX lowerings, one function per op, grouped by family (see ``registry``).

Importing this package registers every family. ``registry.lowered_ops()`` lists the table.
"""

import importlib

FAMILIES = [
    "pointwise", "activations", "comparison", "conversion", "reduction", "random", "foreach",
    "matmul", "nn", "conv", "attention", "shape", "indexing", "scatter",
    "special", "fft", "sorting",
]
if importlib.util.find_spec(f"{__name__}.compile_extras") is not None:
    FAMILIES.append("compile_extras")

for _family in FAMILIES:
    importlib.import_module(f"{__name__}.{_family}")
