"""A host with TPU chips that JAX cannot use stops with one line instead of training on the host
CPU: the detection (``tpu_train.device.tpu_host``) on described machines, the platform choice
with a stand-in for JAX, and the command line in child processes."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tpu_train.device import runtime, tpu_host


def _pci(root, slot, vendor, device):
    entry = root / "sys/bus/pci/devices" / slot
    entry.mkdir(parents=True)
    (entry / "vendor").write_text(vendor + "\n")
    (entry / "device").write_text(device + "\n")


@pytest.fixture
def v5e_host(tmp_path):
    """A TPU v5e VM as the kernel shows it: four chips on PCI and their VFIO groups, beside
    Google's virtual NIC (same vendor, another device id) and a device of another vendor."""
    for i in range(4):
        _pci(tmp_path, f"0000:00:0{4 + i}.0", "0x1ae0", "0x0063")
    _pci(tmp_path, "0000:00:03.0", "0x1ae0", "0x0042")
    _pci(tmp_path, "0000:00:01.0", "0x8086", "0x7110")
    vfio = tmp_path / "dev/vfio"
    vfio.mkdir(parents=True)
    for name in ("0", "1", "2", "3", "vfio"):
        (vfio / name).write_text("")
    return tmp_path


def test_a_v5e_host_shows_its_chips_on_pci_and_as_vfio_groups(v5e_host):
    assert tpu_host.pci_tpu_chips(v5e_host) == {"v5e": 4}
    assert tpu_host.tpu_device_files(v5e_host) == [f"/dev/vfio/{i}" for i in range(4)]
    assert tpu_host.hardware_evidence(v5e_host) == [
        "4 TPU v5e chip(s) on PCI", "device files /dev/vfio/0, /dev/vfio/1, /dev/vfio/2, /dev/vfio/3"]


def test_v4_device_files_count_and_an_npu_accel_folder_does_not(tmp_path):
    dev = tmp_path / "dev"
    (dev / "accel").mkdir(parents=True)  # the kernel's accelerator class: /dev/accel/accel0
    (dev / "accel" / "accel0").write_text("")
    assert tpu_host.hardware_evidence(tmp_path) == []
    for i in range(2):
        (dev / f"accel{i}").write_text("")
    assert tpu_host.tpu_device_files(tmp_path) == ["/dev/accel0", "/dev/accel1"]


def test_a_machine_without_sysfs_or_dev_has_no_evidence(tmp_path):
    assert tpu_host.tpu_evidence(tmp_path, env={}) == []


@pytest.mark.parametrize("env, expected", [
    ({"TPU_ACCELERATOR_TYPE": "v5litepod-16"}, ["TPU_ACCELERATOR_TYPE=v5litepod-16"]),
    ({"TPU_WORKER_ID": "3", "TPU_WORKER_HOSTNAMES": "a,b,c,d"}, ["TPU_WORKER_ID=3"]),
    # compile-only TPU analysis on a laptop sets the host list alone: not a TPU host
    ({"TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1"}, []),
    ({"TPU_ACCELERATOR_TYPE": "  "}, []),
])
def test_environment_evidence(tmp_path, env, expected):
    assert tpu_host.tpu_evidence(tmp_path, env=env) == expected


def test_gpu_device_files_are_seen(tmp_path):
    assert not tpu_host.gpu_visible(tmp_path)
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "kfd").write_text("")
    assert tpu_host.gpu_visible(tmp_path)


def test_libtpu_counts_as_installed_through_tpu_library_path(tmp_path):
    library = tmp_path / "libtpu.so"
    library.write_bytes(b"")
    assert tpu_host.libtpu_installed({"TPU_LIBRARY_PATH": str(library)})


class _FakeJax:
    """What the platform choice asks JAX: devices per backend, or the backend's start-up
    error (JAX raises RuntimeError for a backend that failed or does not exist)."""

    __version__ = "0.0-test"

    def __init__(self, backends, errors=None, jax_platforms=None):
        self.backends, self.errors = backends, errors or {}
        self.config = SimpleNamespace(jax_platforms=jax_platforms)

    def devices(self, name):
        if name in self.backends:
            return self.backends[name]
        raise RuntimeError(self.errors.get(name, f"Unknown backend {name}"))


