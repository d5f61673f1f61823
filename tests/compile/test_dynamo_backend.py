"""``torch.compile(model, backend="tpu")`` against eager tpu execution of the same model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tpu_train.compile import dynamo_backend
from tests.compile.helpers import (DEVICE, MLP_FUNCTIONS, TINY_LLAMA_FUNCTIONS, assert_losses_close,
                                   assert_params_within, lm_batches, lm_loss, mlp, param_bound,
                                   tiny_llama)
from tests.platforms import cpu_child_env
from tests.tolerances import assert_rel_close, loss_rtol, rtol_for

# As a checkout used without `pip install` does; an installed tpu_train is also found through
# its entry point (test_backend_works_right_after_import_tpu_train).
dynamo_backend.register()

# Float32 tolerances (tests/tolerances.py). Longest reductions: the MLP's forward the hidden
# size 32 (its MSE: 8 x 5 = 40 outputs); the tiny Llama's SwiGLU hidden size 176. Each counts
# its model's elementwise functions (helpers.MLP_FUNCTIONS, TINY_LLAMA_FUNCTIONS).
F32 = torch.float32
MLP_FORWARD_N, MLP_N, LLAMA_N = 32, 40, 176
MLP_FORWARD_RTOL = rtol_for(F32, MLP_FORWARD_N, functions=MLP_FUNCTIONS)


def _train(model, forward, batches, loss_of, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches[:steps]:
        loss = loss_of(forward, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _mlp_batches(n):
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(8, 12, generator=g).to(DEVICE),
             "y": torch.randn(8, 5, generator=g).to(DEVICE)} for _ in range(n)]


def _mlp_loss(forward, batch):
    return F.mse_loss(forward(batch["x"]), batch["y"])


def test_mlp_inference_matches_eager():
    torch._dynamo.reset()
    model = mlp().to(DEVICE)
    x = torch.randn(8, 12).to(DEVICE)
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        # One forward (normwise over the output).
        assert_rel_close(compiled(x), model(x), MLP_FORWARD_RTOL, "output")


def test_mlp_training_matches_eager():
    torch._dynamo.reset()
    eager = mlp().to(DEVICE)
    model, initial = copy.deepcopy(eager), copy.deepcopy(eager)
    batches = _mlp_batches(1) * 3  # one batch: the loss must fall
    compiled_losses = _train(model, torch.compile(model, backend="tpu"), batches, _mlp_loss, 3)
    eager_losses = _train(eager, eager, batches, _mlp_loss, 3)
    # 3 plain SGD steps (linear in the gradient): losses by steps * rtol, parameters relative
    # to their accumulated update.
    assert_losses_close(compiled_losses, eager_losses,
                        loss_rtol(F32, 3, MLP_N, functions=MLP_FUNCTIONS))
    assert compiled_losses[-1] < compiled_losses[0]
    assert_params_within(model, eager,
                         param_bound("sgd", initial, 3, MLP_N, functions=MLP_FUNCTIONS))


def test_graph_break_runs_eager_between_compiled_regions():
    torch._dynamo.reset()
    model = mlp().to(DEVICE)
    seen = []

    def forward(x):
        h = model[1](model[0](x))
        seen.append(float(h.sum().item()))  # data-dependent host read: a graph break
        return model[4](model[3](model[2](h)))

    x = torch.randn(8, 12).to(DEVICE)
    with torch.no_grad():
        out = torch.compile(forward, backend="tpu")(x)
        assert_rel_close(out, model(x), MLP_FORWARD_RTOL, "output")  # one forward
    assert len(seen) == 1


def test_tiny_llama_training_matches_eager():
    torch._dynamo.reset()
    eager = tiny_llama().to(DEVICE)
    model = copy.deepcopy(eager)
    batches = [{k: v.to(DEVICE) for k, v in b.items()} for b in lm_batches(1)] * 3
    compiled_losses = _train(model, torch.compile(model, backend="tpu"), batches, lm_loss, 3)
    eager_losses = _train(eager, eager, batches, lm_loss, 3)
    # 3 SGD steps of the tiny Llama.
    assert_losses_close(compiled_losses, eager_losses,
                        loss_rtol(F32, 3, LLAMA_N, functions=TINY_LLAMA_FUNCTIONS))
    assert compiled_losses[-1] < compiled_losses[0]


def _declared_dynamo_backends() -> dict[str, str]:
    """pyproject.toml's ``[project.entry-points.torch_dynamo_backends]`` table (read as lines:
    tomllib is Python 3.11+)."""
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text().splitlines()
    start = lines.index("[project.entry-points.torch_dynamo_backends]") + 1
    table = {}
    for line in lines[start:]:
        if not line.strip() or line.startswith("["):
            break
        key, _, value = line.partition("=")
        table[key.strip()] = value.strip().strip('"')
    return table


def test_backend_works_right_after_import_tpu_train(tmp_path):
    """A fresh process that imports only torch and tpu_train compiles with backend="tpu": torch
    finds it through the entry point pyproject.toml declares. The entry point is installed here
    as a distribution's metadata on PYTHONPATH, exactly as ``pip install`` writes it, so the
    test holds whether or not the environment's install predates the declaration. What it tests
    is the registration, not a platform: the child runs on the cpu platform (on a TPU host this
    process holds the chip)."""
    import subprocess
    import sys
    from pathlib import Path

    declared = _declared_dynamo_backends()
    assert declared == {"tpu": "tpu_train.compile.dynamo_backend:tpu_backend"}
    info = tmp_path / "tpu_train_entry_points-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tpu-train-entry-points\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(
        "[torch_dynamo_backends]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
    script = ("import sys, torch, tpu_train\n"
              "assert 'torch._dynamo' not in sys.modules  # the import itself stays light\n"
              "f = torch.compile(lambda x: x * 2 + 1, backend='tpu')\n"
              "print(f(torch.arange(3.0, device='tpu')).cpu().tolist())\n")
    root = str(Path(__file__).resolve().parents[2])
    env = cpu_child_env(root, tmp_path)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[1.0, 3.0, 5.0]", done.stdout
