"""The repository's Dockerfile, read instruction by instruction (no image is built here: that
needs the registries): the base, the CPU-only torch wheel at the version constraints.txt pins,
the package with its ``tpu`` extra under the constraints, and ``tpu-train`` as the entrypoint;
and what the build context leaves out (.dockerignore)."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        logical.append(current)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1].strip()) for text in logical]


def _index(steps, instruction, pattern):
    found = [i for i, (name, args) in enumerate(steps)
             if name == instruction and re.search(pattern, args)]
    assert len(found) == 1, f"expected one {instruction} matching {pattern!r}, got {found}"
    return found[0]


def test_the_image_installs_cpu_torch_then_the_tpu_extra_under_the_constraints():
    steps = instructions()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert steps[0][0] == "FROM"
    base = re.fullmatch(r"python:(\d+)\.(\d+)-slim", steps[0][1])
    assert base and (int(base[1]), int(base[2])) >= (3, 11), steps[0]  # jax 0.10 needs 3.11
    assert ("WORKDIR", "/app") in steps  # docs/tpu.md runs /app/scripts/gke/tpu_env.py

    copy_constraints = _index(steps, "COPY", r"^constraints\.txt \./$")
    torch = _index(steps, "RUN", r"--index-url https://download\.pytorch\.org/whl/cpu")
    copy_all = _index(steps, "COPY", r"^\. \.$")
    package = _index(steps, "RUN", r'pip install -c constraints\.txt "\.\[tpu\]"$')
    # torch's layer depends on the constraints alone; the package's on the whole checkout.
    assert copy_constraints < torch < copy_all < package
    # The launcher's setup uses the same wheel index (tpu_train/distributed/pod.py).
    sys.path.insert(0, str(REPO / "tpu_train" / "distributed"))
    try:
        import pod
    finally:
        sys.path.pop(0)
    assert pod.CPU_TORCH_INDEX in steps[torch][1]
    # The shell expression in the torch step finds exactly the pinned torch.
    expression = re.search(r'"(\$\(grep [^)]*\))"', steps[torch][1]).group(1)
    pinned = subprocess.run(["sh", "-c", f'echo "{expression}"'], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.strip()
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", pinned), pinned
    assert "tpu" in pyproject["project"]["optional-dependencies"]

    entrypoint = [json.loads(args) for name, args in steps if name == "ENTRYPOINT"]
    assert entrypoint == [["tpu-train"]]
    assert "tpu-train" in pyproject["project"]["scripts"]


def test_the_build_context_leaves_out_environments_and_runs():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "runs"} <= ignored
    # What the image needs is not ignored.
    for needed in ("constraints.txt", "pyproject.toml", "setup.py", "tpu_train", "scripts"):
        assert (REPO / needed).exists() and needed not in ignored
