"""The ```python blocks of README.md and docs/*.md run as programs, so the documentation cannot go stale.

A block is a complete program unless the line before its fence (blank lines aside) is a marker comment:
``<!-- snippet: skip (why) -->`` for a fragment that names objects it does not define, ``<!-- snippet: slow -->``
for a complete program that takes longer than a few seconds (run with ``-m slow``). Each program runs in a fresh
namespace with a temporary working directory, so the files it writes (checkpoints, exports) land there.
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # runs the documentation's snippets and commands

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<kind>\w+)\b.*-->\s*$")
KINDS = ("skip", "slow")


@dataclass(frozen=True)
class Snippet:
    """One fenced ```python block: where it is, its code (dedented) and its marker ('' when it is a program)."""

    path: Path
    line: int  # 1-based line of the first code line
    code: str
    marker: str

    @property
    def name(self) -> str:
        """``file:line``, the test id and the traceback's file name."""
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _marker_before(lines: list[str], index: int) -> str:
    """The marker kind on the nearest non-blank line above ``lines[index]``, or '' when there is none."""
    for prev in reversed(lines[:index]):
        if prev.strip():
            match = MARKER.match(prev)
            return match.group("kind") if match else ""
    return ""


def extract_snippets(path: Path) -> list[Snippet]:
    """Every fenced ```python block of a Markdown file, indented ones (inside list items) included."""
    lines = path.read_text().splitlines()
    snippets, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang, start = match.group("indent"), match.group("lang"), i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        if lang == "python":
            body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[start + 1 : i]]
            snippets.append(Snippet(path, start + 2, "\n".join(body) + "\n", _marker_before(lines, start)))
        i += 1
    return snippets


def _all_snippets() -> list[Snippet]:
    """The python blocks of every documentation file."""
    return [s for path in DOC_FILES for s in extract_snippets(path)]


def _programs() -> list:
    """The blocks that are complete programs, as pytest params (the slow ones marked)."""
    marks = {"slow": [pytest.mark.slow]}
    return [pytest.param(s, id=s.name, marks=marks.get(s.marker, [])) for s in _all_snippets() if s.marker != "skip"]


@pytest.mark.parametrize("snippet", _programs())
def test_snippet_runs(snippet: Snippet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block runs as written, from a temporary working directory."""
    monkeypatch.chdir(tmp_path)
    code = compile("\n" * (snippet.line - 1) + snippet.code, str(snippet.path), "exec")  # tracebacks give doc lines
    exec(code, {"__name__": "__main__"})


def test_markers_are_known_and_sit_before_python_blocks() -> None:
    """A misspelt marker, or one that is not directly above a python block, would silently run or skip a block."""
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            match = MARKER.match(line)
            if not match:
                continue
            assert match.group("kind") in KINDS, f"{path.name}:{i + 1}: unknown snippet marker {match.group('kind')!r}"
            following = next((ln for ln in lines[i + 1 :] if ln.strip()), "")
            assert following.strip() == "```python", f"{path.name}:{i + 1}: the marker is not above a ```python block"


def test_extractor_finds_programs_and_fragments() -> None:
    """The README holds a runnable program (the QuantCallback example) and a marked fragment."""
    readme = extract_snippets(ROOT / "README.md")
    assert any("QuantCallback(" in s.code and s.marker == "" for s in readme)
    assert any(s.marker == "skip" for s in readme)


@pytest.mark.parametrize("snippet", [pytest.param(s, id=s.name) for s in _all_snippets()])
def test_every_block_compiles(snippet: Snippet) -> None:
    """Fragments too are valid Python, and indented blocks (inside list items) are dedented correctly."""
    compile(snippet.code, snippet.name, "exec")


def test_readme_is_short_and_its_links_resolve() -> None:
    """The README stays an overview (at most 300 lines) and every relative link it has points at a file."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` (warnings are errors: broken links, docstrings mkdocstrings cannot read) passes."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (the 'docs' extra)")
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
