"""MkDocs hooks (mkdocs.yml ``hooks:``): the pages made from the code, and the built site checked.

- ``index.md``: README.md, the front page, with its ``docs/`` links made relative to the site
  (made at build time, never kept in git);
- ``docs/api-reference.md``: every service, method, message, field, enum and value of the proto,
  with the proto's own comments (read from ``protoc --include_source_info``'s descriptor set);
- ``docs/config-reference.md``: every config key of the settings model with its type, default,
  environment variable and description (the docstring under the key in rcoder/config.py).

The two references are written by ``make docs-reference`` and kept in git, so that the README's
links to them work on a forge and in a clone; the build fails when they are not what the proto
and the model make now. A proto element without a comment, or a config key without a
description, fails the build too, and so does a built page that lost a word or a table of its
Markdown or would fetch anything from another site (``scripts/docs_site_check.py``).
"""

from __future__ import annotations

import enum
import re
import shutil
import subprocess
import sys
import tempfile
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
PROTO = Path("rcoder/v1/agent_runner.proto")

# FileDescriptorProto / DescriptorProto field numbers, as SourceCodeInfo paths name them
_MESSAGE, _ENUM, _SERVICE = 4, 5, 6
_FIELD, _NESTED, _NESTED_ENUM = 2, 3, 4
_VALUE, _METHOD = 2, 2


def _comment(comments: dict[tuple[int, ...], str], path: tuple[int, ...], name: str, missing: list[str]) -> str:
    text = comments.get(path, "").strip()
    if not text:
        missing.append(name)
    return _prose(" ".join(line.strip() for line in text.splitlines()))


