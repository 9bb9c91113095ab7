"""The intended layers, checked over the import statements of ``stabmon/``.

The style guide draws the layers (probes measure, detectors judge, export publishes;
the contract a leaf; the daemon never imports torch; only ``daemon/nvml`` imports
pynvml). A docstring that claims a boundary is not a check: this module reads every
``import`` in the package with :mod:`ast` (no module is executed, so torch and pynvml
need not be installed) and fails when a rule is broken, naming the importing module
and line.

What counts as an import: every ``import``/``from ... import`` statement, at module level
or inside a function (a lazy import still runs), except under ``if TYPE_CHECKING:``.
Importing ``a.b.c`` also runs the module-level code of ``a`` and ``a.b``; those parent
packages (and a package a plain name is imported from) are followed at module level
only, so ``stabmon/__init__.py``'s lazy ``__getattr__`` (``stabmon.Monitor`` imports
torch on first use) does not make every module "import torch".
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "stabmon"


@dataclass(frozen=True)
class Import:
    """One import statement: the importing module, the imported name and where."""

    source: str
    target: str
    line: int
    module_level: bool


@dataclass
class ImportGraph:
    """Imports of every module of a package, read from source."""

    modules: set[str] = field(default_factory=set)
    imports: dict[str, list[Import]] = field(default_factory=dict)
    #: Imports under ``if TYPE_CHECKING:`` (read by mypy, never run), by module.
    type_only: dict[str, list[Import]] = field(default_factory=dict)
    #: Calls of a ``register_*hook`` method or function, by module: (name, line).
    hook_calls: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    def explicit(self, module: str, *, module_level_only: bool = False) -> list[Import]:
        found = self.imports.get(module, [])
        return [i for i in found if i.module_level or not module_level_only]

    def internal(self, imp: Import) -> str | None:
        """The stabmon module an import names (``from pkg import mod`` names ``pkg.mod``).

        None for a module outside the package; a name imported from a module gives that
        module (``from stabmon.config import Config`` is ``stabmon.config``).
        """
        if _top(imp.target) != "stabmon":
            return None
        if imp.target in self.modules:
            return imp.target
        parent = imp.target.rpartition(".")[0]
        return parent if parent in self.modules or parent != "stabmon" else imp.target

    def reachable(self, start: str) -> dict[str, Import | None]:
        """Modules that importing ``start`` can run, each with the import that reached it."""
        seen: dict[str, Import | None] = {start: None}
        queue: list[tuple[str, bool]] = [(start, False)]
        while queue:
            module, module_level_only = queue.pop()
            steps: list[tuple[str, bool, Import | None]] = []
            for imp in self.explicit(module, module_level_only=module_level_only):
                target = self.internal(imp)
                if target is not None:
                    # ``from pkg import name`` (a name, not a module) runs pkg's module level.
                    steps.append((target, target != imp.target, imp))
            parts = module.split(".")
            for depth in range(1, len(parts)):
                steps.append((".".join(parts[:depth]), True, None))
            for target, level_only, via in steps:
                if target not in seen:
                    seen[target] = via
                    queue.append((target, level_only))
        return seen

    def loaded_by(self, start: str) -> set[str]:
        """The stabmon modules that ``import start`` runs: module-level imports only."""
        seen = {start}
        queue = [start]
        while queue:
            module = queue.pop()
            parts = module.split(".")
            targets = {".".join(parts[:depth]) for depth in range(1, len(parts))}
            for imp in self.explicit(module, module_level_only=True):
                target = self.internal(imp)
                if target is not None:
                    targets.add(target)
                    targets.update(
                        ".".join(target.split(".")[:d]) for d in range(1, target.count(".") + 1)
                    )
            for target in targets - seen:
                if target in self.modules:
                    seen.add(target)
                    queue.append(target)
        return seen

    def external_imports(self, modules: Iterable[str]) -> Iterator[Import]:
        for module in modules:
            for imp in self.imports.get(module, []):
                if self.internal(imp) is None:
                    yield imp


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(
    tree: ast.Module, module: str, is_package: bool, type_only: list[Import] | None = None
) -> list[Import]:
    """The imports that run; those under ``if TYPE_CHECKING:`` go to ``type_only``."""
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                if type_only is not None:
                    checked = ast.Module(body=child.body, type_ignores=[])
                    type_only.extend(_imports_of(checked, module, is_package))
                for orelse in child.orelse:
                    visit(orelse, module_level)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, alias.name, child.lineno, module_level))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module if is_package else module.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                for alias in child.names:
                    target = base if alias.name == "*" else f"{base}.{alias.name}"
                    found.append(Import(module, target, child.lineno, module_level))
            inner = module_level and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            visit(child, inner)

    visit(tree, True)
    return found


def _hook_calls(tree: ast.Module) -> list[tuple[str, int]]:
    """Calls that register a torch hook: ``x.register_forward_pre_hook(...)``,
    ``torch.nn.modules.module.register_module_forward_hook(...)``, ``tensor.register_hook``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name.startswith("register_") and name.endswith("hook"):
                found.append((name, node.lineno))
    return found


