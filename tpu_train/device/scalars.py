"""Python numbers an executable takes as inputs, kept on the device once per value.

JAX turns a Python float argument of a jitted call into a fresh device buffer on every call:
on a TPU that is a host-to-device transfer per number per op. An optimizer passes the same
numbers over and over (its betas, eps, the learning rate, and each step's bias corrections
once per parameter: ``_foreach_addcdiv_.ScalarList`` takes 21 floats a call for a 21-parameter
model). Here each value is transferred once per device and the same ``jax.Array`` is passed
from then on. It has the type JAX gives the Python number (float32 and int32 weakly typed,
bool), so the program traced for it is the one traced for the number.
"""

from __future__ import annotations

import jax

from tpu_train.device import runtime

_MAX_VALUES = 4096  # per device; step-dependent values (bias corrections) come and go
_by_device: dict = {}
_placers: dict = {}


def _placer(index: int):
    """A jitted identity whose results live on ``tpu:index``: JAX's C++ call path turns the
    number into a buffer of the right type (~18 µs on the CPU client, where ``jax.device_put``
    of a Python float takes ~86 µs of Python)."""
    placer = _placers.get(index)
    if placer is None:
        device = jax.sharding.SingleDeviceSharding(runtime.jax_device(index))
        placer = _placers[index] = jax.jit(lambda value: value, out_shardings=device,
                                           compiler_options=runtime.op_program_options())
    return placer


def on_device(value, index: int) -> jax.Array:
    """``value`` (a Python float, int or bool) as a ``jax.Array`` on ``tpu:index``."""
    cache = _by_device.get(index)
    if cache is None:
        cache = _by_device[index] = {}
    cls = type(value)
    if cls is float:
        # 0.0 == -0.0 and nan != nan: those are keyed by their exact bits.
        key = value if value == value and value != 0.0 else value.hex()
    else:
        key = (cls, value)  # True == 1 == 1.0 as keys: the type keeps them apart
    array = cache.get(key)
    if array is None:
        if len(cache) >= _MAX_VALUES:
            cache.clear()
        array = cache[key] = _placer(index)(value)
    return array


def on_one_device(inputs) -> bool:
    """No array among ``inputs`` spans several devices. A tensor sharded over a mesh (SPMD
    eager) runs its ops on all of the mesh's devices, where a number placed on one device
    would not go: such calls keep their Python numbers, which JAX places as the program's
    sharding needs."""
    single = jax.sharding.SingleDeviceSharding
    return all(type(v.sharding) is single for v in inputs if isinstance(v, jax.Array))


def place_floats(inputs: list, entry) -> None:
    """Replace the Python floats among an op executable's ``inputs`` by their device arrays on
    ``entry.index``, where the call runs on that device alone (:func:`on_one_device`).
    ``entry.float_slots`` keeps their positions, found on the entry's first call (the same on
    every call: the entry's key says which arguments are floats)."""
    slots = entry.float_slots
    if slots is None:
        slots = entry.float_slots = tuple(i for i, v in enumerate(inputs) if type(v) is float)
    if not slots or not on_one_device(inputs):
        return
    index = entry.index
    for slot in slots:
        inputs[slot] = on_device(inputs[slot], index)
