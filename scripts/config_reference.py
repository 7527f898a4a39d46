"""The configuration reference page (docs/configuration.md), generated from contracts/config.py.

One source: every key is documented where it is declared, by the `#` comment on its line (and the
comment-only lines below it, indented past the field, that continue it) or, for a field with none
there, the comment-only lines right above it, at the field's indentation. This reads the source with
`ast` and `tokenize` — the sections (the fields of `Config`), each section's dataclass, its docstring,
and each field's type, default and comment — and renders the page.
A field without a comment is an error: the page would have a hole.

    python scripts/config_reference.py            # print the page
    python scripts/config_reference.py --write    # rewrite docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 when the page differs or a field has no comment

Standard library only; it never imports the module it reads.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "contracts" / "config.py"
PAGE = ROOT / "docs" / "configuration.md"
ROOT_CLASS = "Config"      # its fields are the TOML sections: `model: ModelConfig = ModelConfig()`


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    type: str
    default: str
    comment: str           # "" when the source has none


@dataclasses.dataclass(frozen=True)
class Section:
    name: str              # the TOML table: "model"
    cls: str               # its dataclass: "ModelConfig"
    doc: str
    fields: tuple[Field, ...]


@dataclasses.dataclass(frozen=True)
class _Comment:
    text: str
    column: int
    alone: bool            # nothing but the comment on its line


def _comments(source: str) -> dict[int, _Comment]:
    """Line number -> the comment on it."""
    found: dict[int, tuple[str, int]] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.start[1])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER, tokenize.ENCODING):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return {line: _Comment(text, column, line not in code_lines) for line, (text, column) in found.items()}


def _field_nodes(cls: ast.ClassDef) -> list[ast.AnnAssign]:
    return [n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)]


def parse(source: str) -> list[Section]:
    """The sections of `Config`, in its order, each with its fields in declaration order."""
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if ROOT_CLASS not in classes:
        raise ValueError(f"no class {ROOT_CLASS} in the source")
    comments = _comments(source)
    sections = []
    for node in _field_nodes(classes[ROOT_CLASS]):
        cls_name = ast.unparse(node.annotation)
        cls = classes.get(cls_name)
        if cls is None:
            raise ValueError(f"{ROOT_CLASS}.{node.target.id}: no class {cls_name} in the source")
        sections.append(Section(node.target.id, cls_name, ast.get_docstring(cls) or "",
                                tuple(_fields(cls, source, comments))))
    return sections


def _fields(cls: ast.ClassDef, source: str, comments: dict[int, _Comment]) -> list[Field]:
    nodes = _field_nodes(cls)
    claimed: set[int] = set()
    found: list[list[str]] = []
    # first each field's own line, and the comment-only lines below it indented past the field
    for node in nodes:
        texts = []
        trailing = comments.get(node.end_lineno)
        if trailing and not trailing.alone:
            texts.append(trailing.text)
            line = node.end_lineno + 1
            while line in comments and comments[line].alone and comments[line].column > node.col_offset:
                texts.append(comments[line].text)
                claimed.add(line)
                line += 1
        found.append(texts)
    # then, for a field with none there, the comment-only lines right above it (not another's continuation)
    for node, texts in zip(nodes, found):
        if texts:
            continue
        line, above = node.lineno - 1, []
        while line in comments and comments[line].alone and line not in claimed:
            above.insert(0, comments[line].text)
            line -= 1
        texts.extend(above)
    return [Field(node.target.id, ast.unparse(node.annotation), _toml_default(source, node.value),
                  " ".join(t for t in texts if t))
            for node, texts in zip(nodes, found)]


def _toml_default(source: str, value: ast.expr | None) -> str:
    """The default as it is written in a TOML file: the source's literal, booleans lower-case."""
    if value is None:
        return ""
    if isinstance(value, ast.Constant) and isinstance(value.value, bool):
        return "true" if value.value else "false"
    return ast.get_source_segment(source, value) or ast.unparse(value)


def missing_comments(source: str) -> list[str]:
    """Every `section.key` declared without a comment."""
    return [f"{s.name}.{f.name}" for s in parse(source) for f in s.fields if not f.comment]


_CODE = re.compile(r"(`[^`]*`)")


def _text(comment: str) -> str:
    """A comment as Markdown table-cell text: code spans kept, HTML and emphasis characters escaped."""
    parts = _CODE.split(comment)
    for i in range(0, len(parts), 2):      # the parts outside code spans
        parts[i] = (parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                    .replace("*", r"\*").replace("|", r"\|"))
    return "".join(parts)


def _code(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render(source: str) -> str:
    sections = parse(source)
    missing = [f"{s.name}.{f.name}" for s in sections for f in s.fields if not f.comment]
    if missing:
        raise ValueError("contracts/config.py: no comment for " + ", ".join(missing))
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by scripts/config_reference.py from contracts/config.py: do not edit; run"
        " `python scripts/config_reference.py --write` -->",
        "",
        "Every key of a run's TOML file, section by section, with its type, its default (the defaults are the",
        "tiny config: what runs when no file is given) and what it means. This page is generated from the",
        "comments in `contracts/config.py`, where each key is declared: that file is the one source, and a",
        "unit test fails when a key has no comment there or this page differs from what it renders.",
        "How a config is checked, the shipped configs and the rules between keys: [Configs](configs.md).",
        "",
        "Sections: " + ", ".join(f"[`[{s.name}]`](#{s.name})" for s in sections) + ".",
    ]
    for s in sections:
        out += ["", f"## `[{s.name}]`", ""]   # its anchor: #{s.name}
        if s.doc:
            out += [" ".join(s.doc.split()), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in s.fields:
            out.append(f"| {_code(f'{s.name}.{f.name}')} | {_code(f.type).replace('|', chr(92) + '|')} "
                       f"| {_code(f.default)} | {_text(f.comment)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {PAGE.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true",
                      help=f"exit 1 when {PAGE.relative_to(ROOT)} differs from the render, or a key has no comment")
    args = parser.parse_args(argv)
    source = SOURCE.read_text()
    try:
        page = render(source)
    except ValueError as e:
        print(f"config_reference: {e}", file=sys.stderr)
        return 1
    if args.write:
        PAGE.parent.mkdir(exist_ok=True)
        PAGE.write_text(page)
    elif args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"config_reference: {PAGE.relative_to(ROOT)} differs from contracts/config.py's comments: "
                  "run `python scripts/config_reference.py --write`", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
