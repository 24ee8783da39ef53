"""Add to a YAML file's text without touching a byte of what is already there.

The file is parsed once into nodes that carry their positions (PyYAML's composer), each edit
(``kvsidecar.k8s_patch``: append to a list, add a key to a mapping) finds its collection's
node, and the new lines are inserted after that collection's last line, at its indentation;
in a flow collection (``[...]``, ``{...}``, JSON) the new entries go before the closing
bracket as JSON. Comments, quoting, key order and blank lines outside the insertions stay
exactly as they were: re-serialising the file would lose them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvcore.extras import MissingExtraError
from kvsidecar.k8s_edits import AddKey, Append, Edit, Path

try:
    import yaml
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise MissingExtraError("kvsidecar inject", "k8s", "PyYAML", exc) from exc

__all__ = ["Document", "SpliceError", "apply", "insertions", "parse_documents"]


class SpliceError(ValueError):
    """The file's structure does not allow an edit (or does not parse)."""


@dataclass(frozen=True)
class Document:
    """One YAML document: its node tree (with positions) and its value."""

    node: yaml.Node
    value: Any

    def shared(self) -> set[int]:
        """The ids of nodes reached more than once (an anchor and its aliases)."""
        seen: set[int] = set()
        twice: set[int] = set()
        stack = [self.node]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                twice.add(id(node))
                continue
            seen.add(id(node))
            if isinstance(node, yaml.MappingNode):
                stack += [part for pair in node.value for part in pair]
            elif isinstance(node, yaml.SequenceNode):
                stack += node.value
        return twice


@dataclass(frozen=True)
class Insertion:
    index: int  # character offset in the text
    depth: int  # nesting of the edited collection: deeper ones go first at one offset
    text: str


def parse_documents(text: str) -> list[Document]:
    """Every document of ``text`` (empty ones left out)."""
    loader = yaml.SafeLoader(text)
    docs: list[Document] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is not None:
                docs.append(Document(node, loader.construct_document(node)))
    except yaml.YAMLError as exc:
        raise SpliceError(f"not valid YAML: {exc}") from exc
    finally:
        loader.dispose()
    return docs


def insertions(text: str, doc: Document, edits: Sequence[Edit]) -> list[Insertion]:
    """Where and what to insert in ``text`` (which ``doc`` was parsed from) for ``edits``."""
    shared = doc.shared() if edits else set()
    return [_insertion(text, doc.node, edit, shared) for edit in edits]


def apply(text: str, inserts: Sequence[Insertion]) -> str:
    """``text`` with ``inserts`` in place (their order kept among equals)."""
    ordered = sorted(enumerate(inserts), key=lambda p: (p[1].index, -p[1].depth, p[0]))
    crlf = "\r\n" in text  # new lines end as the file's do
    out: list[str] = []
    last = 0
    for _, ins in ordered:
        out.append(text[last : ins.index])
        if ins.index == len(text) and text and not text.endswith("\n") and "\n" in ins.text:
            out.append("\r\n" if crlf else "\n")
        out.append(ins.text.replace("\n", "\r\n") if crlf else ins.text)
        last = ins.index
    out.append(text[last:])
    return "".join(out)


def _insertion(text: str, root: yaml.Node, edit: Edit, shared: set[int]) -> Insertion:
    node = _resolve(root, edit.path, shared)
    depth = len(edit.path)
    match edit:
        case Append(_, value):
            if not isinstance(node, yaml.SequenceNode):
                raise SpliceError(f"{_dotted(edit.path)} is not a list")
            if node.flow_style:
                return _flow_insert(text, node, json.dumps(value), depth)
            column = node.start_mark.column
            return Insertion(_after(text, node), depth, _block_item(value, column))
        case AddKey(_, key, value):
            if not isinstance(node, yaml.MappingNode):
                raise SpliceError(f"{_dotted(edit.path)} is not a mapping")
            if node.flow_style:
                entry = f"{json.dumps(key)}: {json.dumps(value)}"
                return _flow_insert(text, node, entry, depth)
            column = node.start_mark.column
            return Insertion(_after(text, node), depth, _block_key(key, value, column))
    raise AssertionError(edit)  # pragma: no cover


def _resolve(node: yaml.Node, path: Path, shared: set[int]) -> yaml.Node:
    for depth, part in enumerate(path):
        _not_shared(node, path[:depth], shared)
        if isinstance(part, int) and isinstance(node, yaml.SequenceNode):
            node = node.value[part]
        elif isinstance(part, str) and isinstance(node, yaml.MappingNode):
            found = [v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part]
            if len(found) != 1:
                raise SpliceError(f"cannot place {part!r} in the file's text (merge keys?)")
            node = found[0]
        else:
            raise SpliceError(f"cannot follow {_dotted(path)} in the file's text")
    _not_shared(node, path, shared)
    return node


def _not_shared(node: yaml.Node, path: Path, shared: set[int]) -> None:
    if id(node) in shared:
        raise SpliceError(
            f"{_dotted(path) or 'the document'} is an anchor (&name) used elsewhere through "
            "an alias (*name): adding to it would change every copy; write it out instead"
        )


def _dotted(path: Path) -> str:
    return ".".join(str(p) for p in path)


def _last_leaf(node: yaml.Node) -> yaml.Node:
    """The node that ends ``node`` in the text (a block collection's end mark overshoots)."""
    while isinstance(node, yaml.CollectionNode) and not node.flow_style and node.value:
        last = node.value[-1]
        node = last[1] if isinstance(node, yaml.MappingNode) else last
    return node


def _after(text: str, node: yaml.Node) -> int:
    """The start of the line after ``node``'s last line."""
    end = int(_last_leaf(node).end_mark.index)
    if end > 0 and text[end - 1] == "\n":
        return end
    newline = text.find("\n", end)
    return len(text) if newline < 0 else newline + 1


def _flow_insert(text: str, node: yaml.CollectionNode, entry: str, depth: int) -> Insertion:
    if node.value:
        leaf = node.value[-1][1] if isinstance(node, yaml.MappingNode) else node.value[-1]
        return Insertion(int(leaf.end_mark.index), depth, ", " + entry)
    close = text.rindex("]" if isinstance(node, yaml.SequenceNode) else "}", 0, node.end_mark.index)
    return Insertion(close, depth, entry)


class _Dumper(yaml.SafeDumper):
    """Block style with indented sequences (``key:\\n  - a``), the way manifests are written."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value.rstrip("\n") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(value: Any) -> list[str]:
    text = yaml.dump(
        value, Dumper=_Dumper, default_flow_style=False, sort_keys=False, width=10**6,
        allow_unicode=True,
    )
    lines = text.splitlines()
    if lines and lines[-1] == "...":  # a bare scalar's document end
        lines.pop()
    return lines


def _block_item(value: Any, column: int) -> str:
    lines = _dump(value)
    pad = " " * column
    head = f"{pad}- {lines[0]}\n"
    return head + "".join(f"{pad}  {line}\n" for line in lines[1:])


def _block_key(key: str, value: Any, column: int) -> str:
    pad = " " * column
    return "".join(f"{pad}{line}\n" for line in _dump({key: value}))
