"""The longest functions and methods in stabmon/, by source lines (an AST count).

    python bench/function_lengths.py [--top 15] [ROOT]

A function's length is ``end_lineno - lineno + 1`` of its ``def`` (decorators not
counted; nested functions count inside their parent and on their own line too).
Used for issue 24's before/after table next to ``wc -l stabmon/*.py stabmon/*/*.py``.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def function_lengths(root: Path) -> list[tuple[int, str]]:
    """(lines, "path:qualified.name") of every function under ``root``, longest first."""
    found: list[tuple[int, str]] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        _visit(tree, [], path.relative_to(root.parent), found)
    return sorted(found, key=lambda item: (-item[0], item[1]))


def _visit(node: ast.AST, scope: list[str], path: Path, found: list[tuple[int, str]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = ".".join([*scope, child.name])
            found.append(((child.end_lineno or child.lineno) - child.lineno + 1, f"{path}:{name}"))
            _visit(child, [*scope, child.name], path, found)
        elif isinstance(child, ast.ClassDef):
            _visit(child, [*scope, child.name], path, found)
        else:
            _visit(child, scope, path, found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).parent.parent / "stabmon"))
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for lines, name in function_lengths(Path(args.root))[: args.top]:
        print(f"{lines:5d}  {name}")


if __name__ == "__main__":
    main()
