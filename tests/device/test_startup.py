"""What ``import tpu_train`` pays for: torch, JAX and the lowering table, not the parts of torch
that only some programs use (dynamo, DTensor, FSDP2); those still work once imported."""

import os
import subprocess
import sys

import pytest
import torch

import tpu_train  # noqa: F401
from tests.platforms import cpu_child_env
from tpu_train.device import dispatch, special_ops

_HEAVY = ("torch._dynamo", "torch.distributed.tensor", "torch.distributed.fsdp")


def _run(code: str) -> str:
    """``code``'s stdout in a fresh process, on the cpu platform: what these tests check (what
    an import pays for, seeding, the backend's opening thread) is the same on every platform,
    and on a TPU host this process holds the chip."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=cpu_child_env())
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_import_leaves_dynamo_dtensor_and_fsdp_unimported_and_fsdp_is_adapted_once_imported():
    out = _run(
        "import sys, tpu_train\n"
        f"print([m for m in {_HEAVY!r} if m in sys.modules])\n"
        "from tpu_train.distributed import fsdp_compat\n"
        "print(fsdp_compat.installed())\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group\n"
        "print(fsdp_compat.installed(), _fsdp_param.free_storage is fsdp_compat.free_storage,\n"
        "      _fsdp_param_group.alloc_storage is fsdp_compat.alloc_storage)\n")
    assert out.splitlines() == ["[]", "False", "True True True"]


def test_fsdp_imported_before_tpu_train_is_adapted_at_import():
    out = _run("import torch.distributed.fsdp, tpu_train\n"
               "from tpu_train.distributed import fsdp_compat\n"
               "print(fsdp_compat.installed())\n")
    assert out == "True"


_lib = torch.library.Library("tpu_train_startup_test", "DEF")
_lib.define("echo(Tensor x) -> Tensor")


def test_a_handler_registered_by_name_serves_its_op_from_the_first_call():
    calls = []

    def handler(func, args, kwargs):
        calls.append(func)
        return args[0] * 2

    op = torch.ops.tpu_train_startup_test.echo.default
    special_ops.HANDLERS_BY_NAME["tpu_train_startup_test.echo.default"] = handler
    try:
        x = torch.ones(3, device="tpu")
        assert torch.equal(op(x).cpu(), torch.full((3,), 2.0))
        assert torch.equal(op(x).cpu(), torch.full((3,), 2.0))  # now an ordinary handler
        assert calls == [op, op]
        assert special_ops.HANDLERS.get(op) is handler
        assert "tpu_train_startup_test.echo.default" not in special_ops.HANDLERS_BY_NAME
    finally:
        special_ops.HANDLERS.pop(op, None)
        special_ops.HANDLERS_BY_NAME.pop("tpu_train_startup_test.echo.default", None)
    assert dispatch._HANDLERS is special_ops.HANDLERS


def test_seeding_opens_no_backend_and_draws_as_seeding_after_it_did():
    # torch.manual_seed seeds every tpu generator without counting devices, so the trainer
    # can open the backend on a thread meanwhile; the draws are those of a seed set once the
    # devices are known (the way seeding worked before).
    out = _run(
        "import torch, tpu_train\n"
        "from tpu_train.device import runtime\n"
        "torch.manual_seed(5)\n"
        "print(runtime.devices_enumerated())\n"
        "early = torch.rand(4, device='tpu').cpu()\n"
        "torch.manual_seed(5)\n"
        "late = torch.rand(4, device='tpu').cpu()\n"
        "torch.manual_seed(6)\n"
        "other = torch.rand(4, device='tpu').cpu()\n"
        "print(torch.equal(early, late), torch.equal(early, other))\n")
    assert out.splitlines() == ["False", "True False"]


def test_asking_whether_the_device_is_available_opens_no_backend():
    # On a TPU host the first backend to open holds the chip: a launcher that asks must leave
    # it to the processes it starts (as torch.cuda.is_available creates no CUDA context).
    out = _run(
        "import torch, tpu_train\n"
        "from tpu_train.device import runtime\n"
        "print(torch.tpu.is_available(), runtime.devices_enumerated())\n"
        "torch.ones(2, device='tpu').cpu()\n"
        "print(torch.tpu.is_available(), runtime.devices_enumerated())\n")
    assert out.splitlines() == ["True False", "True True"]


@pytest.mark.parametrize("requested, evidence, libtpu, gpu, expected", [
    ("", [], False, False, True),  # the CPU client is always there
    ("cpu", ["/dev/accel0"], True, False, True),
    ("tpu", ["/dev/accel0"], True, False, True),
    ("tpu", [], True, False, False),  # no chips
    ("tpu", ["/dev/accel0"], False, False, False),  # no libtpu to open them with
    ("cuda", [], False, True, True),
    ("cuda", [], False, False, False),
    ("tpuu", [], False, False, False),  # not a platform
])
def test_whether_a_platform_is_present_is_judged_from_the_host(monkeypatch, requested, evidence,
                                                                libtpu, gpu, expected):
    from tpu_train.device import runtime, tpu_host

    monkeypatch.setenv(runtime.PLATFORM_ENV, requested)
    monkeypatch.setattr(tpu_host, "tpu_evidence", lambda: evidence)
    monkeypatch.setattr(tpu_host, "libtpu_installed", lambda: libtpu)
    monkeypatch.setattr(tpu_host, "gpu_visible", lambda: gpu)
    assert runtime.platform_present() is expected


def test_the_backend_opened_on_a_thread_is_the_one_every_caller_gets():
    out = _run(
        "import threading, tpu_train\n"
        "from tpu_train.device import runtime\n"
        "runtime.open_in_background()\n"
        "opener = runtime._opener\n"
        "found = runtime.devices()\n"
        "print(opener.name, opener.is_alive(), len(found) >= 1, runtime.platform())\n"
        "runtime.open_in_background()\n"
        "print(runtime._opener is opener)\n")
    name, alive, some, platform = out.splitlines()[0].split()
    assert (name, alive, some) == ("tpu-train-open-backend", "False", "True")
    assert platform in ("cpu", "tpu", "cuda")
    assert out.splitlines()[1] == "True"


def _open_then_use(platform: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c",
         "import tpu_train\n"
         "from tpu_train.device import runtime\n"
         "try:\n"
         "    runtime.open_in_background()\n"
         "except runtime.PlatformError as error:\n"
         "    print('raised by the open:', error)\n"
         "else:\n"
         "    try:\n"
         "        runtime.devices()\n"
         "    except runtime.PlatformError as error:\n"
         "        print('raised by the first use:', error)\n"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TPU_TRAIN_PLATFORM": platform})


def test_a_bad_platform_setting_is_raised_before_the_backend_thread_starts():
    result = _open_then_use("abacus")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(
        "raised by the open: TPU_TRAIN_PLATFORM='abacus' is not a known platform")


@pytest.mark.host_without_chips
def test_a_backend_that_fails_to_open_on_its_thread_is_raised_by_its_first_user():
    result = _open_then_use("tpu")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("raised by the first use: TPU_TRAIN_PLATFORM=tpu but JAX "
                                    "finds no tpu devices")
    assert result.stderr == ""  # libtpu's start-up pages held back, as without the thread
