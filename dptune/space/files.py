"""Search-space files: read a YAML spec safely, resolve ``extends`` and ``--set`` overrides, validate.

A spec file is read with a loader that accepts only plain YAML (mappings, lists, scalars and merge
keys; at most ``MAX_SPEC_BYTES`` bytes and ``MAX_SPEC_NODES`` nodes, aliases counted where used),
merged over the file it ``extends``, overridden key by key, and validated into a
:class:`~dptune.space.spec.SearchSpace`; any problem raises :class:`~dptune.space.spec.SpaceError`
naming the file, the key as written and what is allowed (an unknown key with the closest allowed one).
A space given in Python is its YAML text, parsed by :func:`parse_space` under a name in the working
folder (so its relative paths and ``extends`` are taken from there).

Relative paths, one rule: ``extends`` and every path key (:data:`PATH_KEYS`) written in a space file
are taken from that file's folder; those given by ``--set`` (an override) or in a Python mapping,
from the working folder. A relative data or model path that does not exist is refused on load,
naming the path as written, the folder it was taken from and the absolute path it became.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dptune.errors import shown
from dptune.space.messages import format_errors
from dptune.space.spec import UNRECORDED, LoadedSpace, SearchSpace, SpaceError, reads_no_text

#: Largest spec file read, in bytes (shipped specs are a few kB).
MAX_SPEC_BYTES = 1_000_000
#: Most YAML nodes a spec may expand to, each alias counted at every place it is used: a small
#: file of nested anchors (a "billion laughs") would otherwise expand to gigabytes.
MAX_SPEC_NODES = 10_000
#: YAML tags a spec may resolve to: plain mappings, lists and scalars (and ``<<`` merge keys).
_PLAIN_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}" for name in ("map", "seq", "str", "int", "float", "bool", "null", "merge", "timestamp")
)
#: The keys whose value is a local path (or an object-store URI, left as it is): a relative one written
#: in a space file is taken from that file's folder, as ``extends`` is; one given by ``--set`` or in a
#: Python mapping from the working folder.
PATH_KEYS = ("task.dataset.path", "task.dataset.test_path", "task.backbone.hf", "task.backbone.weights")
_RULE = (
    "A relative path written in a space file is taken from that file's folder (as extends is); one given "
    "by --set or in a Python mapping, from the working folder."
)


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


def _resolve_extends(
    data: dict[str, Any], path: Path, folder: Path, absent: list[str], seen: tuple[Path, ...] = ()
) -> dict[str, Any]:
    """Resolve ``extends: other.yaml`` (relative to ``folder``: the space file's, or the working folder's
    for one given by ``--set``): ``data`` deep-merged over the base's keys, the base's own relative paths
    taken from the base's folder (those that do not exist told in ``absent``)."""
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str) or not parent:
        raise SpaceError(f"{path}: extends: expected the file name of a base space, got {shown(parent)}")
    base_path = (folder / parent).resolve()
    if base_path in seen or not base_path.is_file():
        problem = "a cycle" if base_path in seen else "no such file"
        raise SpaceError(f"{path}: extends: {shown(parent)} is {problem} ({base_path}, {_origin(folder, path)})")
    base = _read_mapping(read_text(base_path), base_path)
    _anchor_paths(base, base_path, str(base_path), absent)
    return _merge(_resolve_extends(base, base_path, base_path.parent, absent, (*seen, base_path)), data)


def _origin(folder: Path, space: Path | None) -> str:
    """Where a relative path is taken from, in words: ``space``'s folder, or the working folder."""
    if space is not None and space.is_file():
        return f"relative to the folder of the space file {space.name}, {folder}"
    return f"relative to the working folder {folder}" if folder == Path.cwd() else f"relative to {folder}"


def _anchor_paths(data: dict[str, Any], space: Path | None, where: str, absent: list[str]) -> bool:
    """Make each relative local path of :data:`PATH_KEYS` in ``data`` absolute, taken from the folder of
    the file ``space`` (None: the working folder); whether any changed. One that does not exist is told
    in ``absent`` (naming ``where``, the key, the path as written, the folder and the absolute path);
    URIs and absolute paths are left to the data and model checks."""
    folder = space.parent.resolve() if space is not None else Path.cwd()
    changed = False
    for key in PATH_KEYS:
        *sections, name = key.split(".")
        node: Any = data
        for section in sections:
            node = node.get(section) if isinstance(node, dict) else None
        written = node.get(name) if isinstance(node, dict) else None
        if not isinstance(written, str):
            continue
        local = written.removeprefix("file://")
        if not local or "://" in local or Path(local).expanduser().is_absolute():
            continue
        resolved = (folder / local).resolve()
        if not resolved.exists():
            absent.append(
                f"{where}: {key}: {shown(written)} ({_origin(folder, space)}) is {resolved}, which does not exist"
            )
        node[name] = str(resolved)
        changed = True
    return changed


