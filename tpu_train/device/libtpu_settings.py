"""The libtpu settings a TPU backend starts with, unless the user chose them.

libtpu reads ``LIBTPU_INIT_ARGS`` once, when JAX starts its TPU backend (or builds a
compile-only TPU topology), so :func:`apply_defaults` runs before that
(:func:`tpu_train.device.runtime.platform`'s first call). A flag the user names in
``LIBTPU_INIT_ARGS`` is left as they set it; other programs in the process (JAX code beside
the model) see the same backend.

``fibers_default_domain_concurrency``: the worker threads of libtpu's default fiber domain, which
run the TPU compiler's work. libtpu starts one per host core, and on a 13-core v5e host they
cost more host CPU than the compiles they run: the default job, cold, used 3.6-3.8x its wall
time in host CPU, 159 s of it in those threads, against 1.7x with 2 workers (38 s) and the
same compile times (the train step's XLA compile 10.1 s against 10.7-10.8 s, the validation
decoding program's 13.2 s against 10.8-11.0 s; docs/benchmarks.md, "The chip, a ninth pass").
"""

from __future__ import annotations

import os
from typing import MutableMapping

ENVIRONMENT_VARIABLE = "LIBTPU_INIT_ARGS"
DEFAULTS = {"fibers_default_domain_concurrency": "2"}


def named_flags(value: str) -> set[str]:
    """The flag names in a ``LIBTPU_INIT_ARGS`` value (``--name=value`` or ``--name``)."""
    return {item.lstrip("-").split("=", 1)[0] for item in value.split() if item.startswith("-")}


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Add each of :data:`DEFAULTS` the user's ``LIBTPU_INIT_ARGS`` does not name."""
    value = environ.get(ENVIRONMENT_VARIABLE, "")
    named = named_flags(value)
    added = [f"--{name}={setting}" for name, setting in DEFAULTS.items() if name not in named]
    if added:
        environ[ENVIRONMENT_VARIABLE] = " ".join(value.split() + added)
