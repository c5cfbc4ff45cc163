"""Bounds on what a JSON schema leaves open, so a grammar built from it always ends.

A tool's schema may leave room for endless output: extra properties allowed (`additionalProperties`
true or absent) with keys of any length and values of any shape, strings without `maxLength`,
arrays without `maxItems`, numbers with any number of digits. A model constrained by such a
grammar can write one property name until `max_tokens`. `bounded_schema` closes each of those
openings, keeping every output it allows valid against the original schema:

- extra properties: at most `SchemaBounds.extra_properties` of them, each key a JSON string of at
  most `key_length` characters (a `patternProperties` entry, as llguidance has no `propertyNames`),
  each value a scalar (string of at most `key_length` characters, number, boolean or null); none
  in an object with optional properties (llguidance counts properties only where all are required);
- strings without `maxLength`: at most `string_length` characters;
- arrays without `maxItems`: at most `items` items;
- integers and numbers without a range: within +-`integer_limit`; numbers without `multipleOf`:
  at most `fraction_digits` digits after the point.

`fitting_bounds` picks the largest of these bounds (halving from `SchemaBounds()`) under which the
longest output the bounded schemas allow fits a budget of characters, so the calls of a reply end
within its `max_tokens` whenever the model writes at least one character per token.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["SchemaBounds", "bounded_schema", "fitting_bounds", "longest_output"]


@dataclasses.dataclass(frozen=True)
class SchemaBounds:
    """The bounds put where a schema leaves its output open (see the module's docstring)."""

    key_length: int = 32
    extra_properties: int = 4
    string_length: int = 4096
    items: int = 16
    integer_limit: int = 2**53 - 1  # the largest integer a JSON reader keeps exactly
    fraction_digits: int = 6

    def halved(self) -> SchemaBounds | None:
        """The next smaller bounds, or None at the smallest."""
        smaller = dataclasses.replace(self, key_length=max(8, self.key_length // 2),
                                      extra_properties=self.extra_properties // 2,
                                      string_length=max(8, self.string_length // 2), items=max(1, self.items // 2))
        return None if smaller == self else smaller


_NESTED_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_NESTED_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref", "not", "if")


def _types(schema: dict[str, Any]) -> set[str] | None:
    kind = schema.get("type")
    if kind is None:
        return None
    return {kind} if isinstance(kind, str) else set(kind)


def _any_value(bounds: SchemaBounds) -> dict[str, Any]:
    """A bounded value for an extra property: a short string, a number, a boolean or null."""
    return {"type": ["string", "number", "boolean", "null"], "maxLength": bounds.key_length,
            **_number_bounds({}, bounds)}


def _number_bounds(schema: dict[str, Any], bounds: SchemaBounds, integer: bool = False) -> dict[str, Any]:
    added: dict[str, Any] = {}
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        added["minimum"] = -bounds.integer_limit
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        added["maximum"] = bounds.integer_limit
    if not integer and "multipleOf" not in schema:
        added["multipleOf"] = 10.0 ** -bounds.fraction_digits
    return added


def bounded_schema(schema: Any, bounds: SchemaBounds = SchemaBounds()) -> Any:
    """`schema` with every opening bounded (see the module's docstring); a schema that is not an
    object (`false`) is returned as it is."""
    if schema is True:
        return _any_value(bounds)
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _NESTED_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_schema(s, bounds) for s in out[key]]
    for key in _NESTED_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_schema(s, bounds) for name, s in out[key].items()}
    if "items" in out:
        out["items"] = bounded_schema(out["items"], bounds)
    if "enum" in out or "const" in out:
        return out
    types = _types(out)
    if types is None:
        if any(key in out for key in _COMBINATORS):
            return out
        if not any(key in out for key in ("properties", "items", "required")):
            return {**out, **_any_value(bounds)}  # no constraint at all: any value
        types = {"object"} if "items" not in out else {"array"}
    if "object" in types:
        out.update(_object_bounds(out, bounds))
    if "array" in types:
        out["maxItems"] = min(out.get("maxItems", bounds.items), max(bounds.items, out.get("minItems", 0)))
        out.setdefault("items", _any_value(bounds))
    if "string" in types and "maxLength" not in out:
        out["maxLength"] = max(bounds.string_length, out.get("minLength", 0))
    if types & {"number", "integer"}:
        out.update(_number_bounds(out, bounds, integer="number" not in types))
    return out


def _object_bounds(schema: dict[str, Any], bounds: SchemaBounds) -> dict[str, Any]:
    """The keys that bound an object schema's extra properties (a required key that `properties`
    does not declare is declared, with the extra properties' value). llguidance bounds the number
    of properties only where every declared one is required: an object with optional properties
    gets none beyond them."""
    extra = schema.get("additionalProperties", True)
    if extra is False:
        return {}
    value = _any_value(bounds) if extra is True else bounded_schema(extra, bounds)
    properties = dict(schema.get("properties", {}))
    for name in schema.get("required", []):
        properties.setdefault(name, value)
    if not bounds.extra_properties or set(properties) - set(schema.get("required", [])):
        return {"properties": properties, "additionalProperties": False}
    most = len(properties) + bounds.extra_properties
    added: dict[str, Any] = {"properties": properties,
                             "maxProperties": max(min(schema.get("maxProperties", most), most),
                                                  schema.get("minProperties", 0))}
    if "patternProperties" in schema:
        added["additionalProperties"] = False
    else:
        key = f'^[^"\\\\\\x00-\\x1f]{{1,{bounds.key_length}}}$'
        added["patternProperties"] = {key: value}
        added["additionalProperties"] = False
    return added


def longest_output(schema: Any) -> int | None:
    """The most characters of compact JSON a bounded schema allows (escapes aside), or None where
    that is not known (references, intersections, negations, patterns without a length)."""
    if not isinstance(schema, dict) or any(key in schema for key in ("$ref", "allOf", "not", "if")):
        return None
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return max((len(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) for v in values), default=0)
    branches = schema.get("anyOf", schema.get("oneOf"))
    if branches is not None:
        lengths = [longest_output(b) for b in branches]
        return None if None in lengths or not lengths else max(lengths)  # type: ignore[type-var]
    lengths = [_longest_of_type(schema, kind) for kind in sorted(_types(schema) or ())]
    return None if None in lengths or not lengths else max(lengths)  # type: ignore[type-var]


def _longest_of_type(schema: dict[str, Any], kind: str) -> int | None:
    if kind == "string":
        return 2 + schema["maxLength"] if "maxLength" in schema else None
    if kind in ("integer", "number"):
        ends = [abs(schema.get(k, 0)) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")]
        digits = len(str(int(max(ends)))) + 1  # the sign
        step = schema.get("multipleOf")
        fraction = 0 if kind == "integer" or step is None else len(f"{step:.12f}".rstrip("0").partition(".")[2])
        return digits + (fraction + 1 if fraction else 0) if ("multipleOf" in schema or kind == "integer") else None
    if kind in ("boolean", "null"):
        return 5 if kind == "boolean" else 4
    if kind == "array":
        return _longest_array(schema)
    if kind == "object":
        return _longest_object(schema)
    return None


def _longest_array(schema: dict[str, Any]) -> int | None:
    if "maxItems" not in schema:
        return None
    prefix = [longest_output(s) for s in schema.get("prefixItems", [])]
    rest = schema["maxItems"] - len(prefix)
    item = longest_output(schema.get("items", False)) if rest > 0 else 0
    if None in prefix or item is None:
        return None
    return 2 + sum(p + 1 for p in prefix) + max(rest, 0) * (item + 1)  # type: ignore[operator]


def _longest_object(schema: dict[str, Any]) -> int | None:
    entries = []
    for name, value in schema.get("properties", {}).items():
        length = longest_output(value)
        if length is None:
            return None
        entries.append(len(json.dumps(name, ensure_ascii=False)) + 2 + length)  # key, colon, comma
    for pattern, value in schema.get("patternProperties", {}).items():
        length, key = longest_output(value), _pattern_length(pattern)
        if length is None or key is None:
            return None
        entries += [key + 2 + 2 + length] * max(0, schema.get("maxProperties", 0) - len(entries))
    if schema.get("additionalProperties", True) is not False:
        return None
    entries.sort(reverse=True)
    return 2 + sum(entries[:schema.get("maxProperties", len(entries))])


def _pattern_length(pattern: str) -> int | None:
    """The longest key `bounded_schema`'s key pattern allows (None for a pattern of the user's)."""
    head, _, tail = pattern.rpartition(",")
    if not head.startswith('^[^"') or not tail.endswith("}$") or not tail[:-2].isdigit():
        return None
    return int(tail[:-2])


def fitting_bounds(schemas: Sequence[Any], budget: int, calls: int = 1) -> SchemaBounds:
    """The largest bounds (from `SchemaBounds()`, halving) under which `calls` outputs of the longest
    of `schemas` fit in `budget` characters; the smallest bounds when none fits or a length is not
    known."""
    bounds: SchemaBounds | None = SchemaBounds()
    chosen = SchemaBounds()
    while bounds is not None:
        chosen = bounds
        lengths = [longest_output(bounded_schema(s, bounds)) for s in schemas]
        if None in lengths:
            return chosen
        if calls * max(lengths, default=0) <= budget:  # type: ignore[type-var]
            return chosen
        bounds = bounds.halved()
    return chosen
