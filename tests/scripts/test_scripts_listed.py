"""Every script in scripts/ is listed, with what it is for, in docs/benchmarks.md's "The
scripts" section, and everything listed there exists: a user tells the benchmarks to run from
the project's tools there."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def listed_section() -> str:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    start = text.index("## The scripts\n")
    return text[start:text.index("\n# ", start)]


def test_every_script_is_listed_and_every_listed_script_exists():
    section = listed_section()
    named = set(re.findall(r"`([\w/]+\.(?:py|sh)|gke/)`", section))
    nested = {name for name in named if "/" in name.rstrip("/")}
    assert all((REPO / "scripts" / name).is_file() for name in nested), nested
    named -= nested
    present = {p.name + ("/" if p.is_dir() else "") for p in (REPO / "scripts").iterdir()
               if p.name != "__pycache__"}
    assert present - named == set(), "scripts not listed in docs/benchmarks.md"
    assert named - present == set(), "listed in docs/benchmarks.md but not in scripts/"


def test_each_benchmark_has_one_line_saying_what_it_measures():
    rows = re.findall(r"^\| `(\w+\.py)` \| (.+) \|$", listed_section(), flags=re.M)
    assert len(rows) == len({name for name, _ in rows}) >= 20
    for name, measures in rows:
        assert (REPO / "scripts" / name).is_file(), name
        assert len(measures.split()) >= 4, (name, measures)