def build_graph(root: Path) -> ImportGraph:
    graph = ImportGraph()
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        graph.modules.add(name)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        type_only = graph.type_only[name] = []
        graph.imports[name] = _imports_of(tree, name, path.name == "__init__.py", type_only)
        graph.hook_calls[name] = _hook_calls(tree)
    return graph


def _top(name: str) -> str:
    return name.split(".")[0]


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _describe(imp: Import) -> str:
    return f"{imp.source} (line {imp.line}) imports {imp.target}"


def _chain(reached: dict[str, Import | None], module: str) -> str:
    steps: list[str] = []
    current: str | None = module
    while current is not None and reached.get(current) is not None:
        via = reached[current]
        assert via is not None
        steps.append(f"{via.source}:{via.line}")
        current = via.source
    return " <- ".join([module, *steps])


# ---------------------------------------------------------------- the rules


def contract_is_a_leaf(graph: ImportGraph) -> list[str]:
    """stabmon.contract imports nothing from stabmon: everyone imports it."""
    return [
        _describe(imp)
        for imp in graph.explicit("stabmon.contract")
        if graph.internal(imp) is not None
    ]


#: Small modules every layer may import, which therefore import nothing from stabmon.
LEAVES = ("stabmon.shared.wrapping", "stabmon.extension")


def leaves_import_nothing_from_stabmon(graph: ImportGraph) -> list[str]:
    """The wrapper helper and the extension point (LEAVES) import no stabmon module at run time."""
    return [
        _describe(imp)
        for leaf in LEAVES
        for imp in graph.explicit(leaf)
        if graph.internal(imp) is not None
    ]


def _reaching_torch(graph: ImportGraph, package: str) -> list[str]:
    """Modules of ``package`` that import torch, directly or through stabmon modules."""
    problems: list[str] = []
    for module in sorted(m for m in graph.modules if _in(m, package)):
        reached = graph.reachable(module)
        for imp in graph.external_imports(reached):
            if _top(imp.target) == "torch":
                problems.append(f"{module}: {_describe(imp)} via {_chain(reached, imp.source)}")
    return sorted(set(problems))


def daemon_never_imports_torch(graph: ImportGraph) -> list[str]:
    """No daemon module imports torch, directly or through the stabmon modules it imports."""
    return _reaching_torch(graph, "stabmon.daemon")


def only_hardware_nvml_imports_pynvml(graph: ImportGraph) -> list[str]:
    """NVML has one seam: stabmon.hardware.nvml initialises it once and shuts it down."""
    return [
        _describe(imp)
        for imp in graph.external_imports(graph.modules)
        if _top(imp.target) == "pynvml" and imp.source != "stabmon.hardware.nvml"
    ]


def _forbidden(graph: ImportGraph, importer: str, imported: tuple[str, ...]) -> list[str]:
    problems: list[str] = []
    for module in sorted(m for m in graph.modules if _in(m, importer)):
        for imp in graph.explicit(module):
            target = graph.internal(imp)
            if target is not None and any(_in(target, banned) for banned in imported):
                problems.append(_describe(imp))
    return problems