CHIPS = ["4 TPU v5e chip(s) on PCI"]


def test_chips_without_libtpu_stop_with_the_install_command(monkeypatch):
    monkeypatch.setattr(tpu_host, "libtpu_installed", lambda env=None: False)
    with pytest.raises(runtime.PlatformError) as caught:
        runtime.choose_platform(_FakeJax({"cpu": ["cpu0"]}), None, CHIPS)
    message = str(caught.value)
    assert message.startswith("this host has TPU chips (4 TPU v5e chip(s) on PCI) but JAX "
                              "cannot use them: libtpu is not installed")
    assert "pip install -c constraints.txt 'tpu_train[tpu]'" in message
    assert message.endswith("or set TPU_TRAIN_PLATFORM=cpu to run on the host CPU")
    assert "\n" not in message


def test_chips_held_by_another_process_stop_with_libtpus_reason(monkeypatch):
    monkeypatch.setattr(tpu_host, "libtpu_installed", lambda env=None: True)
    busy = ("Backend 'tpu' failed to initialize: TPU initialization failed: open(/dev/vfio/0): "
            "Device or resource busy\nmore detail")
    fake = _FakeJax({"cpu": ["cpu0"]}, errors={"tpu": busy})
    with pytest.raises(runtime.PlatformError) as caught:
        runtime.choose_platform(fake, None, CHIPS)
    message = str(caught.value)
    assert "open(/dev/vfio/0): Device or resource busy; if another process holds the chips" in message
    assert "more detail" not in message and "TPU_TRAIN_PLATFORM=cpu" in message


@pytest.mark.parametrize("backends, evidence, jax_platforms, expected", [
    ({"tpu": ["t0"], "cpu": ["c0"]}, CHIPS, None, "tpu"),  # a usable TPU wins
    ({"cpu": ["c0"]}, [], None, "cpu"),  # no chips: the CPU, as before
    ({"cpu": ["c0"]}, CHIPS, "cpu", "cpu"),  # the user's JAX_PLATFORMS leaves the TPU out
    ({"cuda": ["g0"], "cpu": ["c0"]}, [], None, "cuda"),
])
def test_platform_choice(backends, evidence, jax_platforms, expected):
    assert runtime.choose_platform(_FakeJax(backends, jax_platforms=jax_platforms), None,
                                   evidence) == expected


def test_jaxs_own_tpu_default_is_not_the_users_choice(monkeypatch):
    """On a TPU host ``import jax`` fills an unset jax_platforms with "tpu,cpu"; a process that
    asks for the cpu platform must still keep JAX to its CPU backend (the TPU one would fail on
    a chip that another process holds), while a user's own JAX_PLATFORMS stands."""
    monkeypatch.setattr(runtime, "_jax_set_its_tpu_default", lambda jax: True)
    fake = _FakeJax({"cpu": ["c0"]}, jax_platforms="tpu,cpu")
    assert runtime._jax_platforms(fake, environ={}) == ""
    assert runtime._jax_platforms(fake, environ={"JAX_PLATFORMS": "tpu,cpu"}) == "tpu,cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "")
    assert runtime._only_cpu_is_wanted(fake, "cpu", CHIPS)
    monkeypatch.setattr(tpu_host, "gpu_visible", lambda: False)
    assert not runtime._only_cpu_is_wanted(fake, None, [])  # JAX found chips: not cpu alone
    monkeypatch.setattr(runtime, "_jax_set_its_tpu_default", lambda jax: False)
    assert runtime._jax_platforms(fake, environ={}) == "tpu,cpu"  # set by the user's code
    assert runtime._jax_platforms(_FakeJax({}, jax_platforms="cpu"), environ={}) == "cpu"


