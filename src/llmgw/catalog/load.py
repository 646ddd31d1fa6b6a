"""Load YAML config into Structs; every error names the file, the YAML path and the line."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import msgspec
import yaml

from llmgw.catalog.schema import AgentConfig, ServerConfig
from llmgw.catalog.units import dec_hook, enc_hook
from llmgw.errors import UsageError

T = TypeVar("T", bound=msgspec.Struct)

Path = tuple[str | int, ...]


class ConfigError(UsageError):
    """One line an operator can act on: `file:line path: what is wrong`."""


class _DuplicateKey(Exception):
    def __init__(self, path: Path, line: int, first: int) -> None:
        super().__init__(f"duplicate key (first at line {first}); YAML would silently keep the last one")
        self.path = path
        self.line = line


class _AliasRefused(Exception):
    def __init__(self, line: int, name: str) -> None:
        super().__init__(
            f"YAML alias *{name} is not accepted: write the value out in full (aliases let a few hundred "
            "bytes expand into gigabytes, the 'billion laughs' attack)"
        )
        self.line = line


class _TooDeep(Exception):
    def __init__(self, line: int) -> None:
        super().__init__(
            f"YAML nested deeper than {MAX_DEPTH} levels: llmgw's configs need fewer than ten "
            "(a deep nest exhausts the parser's stack, as an alias bomb exhausts memory)"
        )
        self.line = line


# The deepest real config (a value in a model's profile's env: models[i].profiles[j].env.K) is
# about 6 levels; 64 leaves room for hand-written nesting and stays far below Python's recursion
# limit, which the composer (one compose_node call per level) reaches near 1,000: 50,000 levels
# gave a 2,997-line traceback at start and HTTP 500 on reload before this (issue 41, item 5).
MAX_DEPTH = 64


_CParser: type = getattr(yaml, "CParser", yaml.parser.Parser)
_Events: type  # libyaml's parser, or the pure-Python reader, scanner and parser without it
if _CParser is yaml.parser.Parser:
    class _PyEvents(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser):
        def __init__(self, stream: str) -> None:
            yaml.reader.Reader.__init__(self, stream)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)
    _Events = _PyEvents
else:
    _Events = _CParser


class _Loader(yaml.composer.Composer, _Events, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """Events from libyaml (the pure-Python parser took 17 s for a 3,000-model catalog on the
    2-core development machine), composed and constructed in Python: each event is one short
    call, so a reload parsed in a worker thread never holds the GIL for long (libyaml's own
    composer held it 0.3-0.5 s at a time on that catalog, stalling the event loop).

    Aliases (`*name`, and so `<<: *name`) are refused while composing. A 322-byte config of
    nested aliases took 28.6 s and 2.46 GB before this (issue 9): the composed graph is small,
    but every walk over it (line numbers, key conversion, msgspec) expands each alias again.
    Anchors alone (`&name`) are harmless and pass.
    """

    def __init__(self, stream: str) -> None:
        cast(Any, _Events).__init__(self, stream)  # a class chosen at import: libyaml's or Python's
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(event.start_mark.line + 1, str(event.anchor))
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _compose(text: str) -> tuple[yaml.Node | None, Any]:
    """The node tree (for line numbers) and the plain data built from it, in one parse."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
        return root, data
    finally:
        loader.dispose()