def probes_never_import_detectors_or_export(graph: ImportGraph) -> list[str]:
    """Probes measure; judging and publishing happen downstream of them."""
    return _forbidden(graph, "stabmon.probes", ("stabmon.detectors", "stabmon.export"))


def export_never_imports_config(graph: ImportGraph) -> list[str]:
    """Export publishes what it is handed; the caller turns Config into its arguments."""
    return _forbidden(graph, "stabmon.export", ("stabmon.config",))


def report_never_imports_the_http_server(graph: ImportGraph) -> list[str]:
    """``stabmon report``/``status`` read files and scrape; they never load the server."""
    return _forbidden(graph, "stabmon.report", ("stabmon.export.exporter",))


def extension_is_a_leaf_even_for_types(graph: ImportGraph) -> list[str]:
    """stabmon.extension names no stabmon module, not even for mypy: the ports a user's
    plug-in implements must not drag the package's internals into its types."""
    return [
        _describe(imp)
        for imp in graph.type_only.get("stabmon.extension", [])
        if graph.internal(imp) is not None
    ]


def daemon_and_probes_never_import_each_other(graph: ImportGraph) -> list[str]:
    """The two wings share only torch-free code (stabmon.hardware, stabmon.shared)."""
    return _forbidden(graph, "stabmon.daemon", ("stabmon.probes",)) + _forbidden(
        graph, "stabmon.probes", ("stabmon.daemon",)
    )


def detectors_import_neither_torch_nor_probes(graph: ImportGraph) -> list[str]:
    """Detectors judge host values: no torch (directly or through what they import) and no
    probe; a probe's types may be named for mypy only."""
    forbidden = _forbidden(graph, "stabmon.detectors", ("stabmon.probes",))
    return forbidden + _reaching_torch(graph, "stabmon.detectors")


#: The one module that registers torch hooks (and keeps their handles for detach()).
HOOKS_MODULE = "stabmon.wiring.hooks"


def only_the_hooks_module_registers_torch_hooks(graph: ImportGraph) -> list[str]:
    """Every torch hook is registered by stabmon.wiring.hooks, which keeps each handle, so
    detach() removes them all and a pickled model carries none."""
    return [
        f"{module} (line {line}) calls {name}"
        for module, calls in sorted(graph.hook_calls.items())
        if module != HOOKS_MODULE
        for name, line in calls
    ]


def contract_needs_no_third_party_module(graph: ImportGraph) -> list[str]:
    """stabmon.contract (and what it imports) needs only the standard library: dashboards,
    rule generators and other tools import it without torch or prometheus_client."""
    reached = graph.reachable("stabmon.contract")
    return [
        _describe(imp)
        for imp in graph.external_imports(reached)
        if _top(imp.target) not in sys.stdlib_module_names and _top(imp.target) != "__future__"
    ]


#: What serves HTTP; loaded by the exporter when it starts, not at import.
HTTP_SERVER_MODULES = ("http.server", "socketserver", "wsgiref")


def monitor_import_loads_no_http_server(graph: ImportGraph) -> list[str]:
    """``import stabmon.monitor`` runs no stabmon module that imports an HTTP server: the
    exporter imports its server when it starts serving (prometheus_client's own import of
    http.server is its own)."""
    reached = graph.loaded_by("stabmon.monitor")
    return [
        _describe(imp)
        for module in sorted(reached)
        for imp in graph.explicit(module, module_level_only=True)
        if graph.internal(imp) is None
        and any(imp.target == m or imp.target.startswith(m + ".") for m in HTTP_SERVER_MODULES)
    ]


def no_import_cycles(graph: ImportGraph) -> list[str]:
    """No two stabmon modules import each other, directly or around a loop."""
    edges = {
        module: sorted({t for imp in graph.explicit(module) if (t := graph.internal(imp))})
        for module in graph.modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[str] = []
    counter = 0

    def strongconnect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, []):
            if succ == node:
                continue
            if succ not in index:
                strongconnect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(" <-> ".join(sorted(component)))

    for module in sorted(graph.modules):
        if module not in index:
            strongconnect(module)
    return cycles


