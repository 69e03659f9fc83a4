"""The shape of the package, read from its source with ``ast`` (nothing is imported).

Which imports count: every ``import dptune.x`` and ``from dptune.x import y`` anywhere in a module,
at module level and inside functions (including ``if TYPE_CHECKING:`` blocks) alike. A function-level
import defers the cycle to the first call but does not remove it: the two modules still cannot be
read, tested or moved apart, which is what a circle costs. An import adds one edge, to the module it
names (``from dptune.a import b`` names ``dptune.a.b`` when that is a module, else ``dptune.a``); the
parent packages Python initialises on the way are not edges, since a package's ``__init__``
re-exporting its submodules is not a circle of dependencies. Relative imports are resolved against
the importing module's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dptune"
#: The most lines a module of dptune may have.
MAX_MODULE_LINES = 600
#: The most ``.py`` files that may sit directly in ``dptune/`` (the rest live in subpackages).
MAX_ROOT_MODULES = 8


def module_name(path: Path) -> str:
    """``dptune/a/b.py`` → ``dptune.a.b``; ``dptune/a/__init__.py`` → ``dptune.a``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of dptune by dotted name."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The modules of ``known`` that module ``name`` (its text ``source``; a package's
    ``__init__`` when ``is_package``) imports, anywhere in its body."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import dptune.a.b` of a name inside dptune.a
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the dptune modules it imports."""
    paths = modules()
    known = set(paths)
    return {
        name: imported(name, path.read_text(encoding="utf-8"), known, path.name == "__init__.py")
        for name, path in paths.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_reader_counts_function_level_and_relative_imports() -> None:
    source = "import os\nimport dptune.d.name\nfrom . import b\n\ndef f():\n    from .c import name\n"
    known = {"dptune.a", "dptune.a.b", "dptune.a.c", "dptune.d"}
    assert imported("dptune.a", source, known, is_package=True) == {"dptune.a.b", "dptune.a.c", "dptune.d"}
    assert imported("dptune.a.b", "from .c import name\nfrom dptune.a import c\n", known) == {"dptune.a.c"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_dptune_modules() -> None:
    found = circles(import_graph())
    assert not found, "import circles among dptune's modules (module-level and function-level imports): " + "; ".join(
        " <-> ".join(component) for component in found
    )


def test_no_module_is_over_the_line_limit() -> None:
    long = {
        name: lines
        for name, path in modules().items()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them along their sections): {long}"


def test_at_most_eight_modules_sit_directly_in_the_package() -> None:
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} .py files in dptune/ (at most {MAX_ROOT_MODULES}): {root}"


#: The one module outside ``dptune.privacy`` that may name ``calibrate_noise_multiplier``: σ is calibrated
#: once, by the planner, and every consumer (runners, ledger, records, the search) reads its Mechanism.
CALIBRATING_MODULE = "dptune.plan.mechanism"


def test_sigma_is_calibrated_in_the_planner_only() -> None:
    """No module under dptune/runners, dp, records or search, and none outside dptune/privacy but
    ``dptune.plan.mechanism``, names ``calibrate_noise_multiplier`` (an import, an attribute, a call or
    a monkeypatch target alike): a runner or the ledger that calibrated σ again would agree with the plan
    only as long as a cached calibrator got identical inputs."""
    naming = {
        name
        for name, path in modules().items()
        if any(
            (isinstance(node, ast.Name) and node.id == "calibrate_noise_multiplier")
            or (isinstance(node, ast.Attribute) and node.attr == "calibrate_noise_multiplier")
            or (isinstance(node, ast.alias) and node.name.rpartition(".")[2] == "calibrate_noise_multiplier")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        )
    }
    consumers = ("dptune.runners", "dptune.dp", "dptune.records", "dptune.search")
    calibrating_consumers = sorted(n for n in naming for c in consumers if n == c or n.startswith(c + "."))
    assert not calibrating_consumers, f"σ calibrated where it is only read: {calibrating_consumers}"
    outside = {name for name in naming if name != "dptune.privacy" and not name.startswith("dptune.privacy.")}
    assert outside == {CALIBRATING_MODULE}, f"σ calibrated outside the planner: {sorted(outside)}"


#: What each part of dptune may import (besides itself and the base: ``errors``, ``contract``, ``paths``,
#: ``_thirdparty`` and the package root): the map of docs/ARCHITECTURE.md, read top to bottom. A part
#: not named here (a new package) must be added, with its place in the map.
BASE = frozenset({"dptune", "errors", "contract", "paths", "_thirdparty"})
ALLOWED: dict[str, frozenset[str]] = {
    "privacy": frozenset(),
    "plan": frozenset({"privacy"}),
    "space": frozenset({"plan", "privacy"}),
    "models": frozenset(),
    "data": frozenset({"models"}),
    "dp": frozenset({"models", "privacy"}),
    "records": frozenset(),
    "runners": frozenset({"dp", "data", "models", "plan", "privacy", "records"}),
    "analysis": frozenset({"plan", "records", "space"}),
    "report": frozenset({"analysis", "records"}),
    "search.preflight": frozenset({"space", "plan", "privacy", "records"}),
    "search.planning": frozenset({"space", "plan", "privacy", "data", "runners", "records", "search.runs"}),
    "search.runs": frozenset({"runners", "records", "plan", "privacy"}),
    "search.scheduling": frozenset(
        {"search.preflight", "search.runs", "search.planning", "space", "records", "plan", "privacy", "analysis"}
    ),
    "search.finish": frozenset(
        {
            "search.preflight",
            "search.planning",
            "search.runs",
            "space",
            "records",
            "analysis",
            "report",
            "plan",
            "privacy",
            "model",
        }
    ),
    "search": frozenset(
        {
            "search.preflight",
            "search.planning",
            "search.runs",
            "search.scheduling",
            "search.finish",
            "space",
            "plan",
            "privacy",
            "data",
            "models",
            "runners",
            "records",
            "analysis",
            "report",
        }
    ),
    "audit": frozenset({"dp", "data", "runners", "plan", "privacy", "records", "space", "search", "search.planning"}),
    "model": frozenset({"data", "models", "records", "runners"}),
    "predict": frozenset({"data", "model", "search.finish"}),
    "__main__": frozenset(),
}
#: The parts of ``dptune.search`` with a place of their own in the map: its subpackages, and the checks
#: before data (``preflight``), which every part of the search may use.
SEARCH_PARTS = ("preflight", "planning", "runs", "scheduling", "finish")


def part(module: str) -> str:
    """The part of the map module ``module`` belongs to: ``dptune.search.runs.execution`` → ``search.runs``,
    ``dptune.search.driver`` → ``search``, ``dptune.privacy.prv`` → ``privacy``, ``dptune.errors`` → ``errors``."""
    names = module.split(".")[1:]
    if not names:
        return "dptune"
    if names[0] == "search" and len(names) > 1 and names[1] in SEARCH_PARTS:
        return f"search.{names[1]}"
    return names[0]


def test_every_import_follows_the_map() -> None:
    """Data flows one way (docs/ARCHITECTURE.md): every import between parts of dptune is one the map allows."""
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if part(target) != part(module)
        and part(target) not in BASE
        and part(target) not in ALLOWED.get(part(module), frozenset())
    )
    unmapped = sorted({part(module) for module in import_graph()} - set(ALLOWED) - BASE)
    assert not unmapped, f"parts of dptune missing from the map (ALLOWED): {unmapped}"
    assert not wrong, "imports against the map (docs/ARCHITECTURE.md): " + "; ".join(wrong)


def test_ray_is_imported_only_where_scheduling_happens() -> None:
    """``import ray`` (anywhere in a module) only in ``dptune.search.scheduling`` and ``dptune._thirdparty``."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module]
            if any(t == "ray" or t.startswith("ray.") for t in targets):
                found.append(name)
    outside = sorted({n for n in found if part(n) != "search.scheduling" and n != "dptune._thirdparty"})
    assert not outside, f"Ray imported outside dptune.search.scheduling: {outside}"