def _prose(text: str) -> str:
    """Text for Markdown: ``<`` and ``>`` outside code spans as entities, or ``<project_id>`` would
    be taken for an HTML tag and vanish from the page (scripts/docs_site_check.py)."""
    parts = re.split(r"(`+[^`]*`+)", text)
    return "".join(part if part.startswith("`") else part.replace("<", "&lt;").replace(">", "&gt;") for part in parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def api_reference() -> str:
    """The API reference page, from the proto's descriptor set with source info."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), "--include_source_info",
             f"--descriptor_set_out={out}", str(PROTO)],
            check=True, cwd=ROOT,
        )  # fmt: skip
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (proto,) = [f for f in fds.file if f.name == str(PROTO)]
    comments = {
        tuple(loc.path): loc.leading_comments or loc.trailing_comments for loc in proto.source_code_info.location
    }
    missing: list[str] = []
    lines = [
        "# API reference",
        "",
        f"Generated from `proto/{PROTO}` (package `{proto.package}`) and its comments by `make docs-reference`",
        "(`make docs` fails while it is not up to date).",
        "",
    ]
    for s, service in enumerate(proto.service):
        lines += [f"## service {service.name}", "", _comment(comments, (_SERVICE, s), service.name, missing), ""]
        lines += ["| method | request | response | what |", "|---|---|---|---|"]
        for m, method in enumerate(service.method):
            what = _comment(comments, (_SERVICE, s, _METHOD, m), f"{service.name}.{method.name}", missing)
            stream = "stream " if method.server_streaming else ""
            req, resp = method.input_type.rsplit(".", 1)[-1], method.output_type.rsplit(".", 1)[-1]
            lines.append(f"| `{method.name}` | `{req}` | `{stream}{resp}` | {_cell(what)} |")
        lines.append("")
    for path, message, name in _messages(proto.message_type, (_MESSAGE,), ""):
        lines += [f"## message {name}", "", _comment(comments, path, name, missing), ""]
        if message.field:
            lines += ["| field | type | what |", "|---|---|---|"]
            for f, field in enumerate(message.field):
                what = _comment(comments, (*path, _FIELD, f), f"{name}.{field.name}", missing)
                lines.append(f"| `{field.name}` | `{_type(field)}` | {_cell(what)} |")
            lines.append("")
        for e, nested in enumerate(message.enum_type):
            lines += _enum(nested, (*path, _NESTED_ENUM, e), f"{name}.{nested.name}", comments, missing)
    for e, top in enumerate(proto.enum_type):
        lines += _enum(top, (_ENUM, e), top.name, comments, missing)
    if missing:  # every service, method, message, field, enum and value says what it is
        raise PluginError(f"proto elements without a comment in proto/{PROTO}: {', '.join(missing)}")
    return "\n".join(lines) + "\n"


def _messages(
    messages: Any, prefix: tuple[int, ...], outer: str
) -> Iterator[tuple[tuple[int, ...], descriptor_pb2.DescriptorProto, str]]:
    for i, message in enumerate(messages):
        if message.options.map_entry:
            continue
        path, name = (*prefix, i), f"{outer}{message.name}"
        yield path, message, name
        yield from _messages(message.nested_type, (*path, _NESTED), f"{name}.")


def _type(field: descriptor_pb2.FieldDescriptorProto) -> str:
    if field.type_name:
        kind = field.type_name.rsplit(".", 1)[-1]
    else:
        kind = descriptor_pb2.FieldDescriptorProto.Type.Name(field.type)[len("TYPE_") :].lower()
    repeated = field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    return f"repeated {kind}" if repeated else kind


def _enum(
    values: descriptor_pb2.EnumDescriptorProto,
    path: tuple[int, ...],
    name: str,
    comments: dict[tuple[int, ...], str],
    missing: list[str],
) -> list[str]:
    lines = [f"## enum {name}", "", _comment(comments, path, name, missing), "", "| value | what |", "|---|---|"]
    for v, value in enumerate(values.value):
        what = _comment(comments, (*path, _VALUE, v), f"{name}.{value.name}", missing)
        lines.append(f"| `{value.name}` | {_cell(what)} |")
    return [*lines, ""]


def config_reference() -> str:
    """The configuration reference page, from the settings model's fields and their docstrings, in
    the tables a file writes them in (rcoder.config_groups)."""
    from rcoder.config import (
        FILE_ONLY,
        BudgetKeys,
        PermissionRule,
        ProfileBudgetKeys,
        ProfileKeys,
        SettingsKeys,
        key_descriptions,
    )
    from rcoder.config_groups import GROUPED_NAME, GROUPS, TABLE_OF

    missing: list[str] = []
    lines = [
        "# Configuration reference",
        "",
        "Generated from the settings model (`rcoder/config.py`) and its tables (`rcoder/config_groups.py`) by",
        "`make docs-reference`: every key, its type, its default and its description. The settings are also",
        "read from the `RCODER_<NAME>` variable each row names (see [Configuration](configuration.md) for the",
        "order in which file, variables and flags apply).",
        "",
    ]
    top = [key for key in SettingsKeys.model_fields if key not in TABLE_OF]
    # (title, model, [(key as written, field's name)], with variables)
    sections: list[tuple[str, type[BaseModel], list[tuple[str, str]], bool]] = [
        ("Top-level keys", SettingsKeys, [(key, key) for key in top], True),
        *((f"`[{table}]` keys", SettingsKeys, list(keys.items()), True) for table, keys in GROUPS.items()),
        *(
            (title, model, [(key, key) for key in model.model_fields], False)
            for title, model in (
                ("`[agents.<name>]` keys", ProfileKeys),
                ("`permission_rules` entries", PermissionRule),
                ("`[budgets]` keys", BudgetKeys),
                ("`[agents.<name>.budgets]` keys", ProfileBudgetKeys),
            )
        ),
    ]
    for title, model, keys, env in sections:
        lines += [f"## {title}", "", "| key | type | default | variable | description |", "|---|---|---|---|---|"]
        descriptions = key_descriptions(model)
        for written, name in keys:
            field = model.model_fields[name]
            description = descriptions.get(name, "")
            if not description:
                missing.append(f"{model.__name__}.{name}")
            value = None if field.is_required() else field.get_default(call_default_factory=True)
            default = "required" if field.is_required() else f"`{_default(value)}`"
            if isinstance(value, BaseModel):  # a table of its own: its keys are listed below
                default = "its keys' defaults"
            elif value is None and not field.is_required():
                default = "unset"
            variable = f"`RCODER_{name.upper()}`" if env and name not in FILE_ONLY else "—"
            kind = _cell(_type_name(field.annotation))
            described = _cell(_prose(" ".join(description.split())))
            lines.append(f"| `{written}` | `{kind}` | {_cell(default)} | {variable} | {described} |")
        lines.append("")
    lines += [
        "## Flat names, read until the next release",
        "",
        "Before the tables, every setting was a top-level key named as its variable is. A file that still",
        "writes one is read as before, and the daemon says so at start (`config_key_deprecated`); a setting",
        "written both ways is refused.",
        "",
        "| flat name | now |",
        "|---|---|",
        *(f"| `{flat}` | `{grouped}` |" for flat, grouped in GROUPED_NAME.items()),
        "",
    ]
    if missing:
        raise PluginError(f"config keys without a description (a docstring under the key): {', '.join(missing)}")
    return "\n".join(lines) + "\n"


def _type_name(annotation: Any) -> str:
    """A key's type as a reader writes it in TOML terms: str, float, list[str], "a" | "b"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(arg).replace("'", '"') for arg in args)
    if type(None) in args:  # an optional key (X | None): unset is a value of its own, not one TOML writes
        return " | ".join(_type_name(arg) for arg in args if arg is not type(None))
    if origin is tuple:
        return f"list[{_type_name(args[0])}]"
    if origin is not None and args:  # Mapping[K, V] and the like: a TOML table
        return f"table[{', '.join(_type_name(arg) for arg in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    if isinstance(annotation, type):
        return {"Path": "path", "ResumeRoute": "str"}.get(annotation.__name__, annotation.__name__)
    return str(annotation)


def _default(value: object) -> str:
    """A default as TOML would write it."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple):
        return "[" + ", ".join(_default(item) for item in value) + "]"
    if isinstance(value, Path | str):
        return '"' + str(value) + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{key} = {_default(item)}" for key, item in value.items()) + " }"
    return repr(value)


def front_page() -> str:
    """README.md as the site's index: its links into docs/ made relative to the site."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text())


_MARKDOWN: dict[str, str] = {}  # each page's Markdown as read, by the page it is built into


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    _MARKDOWN[page.file.dest_uri] = markdown
    return markdown


MERMAID = ROOT / "build" / "vendor" / "mermaid.min.js"  # the Makefile's, from npm (`make docs`)
MERMAID_SERVED = "assets/javascripts/mermaid.min.js"  # mkdocs.yml's extra_javascript


def on_post_build(config: MkDocsConfig) -> None:
    """mermaid's script copied into the site, which serves it itself; then the built pages against
    their Markdown (scripts/docs_site_check.py): a word lost, a table broken or a resource from
    another site fails the build."""
    if not MERMAID.exists():
        raise PluginError(f"{MERMAID.relative_to(ROOT)} is missing: `make docs` fetches it (the diagrams' script)")
    served = Path(config.site_dir) / MERMAID_SERVED
    served.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(MERMAID, served)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_site_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    found = []
    for dest, markdown in sorted(_MARKDOWN.items()):
        page_html = (Path(config.site_dir) / dest).read_text()
        found += [f"{dest}: {problem}" for problem in docs_site_check.problems(markdown, page_html)]
    if found:
        raise PluginError("the site does not say what the Markdown says:\n" + "\n".join(found))


GENERATED = {"api-reference.md": api_reference, "config-reference.md": config_reference}


def write_references() -> None:
    """``make docs-reference``: the generated pages written into docs/, to be committed with the
    proto or the settings model they come from."""
    for name, make in GENERATED.items():
        (ROOT / "docs" / name).write_text(make())


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """The front page made from README.md; the generated pages, kept in git so that they read on a
    forge and in a clone too, checked to be what the proto and the model make now."""
    stale = [name for name, make in GENERATED.items() if (ROOT / "docs" / name).read_text() != make()]
    if stale:
        raise PluginError(
            f"{', '.join('docs/' + name for name in stale)} not up to date with the proto and the settings model: "
            "`make docs-reference` writes them (commit them with the change)"
        )
    files.append(File.generated(config, "index.md", content=front_page()))
    return files


if __name__ == "__main__":
    write_references()
