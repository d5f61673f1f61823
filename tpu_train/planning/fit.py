"""Settings under which a step that does not fit in device memory would: for the one-line
error of an out-of-memory compile (:class:`tpu_train.compile.ProgramOutOfMemoryError`) and for
``tpu-train plan``'s verdict.

XLA knows what the program needs; the analytic model (:mod:`.estimate`) knows how the need
moves with the settings. Each candidate's estimate is scaled by XLA's figure over the
estimate of the settings planned (the model's error is mostly a common factor: the same
buffers it leaves out or overstates), and a candidate fits when that is within the device's
memory. Candidates change as little as possible, cheapest first: the same chips before more
chips, fewer changed settings before more, the weights' dtype kept before narrowed
(``trainer.param_dtype=bf16`` loses small updates), fewer pieces a step is cut into
(``trainer.micro_batch_size``) before more, less recomputation (``trainer.remat``) before
more, and the layers' inputs in host memory (``trainer.remat=offload``, with the layers scanned)
last; so AdamW's moments in bf16 (``optim.state_dtype=bf16``: 2 bytes a value instead of 4,
no slower) come before a smaller micro-batch or more recomputation. The chips can be laid out otherwise (``parallel.tensor`` splits each layer's
activations, taken from ``fsdp``) or be more of them (``parallel.fsdp`` doubled or quadrupled, the global batch raised to split over
them where it would not). The planner also offers a float32 step computed in bf16
(``trainer.precision=bf16``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from tpu_train.compile.memory_errors import gib
from tpu_train.parallel.mesh import resolve_mesh_shape

from .estimate import (compute_dtype_of, estimate_from_config, pieces, remat_of, setting,
                       stored_bytes)

__all__ = ["Candidate", "fitting_candidates", "out_of_memory_message", "override_value",
           "settings_that_fit"]

# Least recomputation first; ``offload`` (each scanned layer's input in host memory) last: it
# recomputes as ``full`` does and adds the host transfers, and it needs the layers scanned.
_POLICIES = ("none", "save_dots", "save_qkv_proj", "full", "offload")
_TENSOR_FACTORS = (1, 2, 4, 8)
_CHIP_FACTORS = (1, 2, 4)
_MOST = 3


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Settings that would fit: ``changes`` (dotted config keys to values), the bytes per
    chip they are predicted to need, and the chips they run on."""

    changes: dict
    predicted_bytes: float
    num_devices: int

    def overrides(self) -> list[str]:
        """``["trainer.remat=full", ...]``: the changes as command-line overrides."""
        return [f"{key}={override_value(value)}" for key, value in self.changes.items()]


