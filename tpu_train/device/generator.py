"""``torch.Generator(device="tpu")``: an explicit random stream for tpu random ops.

PyTorch builds generators for a PrivateUse1 device only through a C++ factory
(``REGISTER_GENERATOR_PRIVATEUSE1`` / the hooks' ``getNewGenerator``); a Python backend cannot
register one, so ``torch.Generator(device="tpu")`` raises. Two pieces make it work:

* :class:`TpuGenerator` is a ``torch.Generator`` (so every ``generator=`` argument accepts it)
  whose state is a CPU generator's (Mersenne Twister): ``manual_seed``, ``seed``,
  ``initial_seed``, ``get_state``/``set_state``, ``clone_state`` and pickling behave as for any
  generator, and ``device`` reports the tpu device. A random op on a tpu tensor that is given
  a generator draws 64 bits from it and derives its PRNG key from them
  (:func:`key_from_generator`), so the same seed gives the same samples, and the device's
  default stream (``torch.manual_seed``) is not advanced, as with a CUDA generator.
* :func:`install` replaces the name ``torch.Generator`` by a subclass of PyTorch's generator
  type that builds a :class:`TpuGenerator` for a tpu device and PyTorch's own generator
  otherwise; ``isinstance(g, torch.Generator)`` stays true for every generator.

The samples differ from CUDA's or the CPU's for the same seed (different generator
algorithms), as they do between CUDA and the CPU. When an op's arguments reach the device,
PyTorch has re-wrapped the generator as its base type, so a CPU generator passed to a tpu op
is accepted as a source too (CUDA would refuse it).
"""

from __future__ import annotations

import jax
import torch

from tpu_train.device import runtime

DEVICE_TYPE = "tpu"
_TorchGenerator = torch._C.Generator


def _tpu_index(device) -> int:
    device = torch.device(device)
    if device.index is not None:
        runtime.jax_device(device.index)  # range check with a clear message
        return device.index
    from tpu_train.device import module

    return module.current_device()


class TpuGenerator(_TorchGenerator):
    """A generator for ``tpu:i``; see the module docstring."""

    def __new__(cls, device=DEVICE_TYPE):
        self = super().__new__(cls)  # a CPU generator: it holds the state
        self._device = torch.device(DEVICE_TYPE, _tpu_index(device))
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    def __repr__(self):
        return f"<TpuGenerator device={self._device}>"

    # PyTorch's versions of these rebuild the C++ type, which would lose the tpu device.
    def __reduce__(self):
        _, _, state = super().__reduce__()
        return (TpuGenerator, (self._device,), state)

    def clone_state(self) -> "TpuGenerator":
        clone = TpuGenerator(self._device)
        clone.set_state(self.get_state())
        return clone


class _GeneratorType(type(_TorchGenerator)):
    # Generators made by PyTorch itself (torch.default_generator, generators returned into
    # ops) are instances of the base type: they must stay ``torch.Generator``s.
    def __instancecheck__(cls, instance):
        return isinstance(instance, _TorchGenerator)

    def __subclasscheck__(cls, subclass):
        return issubclass(subclass, _TorchGenerator)


class Generator(_TorchGenerator, metaclass=_GeneratorType):
    __doc__ = _TorchGenerator.__doc__

    def __new__(cls, device=None):
        if device is not None and torch.device(device).type == DEVICE_TYPE:
            return TpuGenerator(device)
        return _TorchGenerator() if device is None else _TorchGenerator(device)


def key_from_generator(generator: _TorchGenerator, index: int) -> jax.Array:
    """A PRNG key for one random op on ``tpu:index``, drawn from ``generator``'s stream."""
    bits = int(torch.randint(0, 2 ** 62, (), generator=generator))
    key = jax.random.fold_in(jax.random.key(bits & 0xFFFFFFFF), bits >> 32)
    return jax.device_put(key, runtime.jax_device(index))


def install() -> None:
    """Make ``torch.Generator(device="tpu")`` build a :class:`TpuGenerator` (idempotent)."""
    if torch.Generator is not Generator:
        Generator.__module__ = "torch"
        torch.Generator = Generator
