"""Tests mirror the package: every module under ``stabmon/`` has a test file of its own.

``stabmon/<path>/<name>.py`` is tested by ``tests/<path>/test_<name>.py``. Test files
share one namespace (no ``__init__.py`` under ``tests/``, so pytest needs unique
basenames), so when that basename is taken elsewhere the file is named after its
package as well: ``tests/<path>/test_<package>_<name>.py`` (``stabmon/daemon/gpu.py``
→ ``tests/daemon/test_daemon_gpu.py``, as ``tests/test_gpu.py`` holds ``test_gpu``). A private
module's leading underscore is dropped (``integrations/_common.py`` →
``tests/integrations/test_common.py``). The file must define at least one test.

A module that has no such file is in :data:`ALLOWED` with a one-line reason; an entry
whose module now has its file, or no longer exists, fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Modules without a test file of their own, each with why (path relative to stabmon/).
ALLOWED: dict[str, str] = {
    "__init__.py": "the public surface: pinned by tests/test_public_api.py",
    "__main__.py": "two lines that run cli.main: tests/test_cli.py runs `python -m stabmon`",
    "_version.py": "one constant, pinned by tests/test_public_api.py",
    "config/__init__.py": "the config schema (stabmon.config): tests/config/test_config.py",
    "daemon/__init__.py": "package docstring only",
    "hardware/__init__.py": "package docstring only",
    "pipeline/__init__.py": "package docstring only",
    "shared/__init__.py": "package docstring only",
    "wiring/__init__.py": "package docstring only",
    "detectors/__init__.py": "package docstring only",
    "export/__init__.py": "package docstring only",
    "probes/__init__.py": "package docstring only",
    "report/__init__.py": "package docstring only",
    "policies/__init__.py": "package docstring only",
    "integrations/__init__.py": "package docstring only (tests/integrations/"
    "test_integrations_package.py checks it imports no framework)",
    "export/limits.py": "four constants, each exercised by tests/security/test_exporter_limits.py",
    "demo.py": "the CPU demo: run end to end by tests/test_cli.py and tests/test_readme.py",
    "integrations/_lightning.py": "tests/integrations/test_lightning_callback.py (the adapter "
    "behind lightning.py and pytorch_lightning.py)",
    "integrations/lightning.py": "tests/integrations/test_lightning_callback.py",
    "integrations/pytorch_lightning.py": "tests/integrations/test_lightning_callback.py",
    "integrations/huggingface.py": "tests/integrations/test_huggingface_callback.py",
    "integrations/ultralytics.py": "tests/integrations/test_ultralytics_callbacks.py",
}


def _test_names(module: Path, package_root: Path) -> list[Path]:
    """The test files that would mirror ``module`` (relative to the tests root)."""
    relative = module.relative_to(package_root)
    directory = relative.parent
    stem = relative.stem
    if stem.startswith("_") and not stem.startswith("__"):
        stem = stem[1:]  # a private module: integrations/_common.py -> test_common.py
    names = [directory / f"test_{stem}.py"]
    if directory.parts:
        names.append(directory / f"test_{directory.parts[-1]}_{stem}.py")
    return names


def _defines_a_test(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
        for node in ast.walk(tree)
    )


def unmirrored(package_root: Path, tests_root: Path, allowed: dict[str, str]) -> list[str]:
    """Problems: modules with neither a test file nor an entry, and stale entries."""
    problems = []
    modules = sorted(package_root.rglob("*.py"))
    known = {module.relative_to(package_root).as_posix() for module in modules}
    for module in modules:
        key = module.relative_to(package_root).as_posix()
        found = [
            name
            for name in _test_names(module, package_root)
            if (tests_root / name).is_file() and _defines_a_test(tests_root / name)
        ]
        if found and key in allowed:
            problems.append(
                f"stabmon/{key} now has tests/{found[0].as_posix()}: remove its entry from "
                f"ALLOWED in tests/test_mirror.py ({allowed[key]!r})"
            )
        elif not found and key not in allowed:
            expected = " or ".join(
                f"tests/{n.as_posix()}" for n in _test_names(module, package_root)
            )
            problems.append(
                f"stabmon/{key} has no test file of its own: add {expected} (tests through its "
                "own interface), or an entry with a reason to ALLOWED in tests/test_mirror.py"
            )
    for key in sorted(set(allowed) - known):
        problems.append(f"ALLOWED in tests/test_mirror.py names stabmon/{key}, which is gone")
    return problems


def test_every_stabmon_module_has_a_test_file_of_its_own() -> None:
    problems = unmirrored(ROOT / "stabmon", ROOT / "tests", ALLOWED)
    assert not problems, "\n".join(problems)


def test_every_allowed_module_gives_a_one_line_reason() -> None:
    for key, reason in ALLOWED.items():
        assert reason.strip() and "\n" not in reason, key


# ------------------------------------------------- the rule catches what it is for


def _tree(root: Path, files: dict[str, str]) -> tuple[Path, Path]:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "stabmon", root / "tests"


CLEAN = {
    "stabmon/__init__.py": "",
    "stabmon/safefs.py": "X = 1\n",
    "stabmon/report/verdict.py": "X = 1\n",
    "stabmon/daemon/gpu.py": "X = 1\n",
    "tests/test_safefs.py": "def test_x():\n    assert True\n",
    "tests/report/test_verdict.py": "def test_x():\n    assert True\n",
    "tests/daemon/test_daemon_gpu.py": "def test_x():\n    assert True\n",
}


def test_a_tree_where_every_module_is_mirrored_passes(tmp_path: Path) -> None:
    package, tests = _tree(tmp_path, CLEAN)
    assert unmirrored(package, tests, {"__init__.py": "docstring only"}) == []


def test_a_new_module_without_a_test_file_fails_naming_the_file_to_add(tmp_path: Path) -> None:
    package, tests = _tree(tmp_path, {**CLEAN, "stabmon/probes/newprobe.py": "X = 1\n"})
    (problem,) = unmirrored(package, tests, {"__init__.py": "docstring only"})
    assert problem.startswith(
        "stabmon/probes/newprobe.py has no test file of its own: add "
        "tests/probes/test_newprobe.py or tests/probes/test_probes_newprobe.py"
    )


def test_a_test_file_in_the_wrong_directory_does_not_count(tmp_path: Path) -> None:
    package, tests = _tree(
        tmp_path,
        {
            **CLEAN,
            "stabmon/probes/newprobe.py": "X = 1\n",
            "tests/test_newprobe.py": "def test_x():\n    pass\n",
        },
    )
    assert len(unmirrored(package, tests, {"__init__.py": "docstring only"})) == 1


def test_a_test_file_without_a_test_does_not_count(tmp_path: Path) -> None:
    package, tests = _tree(
        tmp_path,
        {
            **CLEAN,
            "stabmon/probes/newprobe.py": "X = 1\n",
            "tests/probes/test_newprobe.py": "import os\n",
        },
    )
    assert len(unmirrored(package, tests, {"__init__.py": "docstring only"})) == 1


def test_an_allowed_module_that_gained_its_test_file_fails_until_its_entry_goes(
    tmp_path: Path,
) -> None:
    package, tests = _tree(
        tmp_path,
        {
            **CLEAN,
            "stabmon/hooks.py": "X = 1\n",
            "tests/test_hooks.py": "def test_x():\n    pass\n",
        },
    )
    allowed = {"__init__.py": "docstring only", "hooks.py": "arrives from branch monitor"}
    (problem,) = unmirrored(package, tests, allowed)
    assert "stabmon/hooks.py now has tests/test_hooks.py: remove its entry" in problem


def test_an_entry_for_a_module_that_is_gone_fails(tmp_path: Path) -> None:
    package, tests = _tree(tmp_path, CLEAN)
    problems = unmirrored(package, tests, {"__init__.py": "docstring only", "old.py": "gone"})
    assert problems == ["ALLOWED in tests/test_mirror.py names stabmon/old.py, which is gone"]


def test_a_private_modules_test_file_drops_the_underscore(tmp_path: Path) -> None:
    files = {**CLEAN, "stabmon/integrations/_common.py": "X = 1\n"}
    package, tests = _tree(tmp_path, files)
    (problem,) = unmirrored(package, tests, {"__init__.py": "docstring only"})
    assert "add tests/integrations/test_common.py or" in problem
    (tests / "integrations").mkdir()
    (tests / "integrations" / "test_common.py").write_text("def test_x():\n    pass\n")
    assert unmirrored(package, tests, {"__init__.py": "docstring only"}) == []
