"""README stays short (150 lines at most, detail lives in docs/), its TPU VM install command
finds the one torch version constraints.txt pins, and the quickstart's one command installs
torch from the CPU wheel index (plain PyPI brings the CUDA build to a Linux laptop)."""

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


CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def test_the_quickstart_command_installs_the_cpu_torch():
    readme = (REPO / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in quickstart.splitlines() if "&& tpu-train recipe=llama_finetune" in line]
    assert len(commands) == 1, commands
    install = commands[0].split(" && ")[2]
    assert install.startswith("pip install -c constraints.txt -e .") and CPU_INDEX in install, install