def _walk(node: yaml.Node, path: Path, lines: dict[Path, int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value if isinstance(key_node, yaml.ScalarNode) else key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey((*path, key), line, seen[key])
            seen[key] = line
            lines[(*path, key)] = line
            _walk(value_node, (*path, key), lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), lines)


def _stringify_keys(data: Any) -> Any:
    if isinstance(data, dict):
        return {str(k): _stringify_keys(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_stringify_keys(v) for v in data]
    return data


_SEGMENT = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def _parse_path(text: str) -> Path:
    """`$.models[0].profiles[1].gpus` → ("models", 0, "profiles", 1, "gpus")."""
    out: list[str | int] = []
    for match in _SEGMENT.finditer(text.removeprefix("$")):
        out.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
    return tuple(out)


def format_path(path: Path) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _lookup(data: Any, path: Path) -> Any:
    for part in path:
        if isinstance(data, dict):
            if part not in data:
                return None
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return None
    return data


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    text = (json.dumps(value) if isinstance(value, str)
            else str(value).lower() if isinstance(value, bool) else str(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _type_at(root: type, path: Path) -> Any:
    import msgspec.inspect as mi

    info: Any = mi.type_info(root)
    for part in path:
        while isinstance(info, mi.UnionType):
            structs = [t for t in info.types if not isinstance(t, mi.NoneType)]
            if not structs:
                return None
            info = structs[0]
        if isinstance(part, int) and isinstance(info, mi.ListType):
            info = info.item_type
        elif isinstance(part, str) and isinstance(info, mi.StructType):
            field = next((f for f in info.fields if f.encode_name == part), None)
            if field is None:
                return None
            info = field.type
        elif isinstance(info, mi.DictType):
            info = info.value_type
        else:
            return None
    return info


def _literal_values(root: type, path: Path) -> list[str]:
    import msgspec.inspect as mi

    info = _type_at(root, path)
    kinds = info.types if isinstance(info, mi.UnionType) else (info,)  # `Literal[...] | bool` too
    return [str(v) for kind in kinds if isinstance(kind, mi.LiteralType) for v in kind.values]


def _field_names(root: type, path: Path) -> list[str]:
    """Known keys of the Struct that sits at `path` in the schema (for 'did you mean')."""
    import msgspec.inspect as mi

    info: Any = _type_at(root, path)
    if info is None:
        return []
    while isinstance(info, mi.UnionType):
        structs = [t for t in info.types if isinstance(t, mi.StructType)]
        if not structs:
            return []
        info = structs[0]
    return [f.encode_name for f in info.fields] if isinstance(info, mi.StructType) else []


_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`(?: - at `(?P<path>[^`]*)`)?$")
_CONSTRAINT = re.compile(r"^Expected `(?P<want>[^`]+)` (?P<cons>[<>=]+ \S+)(?: - at `(?P<path>[^`]*)`)?$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`(?: - at `(?P<path>[^`]*)`)?$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`(?: - at `(?P<path>[^`]*)`)?$")
_ENUM = re.compile(r"^Invalid enum value .*?(?: - at `(?P<path>[^`]*)`)?$", re.DOTALL)
_GENERIC = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.DOTALL)


def _explain(exc: msgspec.ValidationError, data: Any, kind: type) -> tuple[Path, str]:
    text = str(exc)
    if m := _EXPECTED.match(text):
        path = _parse_path(m["path"] or "$")
        want = m["want"].replace("array", "list").replace("object", "mapping")
        return path, f"expected {want}, got {_show(_lookup(data, path))}"
    if m := _CONSTRAINT.match(text):
        path = _parse_path(m["path"] or "$")
        return path, f"expected {m['want']} {m['cons']}, got {_show(_lookup(data, path))}"
    if m := _UNKNOWN.match(text):
        parent = _parse_path(m["path"] or "$")
        known = _field_names(kind, parent)
        import difflib

        close = difflib.get_close_matches(m["field"], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else (f" (known keys: {', '.join(known)})" if known else "")
        return (*parent, m["field"]), f"unknown key{hint}"
    if m := _MISSING.match(text):
        parent = _parse_path(m["path"] or "$")
        return parent, f"missing required key {m['field']!r}"
    if m := _ENUM.match(text):
        path = _parse_path(m["path"] or "$")
        allowed = _literal_values(kind, path)
        if allowed:
            return path, f"expected one of {', '.join(allowed)}, got {_show(_lookup(data, path))}"
    m = _GENERIC.match(text)
    assert m is not None
    msg = m["msg"].replace("`", "")
    msg = msg[:1].lower() + msg[1:]
    return _parse_path(m["path"] or "$"), msg


def parse_config(text: str, kind: type[T], filename: str = "<config>") -> T:
    """Parse YAML text into `kind`; raise ConfigError naming file:line and the YAML path."""
    name = filename
    try:
        root, data = _compose(text)
    except (_AliasRefused, _TooDeep) as exc:
        raise ConfigError(f"{name}:{exc.line}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"{name}{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: invalid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name}:1: expected a mapping of settings at the top level, got {_show(data)}")
    data = _stringify_keys(data)
    lines: dict[Path, int] = {}
    if root is not None:
        try:
            _walk(root, (), lines)
        except _DuplicateKey as exc:
            raise ConfigError(f"{name}:{exc.line} {format_path(exc.path)}: {exc}") from None
    try:
        return msgspec.convert(data, type=kind, dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        path, message = _explain(exc, data, kind)
        probe = path
        while probe not in lines and probe:
            probe = probe[:-1]
        lineno = lines.get(probe, 1)
        raise ConfigError(f"{name}:{lineno} {format_path(path)}: {message}") from None


def load_config(path: str, kind: type[T]) -> T:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from None
    return parse_config(text, kind, path)


def load_server_config(path: str | None) -> ServerConfig:
    return load_config(path, ServerConfig) if path else ServerConfig()


def load_agent_config(path: str | None) -> AgentConfig:
    return load_config(path, AgentConfig) if path else AgentConfig()


def override(config: T, values: Mapping[str, Any], source: str = "flag") -> T:
    """Return `config` with the non-None `values` applied (flags and LLMGW_* variables win)."""
    changes = {k: v for k, v in values.items() if v is not None}
    if not changes:
        return config
    data = msgspec.to_builtins(config, enc_hook=enc_hook)
    data.update(changes)
    try:
        return msgspec.convert(data, type=type(config), dec_hook=dec_hook)
    except msgspec.ValidationError as exc:
        path, message = _explain(exc, data, type(config))
        raise ConfigError(f"{source} {format_path(path)}: {message}") from None
