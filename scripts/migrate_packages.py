"""Move the app's packages ``app/`` and ``tasks/`` under ``quark_lightning/`` (issue 34, item 6), mechanically.

    python scripts/migrate_packages.py            # from the repository root (a git work tree), or from anywhere

The installed distribution then adds ``quark``, ``callbacks`` and ``quark_lightning`` to site-packages, no generic
top-level name (``app``, ``tasks``) that would shadow a user's own module. Steps, each idempotent (a second run changes
nothing):

1. ``git mv app quark_lightning/app`` and ``git mv tasks quark_lightning/tasks`` (skipped when done), plus
   ``quark_lightning/__init__.py``;
2. in every moved file, ``Path(__file__).parents[N]`` that pointed above the package points there again (N + 1);
3. the dotted names ``app.<module>`` / ``tasks.<module>`` (imports, strings, Hydra ``_target_:`` values, mkdocstrings
   ``::: app.run``) and the paths ``app/...`` / ``tasks/...`` become ``quark_lightning.app...`` /
   ``quark_lightning/app/...`` in *.py, conf/**/*.yaml, *.md, mkdocs.yml, *.toml, *.cfg, *.ini, *.sh, Makefile
   (``tests/app`` and ``tests.app`` are left alone: the tests keep their place);
4. the import blocks the renames unsorted are re-sorted (``ruff check --select I --fix``, when ruff is installed);
5. the Hydra entry moves to ``quark_lightning/train.py`` (``main()``: the command-line checks, then Hydra's main);
   ``train.py`` becomes a thin wrapper of it; pyproject's ``packages.find`` lists ``quark_lightning*`` instead of
   ``app*`` / ``tasks*`` and ``[project.scripts]`` gets ``quark-lightning = "quark_lightning.train:main"``.

Then reinstall (``pip install -e .``) so the console script exists. Prints what it changed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "quark_lightning"
MOVED = ("app", "tasks")
TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".md", ".toml", ".cfg", ".ini", ".sh", ".txt"}
TEXT_NAMES = {"Makefile", "run"}  # .ci/run
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "outputs", "multirun", "build", "dist", "site", "__pycache__"}
SELF = Path(__file__).resolve()

INIT = '''"""quark-lightning's application: the Hydra app (``quark_lightning.app``), its demo tasks
(``quark_lightning.tasks``) and the ``quark-lightning`` command (``quark_lightning.train:main``, what ``python train.py``
runs). The engine is ``quark``, the Lightning front end ``callbacks``."""
'''

ENTRY = '''"""The ``quark-lightning`` command (and ``python train.py``): train, quantize, evaluate and report, composed by Hydra
from conf/ (see train.py for examples; any ``python train.py ...`` line works as ``quark-lightning ...``)."""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from quark_lightning.app.conf import CONF_DIR, ConfigError, check_overrides, register_role_groups
from quark_lightning.app.search import check_search_args, objective_values, register_search

register_role_groups()
register_search()  # hparams_search=optuna_bits: the resolver of its directions, the sampler uniform_first


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def run_config(cfg: DictConfig) -> float | list[float] | None:
{body}


def main() -> None:
    """Check the command line (a mistake: one ``error:`` line, no traceback), then run Hydra's main."""
    problem = check_overrides(sys.argv[1:]) or check_search_args(sys.argv[1:])
    if problem:
        sys.exit(f"error: {{problem}}")
    run_config()


if __name__ == "__main__":
    main()
