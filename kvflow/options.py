"""Engine options generated from the config dataclasses (vLLM's EngineArgs pattern, small).

Every field declared with `kvflow.config.option` is one option: its flat name is an `LLM(...)`
keyword and a `--flag` of every command that builds an engine, with the field's type, default,
choices and help; the options table of docs/configuration.md is rendered from the same fields. Adding an
option is adding a field."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any

from kvflow.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, MultiModalConfig,
                           ParallelConfig, SchedulerConfig)

# EngineConfig's sub-configs, by the field that holds each; None: EngineConfig's own fields
SECTIONS: dict[str | None, type] = {
    "model_config": ModelConfig, "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig, "parallel_config": ParallelConfig,
    "lora_config": LoRAConfig, "multimodal_config": MultiModalConfig, None: EngineConfig,
}


@dataclass(frozen=True)
class Option:
    name: str  # flat name: LLM keyword, and --name-with-dashes
    section: str | None  # the EngineConfig field holding its dataclass; None: EngineConfig's own
    field: str  # the dataclass field
    type: type  # int | float | str | bool, or list (of str)
    optional: bool  # None is a valid value (and means "not given")
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    short: str | None = None
    cli_default: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _scalar_type(hint: Any) -> tuple[type, bool]:
    """(the value's type, whether None is allowed) from a field's annotation."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [a for a in args if a is not type(None)]
        optional = len(kinds) < len(args)
        # `int | str` (a memory size, a count or "4GiB") is read as text from the command line
        base = kinds[0] if len(kinds) == 1 else str
        t, _ = _scalar_type(base)
        return t, optional
    if typing.get_origin(hint) is list:
        return list, False
    return hint, False


def fields_as_options(cls: type, section: str | None = None) -> list[Option]:
    """The `option` fields of one dataclass."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        t, optional = _scalar_type(hints[f.name])
        m = f.metadata
        out.append(Option(m["name"] or f.name, section, f.name, t, optional, f.default, m["help"],
                          m["choices"], m["short"], m["cli_default"]))
    return out


def _collect() -> dict[str, Option]:
    opts = {}
    for section, cls in SECTIONS.items():
        for o in fields_as_options(cls, section):
            assert o.name not in opts, f"option {o.name} declared twice"
            opts[o.name] = o
    return opts


OPTIONS: dict[str, Option] = _collect()


def unknown_option_error(name: str, valid: typing.Iterable[str], what: str = "option") -> TypeError:
    """TypeError naming the unknown keyword and the closest valid one."""
    valid = sorted(valid)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid {what}s: {', '.join(valid)}"
    return TypeError(f"unknown {what} {name!r}{hint}")


def engine_config(**options: Any) -> EngineConfig:
    """The EngineConfig of flat options (LLM's keyword arguments, the CLI's flags); an unknown
    name is a TypeError naming the closest valid one, a bad value a ValueError from the
    dataclass that owns it."""
    per_section: dict[str | None, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in options.items():
        o = OPTIONS.get(name)
        if o is None:
            raise unknown_option_error(name, OPTIONS)
        per_section[o.section][o.field] = value
    subs = {s: cls(**per_section[s]) for s, cls in SECTIONS.items() if s is not None}
    return EngineConfig(**subs, **per_section[None])


def add_option_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                    options: typing.Iterable[Option],
                    defaults: dict[str, Any] | None = None) -> None:
    """One flag per option; `defaults` overrides a default for this command."""
    defaults = defaults or {}
    for o in options:
        names = [o.flag] + ([o.short] if o.short else [])
        default = defaults.get(o.name, o.default)
        help_text = o.help + ("" if default is None else f" (default: {default})")
        kw: dict[str, Any] = dict(default=default, help=help_text, dest=o.name)
        if o.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif o.type is list:
            kw["nargs"] = "+"
        else:
            kw["type"] = o.type
            if o.choices:
                kw["choices"] = list(o.choices)
        parser.add_argument(*names, **kw)


def add_engine_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Every engine option as a flag, grouped by config; keyword arguments override defaults
    for this command (e.g. the server's smaller token budget)."""
    for name in defaults:
        if name not in OPTIONS:
            raise unknown_option_error(name, OPTIONS)
    titles = {"model_config": "model", "cache_config": "KV cache", "scheduler_config": "scheduler",
              "parallel_config": "tensor parallelism (docs/tensor_parallel.md)",
              "lora_config": "LoRA adapters (docs/lora.md)",
              "multimodal_config": "images in (docs/multimodal.md)", None: "engine"}
    for section in SECTIONS:
        group = parser.add_argument_group(titles[section])
        add_option_args(group, [o for o in OPTIONS.values() if o.section == section], defaults)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options of parsed arguments, as LLM / engine_config keywords."""
    return {name: getattr(args, name) for name in OPTIONS if hasattr(args, name)}


def markdown_table() -> str:
    """The options table of docs/configuration.md."""
    rows = ["| option | flag | default | meaning |", "|---|---|---|---|"]
    for o in OPTIONS.values():
        if o.cli_default is not None:
            default = o.cli_default
        elif o.default is None:
            default = "none"
        elif o.type is bool:
            default = "on" if o.default else "off"
        else:
            default = f"`{o.default}`"
        flag = f"`{o.flag}`" + (f" / `{o.short}`" if o.short else "")
        choices = f" (one of {', '.join(o.choices)})" if o.choices else ""
        meaning = o.help + choices
        rows.append(f"| `{o.name}` | {flag} | {default} | {meaning} |")
    return "\n".join(rows)


DOCS_PAGE = "docs/configuration.md"  # the page that holds the table, from the repository root
TABLE_BEGIN = "<!-- options table: generated by `python -m kvflow.options`; do not edit -->"
TABLE_END = "<!-- end of options table -->"


def render_table_into(text: str) -> str:
    """A page's text with the options table between its markers replaced by the generated one."""
    head, sep, rest = text.partition(TABLE_BEGIN)
    _, sep2, tail = rest.partition(TABLE_END)
    if not sep or not sep2:
        raise ValueError(f"{DOCS_PAGE} lacks the options table's markers")
    return f"{head}{TABLE_BEGIN}\n{markdown_table()}\n{TABLE_END}{tail}"


if __name__ == "__main__":  # python -m kvflow.options [PAGE]: rewrite the options table of the page
    import sys

    path = sys.argv[1] if len(sys.argv) > 1 else DOCS_PAGE
    with open(path) as f:
        text = f.read()
    new = render_table_into(text)  # before opening for writing: a page without markers stays whole
    with open(path, "w") as f:
        f.write(new)
