"""Settings under which a step that did not fit in device memory would, for the one-line
error of an out-of-memory compile (:class:`tpu_train.compile.ProgramOutOfMemoryError`).

XLA knows what the program needed; the analytic model (:mod:`.estimate`) knows how the
need moves with the settings. Each candidate's estimate is scaled by XLA's figure over the
estimate of the settings that failed (the model's error is mostly a common factor: the same
buffers it leaves out or overstates), and a candidate fits when that is within the device's
memory. Candidates change as little as possible: first the remat policy alone (in the order
of the recomputation they cost), then fewer rows at once (``trainer.micro_batch_size``), then
both.
"""

from __future__ import annotations

from typing import Any

from tpu_train.compile.memory_errors import gib

from .estimate import estimate_from_config, remat_of

_POLICIES = ("none", "save_dots", "save_qkv_proj", "full")
_MOST = 3


def _rows_at_once(config: Any, shards: int) -> int:
    rows = int(config.data.batch_size) // shards
    micro = config.trainer.get("micro_batch_size")
    return min(rows, int(micro)) if micro else rows


def settings_that_fit(config: Any, needed_bytes: int, capacity_bytes: int,
                      num_devices: int) -> list[str]:
    """Up to three overrides (``"trainer.remat=save_dots (~12.3 GiB)"``) that would fit in
    ``capacity_bytes``, given that the config's step needed ``needed_bytes`` per device."""
    current = estimate_from_config(config, num_devices=num_devices)
    shards = current["mesh"]["data"] * current["mesh"]["fsdp"]
    scale = needed_bytes / current["bytes_total"]
    remat, rows = remat_of(config), _rows_at_once(config, shards)
    policies = [p for p in _POLICIES[_POLICIES.index(remat) + 1:]] if remat in _POLICIES else []
    smaller = [r for r in (rows // 2, rows // 4, rows // 8, 1) if 0 < r < rows]
    smaller = sorted(set(smaller), reverse=True)
    candidates = ([(p, rows) for p in policies] + [(remat, r) for r in smaller]
                  + [(p, r) for r in smaller for p in policies])
    found = []
    for policy, micro in candidates:
        figures = estimate_from_config(config, num_devices=num_devices, remat=policy,
                                       batch=micro * shards)
        predicted = figures["bytes_total"] * scale
        if predicted > capacity_bytes:
            continue
        overrides = ([f"trainer.remat={policy}"] if policy != remat else []) \
            + ([f"trainer.micro_batch_size={micro}"] if micro != rows else [])
        found.append(f"{' '.join(overrides)} (~{gib(predicted)})")
        if len(found) == _MOST:
            break
    return found


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
        return (message + "; no smaller micro-batch or remat policy fits by the planner's "
                "estimate: shard the model over more chips (parallel.fsdp)")
    return message + "; settings that would fit (planner's estimate): " + ", ".join(fitting)
