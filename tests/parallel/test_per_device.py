"""``parallelize_per_device``: FSDP2 and DTensor TP over the tpu group, one process per device.

Four processes under ``torchrun``, one virtual CPU device each, train the tiny Llama of
``spmd_model`` for 3 AdamW steps in eager mode with fsdp=4 and with tensor=2 x fsdp=2; the
losses must be the single-process eager run's, FSDP must really shard the parameters, and full
state dicts must round trip onto a freshly sharded model. The validation errors (wrong degrees,
no launcher, indivisible heads) run here in one process.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.distributed.harness import ROOT, free_port_pair
from tests.platforms import python_path
from tests.tolerances import loss_rtol
from tpu_train.models import LLAMA, Llama, LlamaConfig
from tpu_train.parallel.mesh import MeshError
from tpu_train.parallel.per_device import parallelize_per_device, resolve_per_device_shape

WORKER = "tests/parallel/workers/per_device_worker.py"
WORLD = 4
# After "/": the checkpoint load checked (see the worker); one of each keeps the test short.
CASES = ["fsdp=4/rank0", "tensor=2,fsdp=2/all"]
# Float32 (tests/tolerances.py): 3 AdamW steps of spmd_model's tiny Llama (longest reduction
# 128: vocab, SwiGLU hidden, 8 x 16 tokens), split over ranks. The step after a checkpoint
# load starts from equal values (checked): only that one step's rounding differs.
STEPS, SPMD_N = 3, 128
REL = loss_rtol(torch.float32, STEPS, SPMD_N)
NEXT_REL = loss_rtol(torch.float32, 1, SPMD_N)


def _results_from(out_dir):
    """Per rank, the worker's list of case results."""
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("result-*.json"))]


def _check(per_rank, cases, launcher):
    assert len(per_rank) == WORLD
    by_case = {case: [results[i] for results in per_rank] for i, case in enumerate(cases)}
    for case, ranks in by_case.items():
        reference = next(r["reference"] for r in ranks if "reference" in r)
        assert reference[-1] < reference[0] - 1e-3, reference  # it trained
        for r in ranks:
            assert r["launcher"] == launcher and r["world"] == WORLD, r
            assert r["losses"] == pytest.approx(reference, rel=REL), (case, r, reference)
            loads = [key for key in ("all", "rank0") if key in case.partition("/")[2]]
            for key in loads:
                assert r[f"{key}_model_equal"] and r[f"{key}_optim_equal"], (case, key, r)
                assert r[f"{key}_next_loss"] == pytest.approx(r["next_loss"], rel=NEXT_REL), r
            if loads:
                assert r["rank0_only_empty_elsewhere"] and r["rank0_matches_all"], r
        if case.startswith("fsdp=4"):
            assert all(r["shard_bytes"] <= 0.3 * r["full_bytes"] for r in ranks), ranks
        assert sorted({r["batch_rank"] for r in ranks}) == \
            list(range(WORLD // (2 if "tensor=2" in case else 1)))


@pytest.mark.multiprocess
@pytest.mark.timeout(330)
def test_fsdp_and_tensor_parallel_under_torchrun_match_one_process(tmp_path):
    """Both cases in one ``torch.distributed.run`` launch: the launcher check costs nothing
    extra (one 4-process run is ~2 minutes on 2 cores, nearly all of it the eager steps)."""
    port = free_port_pair()
    env = dict(os.environ, PYTHONPATH=python_path(ROOT), TPU_TRAIN_PLATFORM="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
         "--master-addr", "127.0.0.1", "--master-port", str(port), WORKER, str(tmp_path),
         *CASES],
        env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        out = "timed out"
    finally:
        _kill(proc, tmp_path)
    assert proc.returncode == 0, out[-4000:]
    _check(_results_from(tmp_path), CASES, "torchrun")


def _kill(proc, piddir):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # torchrun gives each rank a session of its own: end those by their recorded pid
    for path in piddir.glob("pid-*"):
        try:
            os.kill(int(path.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


TINY = LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64,
                   ffn_hidden_dim=48, max_seq_len=8)


def test_degrees_without_a_launcher_say_what_to_launch():
    with pytest.raises(MeshError, match=r"parallel.fsdp=4 in trainer.mode=eager needs 4 "
                                        r"processes.*--nproc-per-node 4.*--nproc 4"):
        resolve_per_device_shape(data=1, fsdp=4, tensor=1)
    with pytest.raises(MeshError, match=r"parallel.fsdp=2, parallel.tensor=2 .* needs 4"):
        resolve_per_device_shape(data=1, fsdp=2, tensor=2)


def test_one_process_without_degrees_is_a_no_op():
    model = Llama(TINY)
    before = [p for p in model.parameters()]
    par = parallelize_per_device(model, LLAMA, data=-1, fsdp=1, tensor=1)
    assert par.shape.sizes == (1, 1, 1, 1, 1) and par.mesh is None and par.batch_rank == 0
    assert [p for p in model.parameters()] == before


def test_degrees_are_checked_against_the_world_and_the_model(monkeypatch):
    import tpu_train.parallel.per_device as per_device

    monkeypatch.setattr(per_device, "_world_size", lambda: 4)
    assert resolve_per_device_shape(data=1, fsdp=-1, tensor=2).sizes == (1, 2, 1, 1, 2)
    with pytest.raises(MeshError, match=r"1 \* 2 \* 1 = 2, but there are 4 devices.*world size 4"):
        resolve_per_device_shape(data=1, fsdp=2, tensor=1)
    with pytest.raises(MeshError, match=r"parallel.tensor=4 .* n_kv_heads=2"):
        resolve_per_device_shape(data=1, fsdp=1, tensor=4, split_sizes=LLAMA.split_sizes(TINY))
    # FSDP2 pads uneven shards: fsdp need not divide the width
    odd = LlamaConfig(dim=40, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64,
                      ffn_hidden_dim=48, max_seq_len=8)
    monkeypatch.setattr(per_device, "_world_size", lambda: 8)
    assert resolve_per_device_shape(data=1, fsdp=8, tensor=1,
                                    split_sizes=LLAMA.split_sizes(odd)).fsdp == 8