RULES = [
    contract_is_a_leaf,
    leaves_import_nothing_from_stabmon,
    daemon_never_imports_torch,
    only_hardware_nvml_imports_pynvml,
    probes_never_import_detectors_or_export,
    export_never_imports_config,
    report_never_imports_the_http_server,
    extension_is_a_leaf_even_for_types,
    daemon_and_probes_never_import_each_other,
    detectors_import_neither_torch_nor_probes,
    only_the_hooks_module_registers_torch_hooks,
    contract_needs_no_third_party_module,
    monitor_import_loads_no_http_server,
    no_import_cycles,
]


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build_graph(PACKAGE_ROOT)


@pytest.mark.parametrize("rule", RULES, ids=[rule.__name__ for rule in RULES])
def test_stabmon_imports_keep_the_layer(rule, graph: ImportGraph) -> None:
    problems = rule(graph)
    assert not problems, f"{rule.__doc__}\n" + "\n".join(problems)


# ------------------------------------------- the rules catch what they are for


def _plant(root: Path, files: dict[str, str]) -> ImportGraph:
    for relative, source in files.items():
        path = root / "stabmon" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    for directory in [root / "stabmon", *(p for p in (root / "stabmon").rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    return build_graph(root / "stabmon")


PLANTED = {
    "contract_is_a_leaf": {"contract.py": "from stabmon.config import Config\n"},
    "leaves_import_nothing_from_stabmon": {
        "extension.py": "def f():\n    from stabmon.pipeline.recorder import Recorder\n",
    },
    "daemon_never_imports_torch": {
        "daemon/app.py": "from stabmon.probes.helper import thing\n",
        "probes/helper.py": "def thing():\n    import torch.cuda\n",
    },
    "only_hardware_nvml_imports_pynvml": {"probes/identity.py": "def f():\n    import pynvml\n"},
    "probes_never_import_detectors_or_export": {
        "probes/timing.py": "from stabmon.detectors.stall import Heartbeat\n",
    },
    "export_never_imports_config": {"export/exporter.py": "from stabmon.config import Config\n"},
    "report_never_imports_the_http_server": {
        "report/status.py": "from stabmon.export import exporter\n",
        "export/exporter.py": "import http.server\n",
    },
    "extension_is_a_leaf_even_for_types": {
        "extension.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from stabmon.pipeline.readings import Readings\n",
    },
    "daemon_and_probes_never_import_each_other": {
        "probes/identity.py": "def f():\n    from stabmon.daemon.app import DaemonApp\n",
    },
    "detectors_import_neither_torch_nor_probes": {
        "detectors/spike.py": "from stabmon.shared.math import norm\n",
        "shared/math.py": "import torch\n",
    },
    "only_the_hooks_module_registers_torch_hooks": {
        "probes/provenance.py": "def arm(module):\n    module.register_forward_hook(print)\n",
    },
    "contract_needs_no_third_party_module": {"contract.py": "import numpy\n"},
    "monitor_import_loads_no_http_server": {
        "monitor.py": "from stabmon.export import exporter\n",
        "export/exporter.py": "from wsgiref.simple_server import make_server\n",
    },
    "no_import_cycles": {
        "__init__.py": "def __getattr__(name):\n    from stabmon import monitor\n",
        "monitor.py": "from stabmon import __version__\n",
    },
}


@pytest.mark.parametrize("rule", RULES, ids=[rule.__name__ for rule in RULES])
def test_layer_rule_fails_when_its_violation_is_planted(rule, tmp_path: Path) -> None:
    clean = _plant(tmp_path / "clean", {"contract.py": "X = 1\n", "daemon/app.py": "import os\n"})
    assert rule(clean) == []
    planted = _plant(tmp_path / "planted", PLANTED[rule.__name__])
    assert rule(planted), f"{rule.__name__} missed {PLANTED[rule.__name__]}"


def test_daemon_rule_ignores_imports_only_for_type_checking(tmp_path: Path) -> None:
    graph = _plant(
        tmp_path,
        {
            "daemon/app.py": "from stabmon.hardware import devices\n",
            "hardware/devices.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import torch\n",
        },
    )
    assert daemon_never_imports_torch(graph) == []
