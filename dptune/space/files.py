"""Search-space files: read a YAML spec safely, resolve ``extends`` and ``--set`` overrides, validate.

A spec file is read with a loader that accepts only plain YAML (mappings, lists, scalars and merge
keys; at most ``MAX_SPEC_BYTES`` bytes and ``MAX_SPEC_NODES`` nodes, aliases counted where used),
merged over the file it ``extends``, overridden key by key, and validated into a
:class:`~dptune.space.spec.SearchSpace`; any problem raises :class:`~dptune.space.spec.SpaceError`
naming the file, the key and what is allowed.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dptune.errors import shown
from dptune.space.spec import UNRECORDED, LoadedSpace, SearchSpace, SpaceError

#: Largest spec file read, in bytes (shipped specs are a few kB).
MAX_SPEC_BYTES = 1_000_000
#: Most YAML nodes a spec may expand to, each alias counted at every place it is used: a small
#: file of nested anchors (a "billion laughs") would otherwise expand to gigabytes.
MAX_SPEC_NODES = 10_000
#: YAML tags a spec may resolve to: plain mappings, lists and scalars (and ``<<`` merge keys).
_PLAIN_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}" for name in ("map", "seq", "str", "int", "float", "bool", "null", "merge", "timestamp")
)


def _format_errors(path: Path, error: ValidationError) -> str:
    lines = [f"{path}: invalid search space ({error.error_count()} problem(s))"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif item["type"] == "missing":
            message = "required key is missing"
        elif item["type"] == "literal_error":
            message = f"not allowed; {item['msg'].replace('Input should be', 'expected')}"
        got = item.get("input")
        quoted = "" if item["type"] == "missing" or isinstance(got, dict) else f" (got {shown(got)})"
        lines.append(f"  - {key}: {message}{quoted}")
    return "\n".join(lines)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base`` (mappings merge, everything else replaces)."""
    merged = dict(base)
    for key, value in override.items():
        both_mappings = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if both_mappings else value
    return merged


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error, not last-one-wins."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        first_line: dict[Hashable, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # PyYAML's own check reports it
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {shown(key)} is given twice (first on line {first_line[key] + 1}); give each key once",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _check_nodes(root: yaml.Node, where: str) -> None:
    """Refuse non-plain tags and documents that expand (aliases counted at each use) past ``MAX_SPEC_NODES``."""
    expanded: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in expanded:
            return expanded[id(node)]
        if node.tag not in _PLAIN_TAGS:
            raise SpaceError(
                f"{where}: line {node.start_mark.line + 1}: YAML tag {shown(node.tag)} is not allowed "
                "(plain YAML only: mappings, lists, strings, numbers, booleans, null)"
            )
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_SPEC_NODES:
                raise SpaceError(
                    f"{where}: expands to more than {MAX_SPEC_NODES} YAML nodes (aliases count at "
                    "each use); a search space needs a few hundred: write the values out"
                )
        expanded[id(node)] = total
        return total

    size(root)


