"""The compiled SPMD step over several processes gives the single-process losses.

Each process has 2 virtual CPU devices; ``dist.init_process_group("tpu")`` starts
``jax.distributed`` on 127.0.0.1, so the mesh (FSDP over all devices of all processes) spans
the processes and XLA's collectives cross them (gloo). The reference is the same step
compiled for one device in this process (shared with ``test_compiled_spmd``).
"""

import json

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.tolerances import loss_rtol

STEPS = 3
# Float32, longest reduction 128 (test_compiled_spmd.SPMD_N: vocab, SwiGLU hidden, 8 x 16
# tokens): the losses of STEPS steps, and of the step after a restore (STEPS + 1).
SPMD_N = 128
REL = loss_rtol(torch.float32, STEPS, SPMD_N)
NEXT_REL = loss_rtol(torch.float32, STEPS + 1, SPMD_N)


def _run(world: int, devices_per_process: int, timeout: float, checkpoint=None):
    args = ["tests/parallel/workers/spmd_worker.py", str(STEPS)]
    args += [str(checkpoint)] if checkpoint is not None else []
    outputs = run_ranks(
        args, world, timeout=timeout,
        extra_env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}"})
    results = []
    for code, log in outputs:
        lines = [l for l in log.splitlines() if l.startswith("RESULT ")]
        assert code == 0 and len(lines) == 1, log[-4000:]
        results.append(json.loads(lines[0][len("RESULT "):]))
    return results


def _single_process_losses():
    from tests.parallel.test_compiled_spmd import _train

    return _train(None)[0][:STEPS]


def _check(results, world, per_process):
    reference = _single_process_losses()
    for rank, r in enumerate(results):
        assert r["rank"] == rank
        assert r["devices"] == world * per_process and r["local_devices"] == per_process, r
        assert r["compilations"] == 1, r
        assert r["losses"] == pytest.approx(reference, rel=REL), (r, reference)
    assert reference[-1] < reference[0]  # the model trained: not three copies of one loss


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_four_processes_two_devices_each_match_one_process(tmp_path):
    """One launch (four processes on 2 cores take ~1 minute): the losses, then the sharded
    checkpoint the processes wrote together, restored here on another mesh. Two processes
    train one model through the command line in tests/trainer/test_parallel_cli.py."""
    checkpoint = tmp_path / "ckpt"
    world = 4
    _check(_run(world, 2, timeout=380, checkpoint=checkpoint), world, 2)
    # Each process wrote its own devices' shards: one data file each, none holding it all.
    files = sorted(p for p in checkpoint.iterdir() if p.suffix == ".distcp")
    assert [p.name for p in files] == [f"__{rank}_0.distcp" for rank in range(world)]
    sizes = [p.stat().st_size for p in files]
    assert min(sizes) > 0.6 * sum(sizes) / world, sizes
    # Saved by 4 processes on FSDP=8, restored by this one on TP=2 x FSDP=4: the next step
    # gives the one-device run's next loss.
    import tpu_train
    from tests.parallel.spmd_model import batches
    from tests.parallel.test_sharded_checkpoint import _fresh_step
    from tpu_train.parallel.sharded_checkpoint import load_sharded

    step = _fresh_step((1, 4, 2))
    load_sharded(checkpoint, step)
    batch = {k: v.to(tpu_train.device(0)) for k, v in batches(STEPS + 1)[STEPS].items()}
    from tests.parallel.test_compiled_spmd import _train

    assert float(step(batch)["loss"]) == pytest.approx(_train(None)[0][STEPS], rel=NEXT_REL)
