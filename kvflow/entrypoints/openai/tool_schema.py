"""The JSON schema that enforces `tool_choice="required"` or a named function: built from the
tools' parameter schemas, as vLLM builds it."""
from __future__ import annotations

import copy
from typing import Any

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return copy.deepcopy(params) if params else dict(EMPTY_PARAMETERS)


def named_tool_schema(tools: list[dict], name: str) -> dict:
    """A named `tool_choice`: the output is that function's arguments."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return _parameters(tool)
    raise ValueError(f"tool_choice: no tool named {name!r} in tools "
                     f"({', '.join(repr(t['function']['name']) for t in tools)})")


def required_tools_schema(tools: list[dict], parallel_tool_calls: bool = True) -> dict:
    """`tool_choice="required"`: a JSON array of `{"name", "arguments"}` with at least one call
    (exactly one without `parallel_tool_calls`), each call one of the tools. Each tool's `$defs`
    move to the top, where their `#/$defs/...` references point."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        params = _parameters(tool)
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"tools: two tools define $defs {key!r} differently; give "
                                 "their definitions distinct names")
            defs[key] = value
        variants.append({"properties": {"name": {"type": "string",
                                                 "enum": [tool["function"]["name"]]},
                                        "arguments": params},
                         "required": ["name", "arguments"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
