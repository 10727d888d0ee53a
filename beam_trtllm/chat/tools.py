"""Tool declarations and argument typing: raw parameter text -> the tool's JSON-schema types
(shared/research/beam-response-format.md §5: integer, number, boolean, null, object/array via
JSON, else string; undeclared keys and failed casts stay strings)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .errors import ChatRequestError

TOOL_NAME = re.compile(r"[^\s<]+")
PARAM_NAME = re.compile(r'[^"\n<>]+')


def tool_schemas(tools: Any) -> dict[str, dict]:
    """{name: parameters schema} of the request's `tools`; ChatRequestError names a bad one."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list", param="tools")
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ChatRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                                   param=f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ChatRequestError(f"tools[{i}].function.name {name!r} cannot be encoded in a Beam "
                                   "tool call (it must be non-empty, without whitespace or '<')",
                                   param=f"tools[{i}].function.name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ChatRequestError(f"tools[{i}].function.parameters must be a JSON schema object",
                                   param=f"tools[{i}].function.parameters")
        for key in (params.get("properties") or {}):
            if not PARAM_NAME.fullmatch(key):
                raise ChatRequestError(f"tools[{i}] parameter name {key!r} cannot be encoded in a "
                                       "Beam tool call", param=f"tools[{i}].function.parameters")
        out[name] = params
    return out


def declared_types(schema: dict) -> list[str]:
    """The JSON types a property schema allows, in order (type, anyOf/oneOf, nullable)."""
    types: list[str] = []
    t = schema.get("type")
    if isinstance(t, str):
        types.append(t)
    elif isinstance(t, list):
        types += [x for x in t if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            if isinstance(sub, dict):
                types += [x for x in declared_types(sub) if x not in types]
    if schema.get("nullable") and "null" not in types:
        types.append("null")
    if not types and "enum" in schema:
        types = sorted({_json_type(v) for v in schema["enum"]})
    return types


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), "string")


_NO_CAST = object()


def _cast(text: str, typ: str) -> Any:
    s = text.strip()
    if typ == "integer":
        try:
            return int(s)
        except ValueError:
            f = _cast(s, "number")
            return int(f) if isinstance(f, float) and f.is_integer() else _NO_CAST
    if typ == "number":
        try:
            f = float(s)
        except ValueError:
            return _NO_CAST
        if not math.isfinite(f):
            return _NO_CAST
        return int(s) if "." not in s and "e" not in s.lower() and _is_int(s) else f
    if typ == "boolean":
        low = s.lower()
        return True if low in ("true", "1") else False if low in ("false", "0") else _NO_CAST
    if typ == "null":
        return None if s in ("null", "None") else _NO_CAST
    if typ in ("object", "array"):
        try:
            v = json.loads(s)
        except json.JSONDecodeError:
            return _NO_CAST
        return v if isinstance(v, dict if typ == "object" else list) else _NO_CAST
    return _NO_CAST


def _is_int(s: str) -> bool:
    try:
        int(s)
        return True
    except ValueError:
        return False


def coerce_arguments(raw: dict[str, str], schema: dict | None) -> dict[str, Any]:
    """Cast each raw value through its declared types in order; a value whose types include
    `string` is cast only when it is exactly the JSON of another declared type."""
    props = (schema or {}).get("properties") or {}
    out: dict[str, Any] = {}
    for key, text in raw.items():
        prop = props.get(key)
        if not isinstance(prop, dict):
            out[key] = text
            continue
        types = declared_types(prop)
        value: Any = text
        for typ in types:
            if typ == "string":
                continue
            cast = _cast(text, typ)
            if cast is _NO_CAST:
                continue
            if "string" in types and json.dumps(cast) != text.strip():
                continue
            value = cast
            break
        out[key] = value
    return out
