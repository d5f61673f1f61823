"""Does this host have TPU chips? Read from the machine, not from JAX, so that the answer holds
when JAX cannot use the chips (libtpu missing, a chip held by another process) and costs a
few directory listings.

A TPU host shows its chips in three ways, each checked here:

- **PCI**: devices of Google's vendor id with a TPU device id under ``/sys/bus/pci/devices``
  (the count JAX's own Cloud TPU start-up makes, ``jax._src.hardware_utils``);
- **device files**: ``/dev/accel<N>`` (TPU v2-v4) or ``/dev/vfio/<N>`` (v5e and later), the
  files libtpu opens;
- **environment**: ``TPU_ACCELERATOR_TYPE`` (libtpu's name for the slice) or ``TPU_WORKER_ID``
  (set by GKE in every pod of a multi-host TPU job). ``TPU_WORKER_HOSTNAMES`` alone is not
  evidence: compile-only TPU analysis on a laptop sets it to ``localhost``.

Every function takes the filesystem root and the environment so that tests can describe a
TPU host on a machine without one.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Mapping

GOOGLE_PCI_VENDOR = "0x1ae0"
# Google's PCI vendor id also covers its virtual NIC (gVNIC), so the device id must match.
TPU_PCI_DEVICES = {"0x0027": "v2/v3", "0x0056": "TPU", "0x005e": "v4", "0x0062": "v5p",
                   "0x0063": "v5e", "0x006f": "v6e", "0x0076": "TPU7x"}
TPU_ENVIRONMENT = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID")
# /dev/accel<N> only: the kernel's generic accelerator class (Intel NPUs) uses /dev/accel/.
_ACCEL_FILE = re.compile(r"accel\d+")


def pci_tpu_chips(root: str | os.PathLike = "/") -> dict[str, int]:
    """TPU chips on the PCI bus, by generation: ``{"v5e": 4}``; empty on any other host."""
    chips: dict[str, int] = {}
    devices = Path(root, "sys/bus/pci/devices")
    try:
        entries = list(devices.iterdir())
    except OSError:
        return chips
    for entry in entries:
        try:
            if (entry / "vendor").read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            generation = TPU_PCI_DEVICES.get((entry / "device").read_text().strip())
        except OSError:
            continue
        if generation:
            chips[generation] = chips.get(generation, 0) + 1
    return chips


def tpu_device_files(root: str | os.PathLike = "/") -> list[str]:
    """The TPU device files present: ``/dev/accel<N>`` and ``/dev/vfio/<N>``."""
    dev = Path(root, "dev")
    found = []
    for folder, pattern in ((dev, _ACCEL_FILE), (dev / "vfio", re.compile(r"\d+"))):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        found += [f"/{folder.relative_to(root)}/{n}" for n in sorted(names)
                  if pattern.fullmatch(n)]
    return found


def hardware_evidence(root: str | os.PathLike = "/") -> list[str]:
    """What the machine itself shows of TPU chips, one phrase each (empty: no chips)."""
    evidence = [f"{count} TPU {generation} chip(s) on PCI"
                for generation, count in sorted(pci_tpu_chips(root).items())]
    files = tpu_device_files(root)
    if files:
        shown = ", ".join(files[:4]) + (", ..." if len(files) > 4 else "")
        evidence.append(f"device files {shown}")
    return evidence


def environment_evidence(env: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    return [f"{name}={env[name]}" for name in TPU_ENVIRONMENT if env.get(name, "").strip()]


def tpu_evidence(root: str | os.PathLike = "/", env: Mapping[str, str] | None = None) -> list[str]:
    """Everything that says this host has TPU chips (empty on a host without any)."""
    return hardware_evidence(root) + environment_evidence(env)


def libtpu_installed(env: Mapping[str, str] | None = None) -> bool:
    """Is libtpu where JAX looks for it (the ``libtpu`` package, or ``TPU_LIBRARY_PATH``)?
    Answered without loading it."""
    env = os.environ if env is None else env
    path = env.get("TPU_LIBRARY_PATH", "")
    if path and os.path.isfile(path):
        return True
    return importlib.util.find_spec("libtpu") is not None


# NVIDIA's (those JAX checks before it starts its CUDA backend) and AMD's kernel driver.
_GPU_DEVICE_FILES = ("dev/nvidia0", "dev/nvidiactl", "dev/dxg", "dev/kfd")


def gpu_visible(root: str | os.PathLike = "/") -> bool:
    """Could a GPU plugin of JAX find a device here?"""
    return any(Path(root, name).exists() for name in _GPU_DEVICE_FILES)