def _override(dotted: str, value: Any, absent: list[str]) -> dict[str, Any]:
    """The keys an override writes, nested (a copy of ``value``), its relative paths taken from the
    working folder (those that do not exist told in ``absent``)."""
    patch: dict[str, Any] = {}
    _apply_override(patch, dotted, copy.deepcopy(value))
    _anchor_paths(patch, None, f"--set {dotted}", absent)
    return patch


def _inherited_tokens_ignored(data: dict[str, Any], extends: Any) -> str | None:
    """Set ``task.max_tokens`` that ``data`` took from the space it extends to null where the backbone
    reads no text (``spec.reads_no_text``: the rows are embeddings, or images): the note saying so, else
    None. A value the space or an override writes is the user's, and validated as it is."""
    task = data.get("task")
    if not isinstance(task, dict) or task.get("max_tokens") is None:
        return None
    backbone = task.get("backbone")
    if not (isinstance(backbone, dict) and "timm" in backbone) and not (
        isinstance(backbone, str) and reads_no_text(backbone)
    ):
        return None
    data["task"] = {**task, "max_tokens": None}
    shown_backbone = "{timm: ...}" if isinstance(backbone, dict) else backbone
    return (
        f"task.max_tokens: {shown(task['max_tokens'])}, inherited through extends: {extends}, is ignored: "
        f"backbone {shown_backbone} reads no text (write task.max_tokens: null to say so)"
    )


def _lookup(data: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """Whether ``data`` (a space's own keys, or an override's) holds the dotted key ``dotted``, and its value."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


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


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """The overrides of the ``--set KEY=VALUE`` flags ``items``, each value parsed (:func:`parse_override`);
    ``SpaceError`` naming an item that is not KEY=VALUE or whose value does not parse."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpaceError(f"--set {shown(item)}: expected KEY=VALUE, e.g. privacy.epsilons=[1,8]")
        overrides[key] = parse_override(key, value)
    return overrides


def parse_space(text: str, path: Path | str = "<string>", overrides: dict[str, Any] | None = None) -> LoadedSpace:
    """Validate YAML ``text`` (the space file ``path``'s); ``overrides`` (dotted keys: ``--set``) are applied
    over it and its base.

    A file may start from another with ``extends: base.yaml`` (path relative to the file): its keys are
    deep-merged over the base's; ``--set extends=base.yaml`` (relative to the working folder) sets or
    replaces it. Relative paths (:data:`PATH_KEYS`) are taken from the folder of the file that writes
    them, an override's from the working folder. The recorded text is ``text`` as it is, or, when
    anything was merged, overridden or made absolute, the fully resolved spec, without ``UNRECORDED``
    (where the search is logged is not what it is: ``--set tracking.mlflow=URL`` leaves the text, and
    the search's id, as it was): its paths absolute, it means the same from any folder.
    """
    path = Path(path)
    overrides = dict(overrides or {})
    data = _read_mapping(text, path)
    absent: list[str] = []  # relative paths that do not exist: told once the space validates
    rewritten = _anchor_paths(data, path, str(path), absent)
    folder = path.parent
    if "extends" in overrides:
        data["extends"], folder = overrides.pop("extends"), Path.cwd()
    rewritten |= "extends" in data or UNRECORDED in data
    extends, (written, _) = data.get("extends"), _lookup(data, "task.max_tokens")
    data = _resolve_extends(data, path, folder, absent)
    for dotted, value in overrides.items():
        patch = _override(dotted, value, absent)
        _apply_override(data, dotted, _lookup(patch, dotted)[1])
        rewritten |= dotted.split(".")[0] != UNRECORDED
        written |= _lookup(patch, "task.max_tokens")[0]
    note = None if written or extends is None else _inherited_tokens_ignored(data, extends)
    try:
        space = SearchSpace.model_validate(data)
    except ValidationError as exc:
        raise SpaceError(format_errors(path, exc, data)) from None
    if absent:
        raise SpaceError("\n".join([*absent, _RULE]))
    recorded = {key: value for key, value in data.items() if key != UNRECORDED}
    text = yaml.safe_dump(recorded, sort_keys=False) if rewritten else text
    return LoadedSpace(space=space, path=path, text=text, notes=(note,) if note else ())


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
