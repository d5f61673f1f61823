"""README stays short (150 lines at most, detail lives in docs/), and its TPU VM install command
finds the one torch version constraints.txt pins."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_is_at_most_150_lines():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150


def test_the_tpu_vm_install_picks_the_pinned_torch():
    readme = (REPO / "README.md").read_text()
    command = 'pip install "$(grep ^torch== constraints.txt)" --index-url https://download.pytorch.org/whl/cpu'
    assert command in readme
    found = subprocess.run(["bash", "-c", "grep ^torch== constraints.txt"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(found) == 1 and re.fullmatch(r"torch==\d+\.\d+\.\d+", found[0]), found
