"""A strict checker for Kubernetes structural OpenAPI v3 schemas (what the API server applies).

Stricter than the server in one way on purpose: an unknown field is an error (the server
would prune it silently, and the manifest would not mean what it says). CEL rules
(x-kubernetes-validations) are not evaluated here; tests check the ones that apply.
"""

import re


def validate(value, schema, path="$"):
    """Every violation as 'path: message'; empty when `value` conforms."""
    errors = []
    _check(value, schema, path, errors)
    return errors


def _check(value, schema, path, errors):
    if schema.get("x-kubernetes-int-or-string"):
        if not (isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))):
            errors.append(f"{path}: must be an integer or a string, got {value!r}")
        elif isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
        return
    if "anyOf" in schema and "type" not in schema:
        if all(validate(value, alt, path) for alt in schema["anyOf"]):
            errors.append(f"{path}: matches none of anyOf")
        return
    kind = schema.get("type")
    checker = _TYPES.get(kind)
    if checker is None:
        if not schema.get("x-kubernetes-preserve-unknown-fields") and kind is not None:
            errors.append(f"{path}: unsupported schema type {kind}")
        return
    if not checker(value):
        errors.append(f"{path}: must be {kind}, got {type(value).__name__} {value!r}"[:300])
        return
    if kind == "object":
        _check_object(value, schema, path, errors)
    elif kind == "array":
        _check_array(value, schema, path, errors)
    else:
        _check_scalar(value, schema, path, errors)


def _check_object(value, schema, path, errors):
    props = schema.get("properties")
    for key in schema.get("required", []):
        if key not in value:
            errors.append(f"{path}: missing required field {key}")
    for key, item in value.items():
        sub = f"{path}.{key}"
        if props is not None and key in props:
            _check(item, props[key], sub, errors)
        elif isinstance(schema.get("additionalProperties"), dict):
            _check(item, schema["additionalProperties"], sub, errors)
        elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
            errors.append(f"{sub}: unknown field")


def _check_array(value, schema, path, errors):
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{path}: more than {schema['maxItems']} items")
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(f"{path}: fewer than {schema['minItems']} items")
    for i, item in enumerate(value):
        _check(item, schema.get("items", {}), f"{path}[{i}]", errors)


def _check_scalar(value, schema, path, errors):
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']}")
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: shorter than {schema['minLength']}")
    elif "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} < minimum {schema['minimum']}")
    elif "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: {value} > maximum {schema['maximum']}")


_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}
