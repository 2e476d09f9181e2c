"""``bench/cuda_round.sh``, the CUDA checks a session lent a GPU runs in one device call, does not rot unseen: no such
machine runs it in CI, so what it names (test ids, bench flags) is checked here against the tree, and the whole
script runs on the CPU in its quick mode (slow)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "cuda_round.sh"
TEXT = SCRIPT.read_text()
#: one device call may run 600 s; the script's parts must end inside it with room for the kills' grace
CALL_LIMIT_S = 600


def _commands() -> list[str]:
    """The script's ``part`` commands, continuation lines joined."""
    joined = TEXT.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("part ")]


def test_the_script_parses() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    result = subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_its_parts_fit_one_device_call() -> None:
    limits = [int(cmd.split()[2]) for cmd in _commands()]
    assert len(limits) == 6
    assert sum(limits) + 10 * len(limits) < CALL_LIMIT_S


def test_every_test_it_names_exists() -> None:
    """A renamed or moved test would leave the GPU run collecting nothing for it (pytest exits 4 on a missing id)."""
    ids = re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", TEXT)
    assert len(ids) >= 5
    for path, name in ids:
        source = (ROOT / path).read_text()
        if name:
            assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"{path}::{name} is gone"


def test_every_bench_flag_it_passes_exists() -> None:
    """Each ``--flag`` a part passes to a bench is one that bench's parser defines."""
    checked = 0
    for cmd in _commands():
        bench = re.search(r"bench/(\w+)\.py", cmd)
        if bench is None:
            continue
        source = (ROOT / "bench" / f"{bench.group(1)}.py").read_text()
        for flag in re.findall(r"\s(--[a-z][\w-]*)", cmd):
            assert f'"{flag}"' in source, f"{bench.group(1)}.py defines no {flag}"
            checked += 1
    assert checked >= 15


@pytest.mark.slow
def test_the_script_runs_on_the_cpu_in_its_quick_mode(tmp_path: Path) -> None:
    """Every part on the CPU, shortened: exit 0 and a log per part (the syncs part needs CUDA and is left out)."""
    env = {**os.environ, "DEVICE": "cpu", "QUICK": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=400, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    logs = sorted(p.stem for p in tmp_path.glob("*.log"))
    assert logs == ["fake_quant", "qat_lightning", "qat_overhead", "tests", "versions"]
    assert "passed" in (tmp_path / "tests.log").read_text()
    assert "| 256 |" in (tmp_path / "qat_lightning.log").read_text()
