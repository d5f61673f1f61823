"""libtpu's per-process environment that the launcher sets on TPU VMs (no TPU needed: the
variables are computed, and the launcher's argument handling is checked)."""

import pytest

from tpu_train.distributed import launch, tpu_env


def test_one_host_four_chips_gives_each_process_its_chip():
    envs = [tpu_env.slice_env(nproc=4, nnodes=1, node_rank=0, local_rank=i) for i in range(4)]
    assert [e["TPU_VISIBLE_CHIPS"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["CLOUD_TPU_TASK_ID"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["TPU_PROCESS_PORT"] for e in envs] == ["8476", "8477", "8478", "8479"]
    assert {e["TPU_PROCESS_BOUNDS"] for e in envs} == {"2,2,1"}
    assert {e["TPU_CHIPS_PER_PROCESS_BOUNDS"] for e in envs} == {"1,1,1"}
    assert {e["TPU_PROCESS_ADDRESSES"] for e in envs} == {
        "localhost:8476,localhost:8477,localhost:8478,localhost:8479"}


def test_two_hosts_multiply_the_host_grid_and_list_every_process():
    env = tpu_env.slice_env(nproc=4, nnodes=2, node_rank=1, local_rank=2,
                            host_bounds="1,1,2", worker_hosts="10.0.0.1,10.0.0.2")
    assert env["TPU_PROCESS_BOUNDS"] == "2,2,2"
    assert env["CLOUD_TPU_TASK_ID"] == "6"
    assert env["TPU_VISIBLE_CHIPS"] == "2"
    addresses = env["TPU_PROCESS_ADDRESSES"].split(",")
    assert len(addresses) == 8 and addresses[6] == "10.0.0.2:8478"


@pytest.mark.parametrize("kwargs, message", [
    (dict(nproc=3, nnodes=1), "1, 2, 4 or 8 processes per host"),
    (dict(nproc=4, nnodes=2), "--tpu-host-bounds"),
    (dict(nproc=4, nnodes=2, host_bounds="1,1,4", worker_hosts="a,b"), "describe 4 hosts"),
    (dict(nproc=4, nnodes=2, host_bounds="1,1,2"), "--tpu-worker-hosts"),
    (dict(nproc=4, nnodes=2, host_bounds="1,1,2", worker_hosts="a"), "1 TPU worker hosts"),
    (dict(nproc=4, nnodes=2, host_bounds="1,x,2", worker_hosts="a,b"), "three positive integers"),
])
def test_bad_slices_are_named(kwargs, message):
    with pytest.raises(tpu_env.TpuEnvError, match=message):
        tpu_env.slice_env(node_rank=0, local_rank=0, **kwargs)


def test_user_placement_wins_whole():
    values = tpu_env.slice_env(nproc=2, nnodes=1, node_rank=0, local_rank=1)
    assert tpu_env.apply({"TPU_VISIBLE_CHIPS": "3"}, values) == {"TPU_VISIBLE_CHIPS": "3"}
    assert tpu_env.apply({"PATH": "/bin"}, values)["TPU_VISIBLE_CHIPS"] == "1"


def test_launcher_adds_the_environment_only_when_asked_or_on_a_tpu_host(monkeypatch):
    monkeypatch.setattr(tpu_env, "host_has_tpu_chips", lambda: False)
    args = launch.parse_args(["--nproc", "2", "train.py"])
    assert "TPU_VISIBLE_CHIPS" not in launch.rank_env(args, 1, "127.0.0.1", 29500)
    args = launch.parse_args(["--nproc", "2", "--tpu-env", "on", "train.py"])
    env = launch.rank_env(args, 1, "127.0.0.1", 29500)
    assert env["TPU_VISIBLE_CHIPS"] == "1" and env["RANK"] == "1"
    monkeypatch.setattr(tpu_env, "host_has_tpu_chips", lambda: True)
    args = launch.parse_args(["--nproc", "2", "train.py"])
    assert launch.rank_env(args, 0, "127.0.0.1", 29500)["TPU_PROCESS_BOUNDS"] == "2,1,1"
    # One process per host drives all of its chips: nothing to split.
    args = launch.parse_args(["--nproc", "1", "train.py"])
    assert "TPU_VISIBLE_CHIPS" not in launch.rank_env(args, 0, "127.0.0.1", 29500)


def test_launcher_rejects_an_impossible_tpu_layout_before_starting(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.parse_args(["--nproc", "3", "--tpu-env", "on", "train.py"])
    assert exit_info.value.code == 2
    assert "1, 2, 4 or 8 processes per host" in capsys.readouterr().err
