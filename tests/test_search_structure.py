"""The shape of :mod:`dptune.search`, read from its source with ``ast`` (nothing is imported): no module
keeps mutable state at module level, and no function is 60 lines or longer.

Module-level mutable state (a list, dict or set a function fills) is shared by every search a process
runs, survives between them, and is what a restored Tune run or a second driver in the same process
would read by mistake; what a search owns lives in its session (``driver.SearchSession``) and in the
objects it hands to Tune (``tune_adapters.TuneRunState``). Constant tables are tuples or
``types.MappingProxyType``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SEARCH = Path(__file__).resolve().parents[1] / "dptune" / "search"
#: The calls that make a mutable value.
MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "Counter", "OrderedDict", "deque", "bytearray"}
#: Module-level names allowed to hold a mutable value, each with its reason: lookup tables that are never
#: written (prefer a tuple or a ``MappingProxyType``), and the state left to move.
ALLOWED: dict[str, str] = {
    "dptune.records.lease._SEEN_HELD": "a trial worker's memory of the leases it saw held, across check_holder "
    "calls; it moves into what the worker's runs share once execution.TrialContext can carry it",
}
#: The longest a function of dptune.search may be, in lines (its decorators not counted).
MAX_FUNCTION_LINES = 59


def _modules() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(SEARCH.parents[1]).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted(SEARCH.rglob("*.py"))
    }


def _mutable(value: ast.expr | None) -> bool:
    """Whether ``value`` makes a mutable object: a list, dict or set display or comprehension, or a call of
    one of ``MUTABLE_CALLS`` (``dict.fromkeys`` included)."""
    if isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp):
        return True
    if not isinstance(value, ast.Call):
        return False
    function = value.func
    if isinstance(function, ast.Attribute):  # collections.Counter(...), dict.fromkeys(...)
        fromkeys = function.attr == "fromkeys" and isinstance(function.value, ast.Name)
        return function.attr in MUTABLE_CALLS or (fromkeys and function.value.id in MUTABLE_CALLS)
    return isinstance(function, ast.Name) and function.id in MUTABLE_CALLS


def module_level_mutables(source: str) -> list[str]:
    """The names a module's top level (``if`` blocks included, classes and functions not) binds to a mutable value."""
    found = []
    body = list(ast.parse(source).body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If | ast.Try):
            body += [*node.body, *node.orelse]
            continue
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign) and _mutable(node.value):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and _mutable(node.value):
            targets = [node.target]
        found += [target.id for target in targets if isinstance(target, ast.Name)]
    return found


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """Every function (methods and nested ones included) longer than ``limit`` lines, with its length."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_readers_find_mutable_module_state_and_long_functions() -> None:
    source = (
        "import collections\n"
        "A: list[str] = []\nB = {}\nC = dict.fromkeys('ab')\nD = collections.Counter()\nE = ()\n"
        "F = frozenset()\nif True:\n    G = set()\n"
        "class K:\n    H = []\n"
        "def f():\n    I = []\n" + "    pass\n" * 58
    )
    assert module_level_mutables(source) == ["A", "B", "C", "D", "G"]
    assert long_functions(source) == [("f", 60)]
    assert long_functions(source, limit=60) == []


def test_no_module_of_the_search_keeps_mutable_state() -> None:
    found = {
        f"{name}.{variable}"
        for name, path in _modules().items()
        for variable in module_level_mutables(path.read_text())
    }
    assert found <= set(ALLOWED), sorted(found - set(ALLOWED))


def test_no_function_of_the_search_is_60_lines_or_longer() -> None:
    """One function, one job: a phase of the driver, a part of a table. (Until outcome.py and cli.py are
    split by their own change, their long functions are listed here as what is left.)"""
    found = {
        f"{name}.{function} ({lines} lines)"
        for name, path in _modules().items()
        for function, lines in long_functions(path.read_text())
    }
    assert not found, sorted(found)