def test_a_requested_cpu_that_jax_cannot_start_says_jaxs_reason():
    failed = "Unable to initialize backend 'tpu': lockfile held\nmore detail"
    with pytest.raises(runtime.PlatformError) as caught:
        runtime.choose_platform(_FakeJax({}, errors={"cpu": failed}), "cpu", [])
    assert str(caught.value) == ("TPU_TRAIN_PLATFORM=cpu but JAX finds no cpu devices (installed "
                                 "jax 0.0-test): Unable to initialize backend 'tpu': lockfile "
                                 "held, or unset TPU_TRAIN_PLATFORM")


def test_a_requested_tpu_without_libtpu_names_the_install(monkeypatch):
    monkeypatch.setattr(tpu_host, "libtpu_installed", lambda env=None: False)
    with pytest.raises(runtime.PlatformError, match=r"TPU_TRAIN_PLATFORM=tpu but JAX finds no "
                       r"tpu devices .*: libtpu is not installed; install it with pip install"):
        runtime.choose_platform(_FakeJax({"cpu": ["c0"]}), "tpu", [])


REPO = Path(__file__).resolve().parents[2]


def _python(code, tmp_path, site=None, **variables):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TPU_TRAIN_PLATFORM", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID")}
    env.update(variables, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(str(p) for p in (site, REPO) if p))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)


PLATFORM = "import tpu_train; print(tpu_train.runtime_info()['platform'])"


@pytest.mark.host_without_chips
def test_tpu_train_platform_cpu_overrides_a_tpu_host(tmp_path):
    stopped = _python(PLATFORM, tmp_path, TPU_ACCELERATOR_TYPE="v5litepod-16")
    assert stopped.returncode != 0 and stopped.stdout == ""
    assert ("PlatformError: this host has TPU chips (TPU_ACCELERATOR_TYPE=v5litepod-16) but JAX "
            "cannot use them") in stopped.stderr
    done = _python(PLATFORM, tmp_path, TPU_ACCELERATOR_TYPE="v5litepod-16", TPU_TRAIN_PLATFORM="cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu" and "libtpu" not in done.stderr


@pytest.mark.host_without_chips
def test_libtpu_on_a_host_without_chips_says_cpu_in_one_line(tmp_path):
    """A ``libtpu`` package that is only importable (JAX never loads it: on a host without
    chips the runtime keeps JAX to its CPU backend)."""
    package = tmp_path / "site" / "libtpu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("def get_library_path():\n    return '/nonexistent/libtpu.so'\n")
    done = _python(PLATFORM + "; import torch, jax; torch.ones(1, device='tpu') + 1; "
                   "print(jax.config.jax_platforms)", tmp_path, site=tmp_path / "site")
    assert done.returncode == 0, done.stderr
    # JAX was kept to its CPU backend: it never tried to load libtpu.
    assert done.stdout.split() == ["cpu", "cpu"]
    assert done.stderr.strip().splitlines() == [
        "tpu_train: libtpu is installed but this host has no TPU chips: running on the CPU "
        "(TPU_TRAIN_PLATFORM=cpu says so and silences this line)"]


def test_the_tpu_extra_pins_the_libtpu_that_the_installed_jax_asks_for():
    """``pip install tpu_train[tpu]`` brings JAX's own ``tpu`` extra (the libtpu that matches
    the installed jax; beside it gcsfs, for run directories in a bucket), and constraints.txt
    pins the libtpu that the tested jax asks for."""
    import tomllib
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["tpu"]
    jax_requirements = [Requirement(r) for r in extra if Requirement(r).name == "jax"]
    assert [r.extras for r in jax_requirements] == [{"tpu"}], extra
    (version,) = [line.split("==")[1] for line in
                  (REPO / "constraints.txt").read_text().splitlines()
                  if line.startswith("libtpu==")]
    wanted = [Requirement(r) for r in requires("jax") if r.startswith("libtpu")]
    tpu_extra = [r for r in wanted if r.marker and r.marker.evaluate({"extra": "tpu"})]
    assert tpu_extra and all(r.specifier.contains(version) for r in tpu_extra), wanted