def override_value(value: Any) -> str:
    """A config value as Hydra's override grammar writes it (``null``, ``true``, an enum's
    value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(getattr(value, "value", value))


def _layouts(config: Any, num_devices: int,
             more_chips: bool) -> list[tuple[int, int, dict]]:
    """``(chips, batch shards, parallel changes)`` of the meshes to try: the planned one, ``tensor`` taken
    from ``fsdp`` (then ``data``) on the same chips, and each of those on more ``fsdp`` chips."""
    expert = int(config.parallel.get("expert", 1))
    shape = resolve_mesh_shape(num_devices, int(config.parallel.data),
                               int(config.parallel.fsdp), int(config.parallel.tensor),
                               expert=expert,
                               context=int(config.parallel.get("context", 1) or 1))
    found = []
    for grow, factor in itertools.product(_CHIP_FACTORS if more_chips else (1,),
                                          _TENSOR_FACTORS):
        data, fsdp, tensor = shape.data, shape.fsdp, shape.tensor * factor
        if factor > 1:
            if fsdp % factor == 0:
                fsdp //= factor
            elif data % factor == 0:
                data //= factor
            else:
                continue
        fsdp *= grow
        changes = {key: value for key, value, was in (
            ("parallel.data", data, shape.data), ("parallel.fsdp", fsdp, shape.fsdp),
            ("parallel.tensor", tensor, shape.tensor)) if value != was}
        found.append((num_devices * grow, data * fsdp * expert, changes))  # context kept as is
    return found


def _batches(config: Any, shards: int, changes: dict) -> list[dict]:
    """The batch changes to try over ``shards`` batch shards: the global batch raised to split
    where it would not, then each smaller number of rows at once that divides a shard's rows."""
    batch = int(config.data.batch_size)
    if batch % shards:
        batch = -(-batch // shards) * shards
        changes = {**changes, "data.batch_size": batch}
    rows_at_once = pieces(config, shards, changes)[0] // shards
    rows = batch // shards
    fewer = [r for r in range(rows_at_once - 1, 0, -1) if rows % r == 0]
    return [changes] + [{**changes, "trainer.micro_batch_size": r} for r in fewer]


def _narrower(config: Any, precision: bool) -> list[dict]:
    """The dtype changes to try: none, AdamW's moments in bf16 (where they are wider and
    the optimizer has them), the weights in bf16 (their moments follow, as in torch); with
    ``precision``, for a step computed in float32, each of those computed in bf16
    (``trainer.precision=bf16``: half the activations' bytes and the TPU's attention kernels,
    weights kept in float32)."""
    found = [{}]
    weights = stored_bytes(setting(config, "trainer.param_dtype")) or 4
    moments = stored_bytes(setting(config, "optim.state_dtype")) or weights
    if moments > 2 and setting(config, "optim.name") in ("adam", "adamw"):
        found.append({"optim.state_dtype": "bf16"})
    if weights > 2:
        found.append({"trainer.param_dtype": "bf16"})
    if precision and compute_dtype_of(config) is None:
        found += [{"trainer.precision": "bf16", **f} for f in found]
    return found


def fitting_candidates(config: Any, needed_bytes: float, capacity_bytes: float,
                       num_devices: int, *, more_chips: bool = True,
                       most: int = _MOST, precision: bool = False) -> list[Candidate]:
    """Up to ``most`` settings, cheapest first (module docstring), predicted to fit in
    ``capacity_bytes`` per chip, given that ``config``'s step needs ``needed_bytes``.
    ``precision``: a float32 step may also be computed in bf16 (the planner's pod plans; a
    run that stopped out of memory is not told to change its numerics)."""
    scale = needed_bytes / estimate_from_config(config, num_devices=num_devices)["bytes_total"]
    remat = remat_of(config)
    policies = _POLICIES[_POLICIES.index(remat):] if remat in _POLICIES else (remat,)
    mode = setting(config, "trainer.mode")
    if getattr(mode, "value", mode) not in (None, "compiled"):
        policies = tuple(p for p in policies if p != "offload" or p == remat)
    found = []
    for chips, shards, layout in _layouts(config, num_devices, more_chips):
        for batch_changes, policy, narrower in itertools.product(
                _batches(config, shards, layout), policies, _narrower(config, precision)):
            changes = {**batch_changes, **narrower,
                       **({"trainer.remat": policy} if policy != remat else {})}
            if policy == "offload" and setting(config, "trainer.scan_layers") is not True:
                changes["trainer.scan_layers"] = True  # offload moves scanned layers' inputs
            if not changes:
                continue
            try:
                figures = estimate_from_config(config, num_devices=chips, changes=changes)
            except ValueError:  # a mesh the model does not split over
                continue
            predicted = figures["bytes_total"] * scale
            if predicted <= capacity_bytes:
                cost = (chips, len(changes) - ("trainer.scan_layers" in changes),
                        "trainer.param_dtype" in changes,
                        figures["grad_accum_steps"],
                        _POLICIES.index(policy) if policy in _POLICIES else 0, predicted)
                found.append((cost, Candidate(changes, predicted, chips)))
    return [candidate for _, candidate in sorted(found, key=lambda item: item[0])[:most]]


def settings_that_fit(config: Any, needed_bytes: int, capacity_bytes: int,
                      num_devices: int) -> list[str]:
    """Up to three overrides on the same chips (``"trainer.remat=save_dots (~12.3 GiB)"``)
    that would fit in ``capacity_bytes``, given that the config's step needed
    ``needed_bytes`` per device."""
    return [f"{' '.join(c.overrides())} (~{gib(c.predicted_bytes)})"
            for c in fitting_candidates(config, needed_bytes, capacity_bytes, num_devices,
                                        more_chips=False)]


def out_of_memory_message(error, config: Any, num_devices: int) -> str:
    """``error``'s line, followed by the settings that would fit (where the planner can tell)."""
    message = error.summary()
    if error.needed_bytes is None or error.capacity_bytes is None:
        return message + "; lower trainer.micro_batch_size or set trainer.remat"
    try:
        fitting = settings_that_fit(config, error.needed_bytes, error.capacity_bytes,
                                    num_devices)
    except (ValueError, KeyError, AttributeError):  # a model the analytic planner cannot size
        fitting = []
    if not fitting:
        return (message + "; no smaller micro-batch, remat policy or bf16 storage fits by the planner's "
                "estimate: shard the model over more chips (parallel.fsdp)")
    return message + "; settings that would fit (planner's estimate): " + ", ".join(fitting)