def parse_yaml(text: str, where: str) -> Any:
    """Parse one YAML document of plain values (``SpaceError`` naming ``where`` otherwise).

    Refused: duplicate keys, tags other than plain ones (``!!python/...``, custom ``!tags``),
    documents that expand beyond ``MAX_SPEC_NODES`` nodes through aliases, and nesting deeper
    than Python's recursion limit. Messages quote at most a short excerpt of the input.
    """
    loader = _SpecLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, where)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise SpaceError(f"{where}: not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise SpaceError(f"{where}: nested too deeply (a search space is a few levels of mappings)") from None
    finally:
        loader.dispose()


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's problem and its line, without the excerpt of the input it would quote."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        return f"{where}{(error.problem or error.context or 'unreadable')[:200]}"
    return str(error).splitlines()[0][:200] if str(error) else type(error).__name__


def read_text(path: Path) -> str:
    """The UTF-8 text of a spec file (``SpaceError`` naming the file if missing, too large or binary)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpaceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpaceError(f"{path}: larger than {MAX_SPEC_BYTES} bytes (a search space is a small YAML file)")
    binary = "a search space is UTF-8 YAML"
    if (nul := data.find(b"\0")) >= 0:
        raise SpaceError(f"{path}: not a text file (a NUL byte at offset {nul}; {binary})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpaceError(f"{path}: not a text file (byte {exc.start} is not UTF-8; {binary})") from None


def _read_mapping(text: str, path: Path) -> dict[str, Any]:
    """Parse YAML into a mapping (``SpaceError`` naming the file otherwise)."""
    data = parse_yaml(text, str(path))
    if not isinstance(data, dict):
        raise SpaceError(f"{path}: a search space must be a YAML mapping of keys, got {type(data).__name__}")
    return data


def _resolve_extends(data: dict[str, Any], path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Resolve ``extends: other.yaml`` (relative to ``path``): ``data`` deep-merged over the base's keys."""
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise SpaceError(f"{path}: extends: expected the file name of a base space, got {shown(parent)}")
    base_path = (path.parent / parent).resolve()
    if base_path in seen or not base_path.is_file():
        problem = "a cycle" if base_path in seen else "no such file"
        raise SpaceError(f"{path}: extends: {shown(parent)} is {problem} ({base_path})")
    base = _read_mapping(read_text(base_path), base_path)
    return _merge(_resolve_extends(base, base_path, (*seen, base_path)), data)


def _apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set the dotted key ``dotted`` of ``data`` to ``value`` (a ``--set``), creating sections."""
    parts = dotted.split(".")
    if not all(parts):
        raise SpaceError(f"--set {shown(dotted)}: a key is dot-separated names, e.g. privacy.epsilons")
    if parts[0] == "extends" and len(parts) > 1:
        raise SpaceError(f"--set {shown(dotted)}: extends is a file name, not a section (use --set extends=FILE)")
    node = data
    for depth, part in enumerate(parts[:-1], start=1):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            section = ".".join(parts[:depth])
            raise SpaceError(
                f"--set {shown(dotted)}: {section} is a value ({shown(child)}), not a section with "
                f"keys (set {section}=VALUE instead)"
            )
        node = child
    node[parts[-1]] = value


def parse_override(key: str, value: str) -> Any:
    """The YAML value of ``--set KEY=VALUE``, parsed like a spec (``SpaceError`` naming the flag)."""
    return parse_yaml(value, f"--set {shown(key)}")


def parse_space(text: str, path: Path | str = "<string>", overrides: dict[str, Any] | None = None) -> LoadedSpace:
    """Validate YAML ``text``; ``overrides`` (dotted keys) are applied first (CLI flags).

    A file may start from another with ``extends: base.yaml`` (path relative to the file): its
    keys are deep-merged over the base's; ``--set extends=base.yaml`` sets or replaces it. The
    recorded text is the fully resolved spec, without ``UNRECORDED`` (where the search is logged is not
    what it is: ``--set tracking.mlflow=URL`` leaves the text, and the search's id, as it was).
    """
    path = Path(path)
    overrides = dict(overrides or {})
    data = _read_mapping(text, path)
    if "extends" in overrides:
        data["extends"] = overrides.pop("extends")
    rewritten = "extends" in data or UNRECORDED in data
    data = _resolve_extends(data, path)
    for dotted, value in overrides.items():
        _apply_override(data, dotted, value)
        rewritten |= dotted.split(".")[0] != UNRECORDED
    try:
        space = SearchSpace.model_validate(data)
    except ValidationError as exc:
        raise SpaceError(_format_errors(path, exc)) from None
    recorded = {key: value for key, value in data.items() if key != UNRECORDED}
    text = yaml.safe_dump(recorded, sort_keys=False) if rewritten else text
    return LoadedSpace(space=space, path=path, text=text)


def spec_differences(old_text: str, new_text: str) -> list[str]:
    """The keys (dotted) whose values differ between two spec texts, each as ``key: old → new``."""
    before, after = _flatten(parse_yaml(old_text, "the recorded space")), _flatten(parse_yaml(new_text, "the space"))
    missing = object()
    changes = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, missing), after.get(key, missing)
        if old != new:
            changes.append(
                f"{key}: {'(not set)' if old is missing else shown(old, 40)} → "
                f"{'(not set)' if new is missing else shown(new, 40)}"
            )
    return changes


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{dotted.key: value}`` (lists and scalars are values)."""
    if not isinstance(data, dict):
        return {prefix: data} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def load_space(path: str | Path, overrides: dict[str, Any] | None = None) -> LoadedSpace:
    """Read and validate a search-space file (``SpaceError`` if missing, unreadable or invalid)."""
    path = Path(path)
    if not path.is_file():
        shipped = sorted(p.name for p in (Path(__file__).resolve().parents[2] / "search_spaces").glob("*.yaml"))
        raise SpaceError(f"{path}: no such search-space file; shipped spaces: {', '.join(shipped) or 'none found'}")
    return parse_space(read_text(path), path, overrides)