'''

WRAPPER = """{docstring}

from quark_lightning.train import main

if __name__ == "__main__":
    main()
"""


def git(*args: str) -> None:
    """Run git in the repository root (the moves stay in git's history)."""
    subprocess.run(["git", *args], cwd=ROOT, check=True)


def modules() -> dict[str, set[str]]:
    """Top-level modules of each moved package (``app`` -> {run, conf, ...}), wherever the package is now."""
    found: dict[str, set[str]] = {}
    for name in MOVED:
        where = ROOT / name if (ROOT / name).is_dir() else ROOT / PACKAGE / name
        found[name] = {p.stem for p in where.glob("*.py") if p.stem != "__init__"} | {
            p.name for p in where.iterdir() if p.is_dir() and (p / "__init__.py").exists()
        }
    return found


def move_packages() -> list[Path]:
    """git mv app/ and tasks/ under quark_lightning/ (those not moved yet); returns the moved .py files."""
    target = ROOT / PACKAGE
    target.mkdir(exist_ok=True)
    init = target / "__init__.py"
    if not init.exists():
        init.write_text(INIT)
        git("add", str(init.relative_to(ROOT)))
        print(f"created {init.relative_to(ROOT)}")
    moved = []
    for name in MOVED:
        if (ROOT / name).is_dir() and not (target / name).exists():
            git("mv", name, f"{PACKAGE}/{name}")
            print(f"moved {name}/ -> {PACKAGE}/{name}/")
        moved += sorted((target / name).rglob("*.py"))
    return moved


def fix_file_parents(files: list[Path]) -> None:
    """``Path(__file__)...parents[N]`` in a moved file that now lands inside quark_lightning/ (it pointed at the
    repository root before the move): N + 1. Idempotent: a path that already reaches the root is left alone."""
    pattern = re.compile(r"(Path\(__file__\)(?:\.resolve\(\))?\.parents\[)(\d+)(\])")
    for path in files:
        text = path.read_text()

        def bump(match: re.Match[str], path: Path = path) -> str:
            n = int(match.group(2))
            inside = n >= 1 and path.resolve().parents[n] == (ROOT / PACKAGE).resolve()
            return f"{match.group(1)}{n + 1 if inside else n}{match.group(3)}"

        new = pattern.sub(bump, text)
        if new != text:
            path.write_text(new)
            print(f"fixed Path(__file__).parents in {path.relative_to(ROOT)}")


def rewrite(text: str, names: dict[str, set[str]]) -> str:
    """``app.<module>`` / ``import app`` / ``app/...`` -> under quark_lightning (not ``tests.app``, ``tests/app``,
    nor names already under quark_lightning)."""
    for pkg, mods in names.items():
        alternatives = "|".join(sorted(mods, key=len, reverse=True))
        text = re.sub(rf"(?<![\w./-]){pkg}\.({alternatives})\b", rf"{PACKAGE}.{pkg}.\1", text)
        text = re.sub(
            rf"^(\s*)(from|import) {pkg}(\s+import\b|\s*$|\s*#)", rf"\1\2 {PACKAGE}.{pkg}\3", text, flags=re.M
        )
        text = re.sub(rf"(?<![\w./-]){pkg}/", f"{PACKAGE}/{pkg}/", text)
    return text


def text_files() -> list[Path]:
    """The files whose text names modules or paths (sources, configs, docs, scripts), outside build/venv dirs."""
    found = []
    for path in ROOT.rglob("*"):
        if any(part in SKIP_DIRS for part in path.relative_to(ROOT).parts) or not path.is_file():
            continue
        if path.resolve() != SELF and (path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES):
            found.append(path)
    return sorted(found)


def rewrite_references(names: dict[str, set[str]]) -> list[Path]:
    """Apply ``rewrite`` to every text file (the pyproject's package list is ``fix_pyproject``'s); returns the
    Python files it changed."""
    changed = []
    for path in text_files():
        if path.name == "pyproject.toml":
            continue
        text = path.read_text()
        new = rewrite(text, names)
        if new != text:
            path.write_text(new)
            print(f"rewrote references in {path.relative_to(ROOT)}")
            changed += [path] if path.suffix == ".py" else []
    return changed


def sort_imports(files: list[Path]) -> None:
    """Re-sort the import blocks the renames unsorted (``quark_lightning`` sorts after ``quark``), with ruff's isort
    rule as the project configures it; skipped, with a note, when ruff is not installed."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not files:
        return
    if not Path(ruff).exists():
        print("ruff not found: run `ruff check --select I --fix .` to re-sort the imports")
        return
    subprocess.run([ruff, "check", "--select", "I", "--fix", "--quiet", *map(str, files)], cwd=ROOT, check=False)
    print(f"re-sorted the imports of {len(files)} files")


def split_train(text: str) -> tuple[str, str]:
    """train.py's docstring and the body of its Hydra main (indented, as written)."""
    docstring = re.match(r'\s*(""".*?""")', text, flags=re.S)
    body = re.search(r"\ndef main\(cfg: DictConfig\)[^\n]*:\n(.*?)(?=\n\n\n|\nif __name__)", text, flags=re.S)
    if docstring is None or body is None:
        raise ValueError("train.py: expected a module docstring and `def main(cfg: DictConfig) ...:`; move it by hand")
    return docstring.group(1), body.group(1).rstrip()


def move_entry() -> list[Path]:
    """quark_lightning/train.py gets the Hydra main (and ``main()`` with the command-line checks); train.py wraps it.
    Returns the new module (none when it exists)."""
    entry, train = ROOT / PACKAGE / "train.py", ROOT / "train.py"
    if entry.exists():
        return []
    docstring, body = split_train(train.read_text())
    entry.write_text(ENTRY.format(body=body))
    train.write_text(WRAPPER.format(docstring=docstring))
    git("add", str(entry.relative_to(ROOT)))
    print(f"moved the Hydra main of train.py to {entry.relative_to(ROOT)}")
    return [entry]


def fix_pyproject() -> None:
    """packages.find: quark_lightning* instead of app* / tasks*; the console script quark-lightning."""
    path = ROOT / "pyproject.toml"
    text = path.read_text()
    new = re.sub(r"include = \[[^\]]*\]", 'include = ["quark*", "callbacks*", "quark_lightning*"]', text, count=1)
    if "[project.scripts]" not in new:
        new = new.replace(
            "\n[project.optional-dependencies]",
            f'\n[project.scripts]\nquark-lightning = "{PACKAGE}.train:main"  # the same as python train.py\n'
            "\n[project.optional-dependencies]",
            1,
        )
    if new != text:
        path.write_text(new)
        print("updated pyproject.toml (packages.find, [project.scripts])")


def main() -> None:
    names = modules()
    fix_file_parents(move_packages())
    changed = rewrite_references(names)
    sort_imports([*changed, *move_entry()])
    fix_pyproject()
    print("done: reinstall (pip install -e .) for the quark-lightning command")


if __name__ == "__main__":
    sys.exit(main())
