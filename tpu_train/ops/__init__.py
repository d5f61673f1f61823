"""aten → JAX lowerings, one function per op, grouped by family (see ``registry``).

Importing this package registers every family. ``registry.lowered_ops()`` lists the table.
"""

import importlib

FAMILIES = [] if __import__("os").environ.get("TPU_TRAIN_DEV_NO_OPS") else [
    "pointwise", "activations", "comparison", "conversion", "reduction", "random", "foreach",
    "matmul", "nn", "conv", "attention", "shape", "indexing", "scatter",
]

for _family in FAMILIES:
    try:
        importlib.import_module(f"{__name__}.{_family}")
    except ModuleNotFoundError as _error:
        if _error.name != f"{__name__}.{_family}":
            raise
