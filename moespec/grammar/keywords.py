"""Which JSON-schema keywords an engine enforces exactly, and where a schema uses one it does not.

A schema is served only when every output its grammar allows validates against the schema. An
engine that ignores a keyword, or approximates it by something looser, would let invalid
output through, so such a schema is refused with the keyword and its JSON path
(`keyword 'oneOf' at $.properties.x is not enforced by xgrammar`). Restricting more than the
schema does (xgrammar's strict mode closes objects without `additionalProperties`; both engines
anchor `pattern`) keeps every output valid and is allowed.

xgrammar 0.2.9, measured on schemas with an instance the grammar should refuse
(tests/test_structured_backends.py): it ignores `not`, `if`/`then`/`else`, `dependentRequired`,
`dependencies`, `dependentSchemas`, `uniqueItems`, `contains`, unknown `format`s, `multipleOf` on
numbers, `minLength`/`maxLength` beside `pattern` or `format`, bounds beside `multipleOf`,
the keywords beside `enum`/`const`, `anyOf` or `$ref`, string/number/array keywords
in a schema without `type`, and `required` names missing from `properties`; it treats `oneOf`
as `anyOf` and `allOf` of several schemas as one of them; it compiles some `pattern` shapes
loosely (grammar/patterns.py). Those are refused here.
llguidance refuses what it does not implement itself (strict mode: "Unimplemented keys",
"oneOf constraints are not supported", "Unknown format"); `locate` finds the keyword's path.

Both engines let a key repeat in an object whose keys the schema does not all name
(`{"a": 1, "a": 2}`), and count each repeat toward `minProperties`; a parser keeps one, so
`minProperties` beyond the `required` names is refused where such keys are allowed.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import unquote

from moespec.grammar.patterns import loose_in_xgrammar

# every keyword of drafts 4 to 2020-12 that can make an instance invalid
VALIDATION = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "items", "additionalItems", "prefixItems", "contains",
    "minContains", "maxContains", "maxItems", "minItems", "uniqueItems", "maxProperties", "minProperties",
    "required", "properties", "patternProperties", "additionalProperties", "dependencies", "dependentRequired",
    "dependentSchemas", "propertyNames", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf",
    "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef"})
XGRAMMAR_EXACT = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "items", "prefixItems", "maxItems", "minItems",
    "maxProperties", "minProperties", "required", "properties", "patternProperties", "additionalProperties",
    "propertyNames", "unevaluatedProperties", "anyOf", "$ref"})
XGRAMMAR_FORMATS = frozenset({
    "email", "date", "date-time", "time", "duration", "uri", "uri-reference", "uri-template", "uuid", "ipv4",
    "ipv6", "hostname", "json-pointer", "relative-json-pointer"})
TYPED = {  # keywords xgrammar applies only where `type` names their type
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
    "multipleOf": "number", "minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
    "minItems": "array", "maxItems": "array", "minProperties": "object", "maxProperties": "object"}
COMBINED = [  # xgrammar keeps the first keyword and drops the others beside it
    ("pattern", ("minLength", "maxLength", "format")), ("format", ("minLength", "maxLength")),
    ("multipleOf", ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))]
PYTHON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
                "null": (type(None),), "array": (list,), "object": (dict,)}
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
                 "else", "unevaluatedItems", "unevaluatedProperties")


class Refusal(ValueError):
    """A schema keyword the engine would not enforce exactly."""

    def __init__(self, keyword: str, path: str, engine: str, why: str = "") -> None:
        super().__init__(f"keyword {keyword!r} at {path} is not enforced by {engine}" + (f" ({why})" if why else ""))
        self.keyword, self.path = keyword, path


def step(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_$][\w$-]*", key) else f"{path}[{key!r}]"


def children(schema: dict, path: str) -> Iterator[tuple[str, object]]:
    """The subschemas written inside `schema`, with their paths ($defs only through a $ref)."""
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict) and key not in ("$defs", "definitions"):
            for name, sub in schema[key].items():
                yield step(step(path, key), name), sub
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield step(step(path, key), i), sub
    for key in SCHEMA_VALUES:
        if key in schema:
            yield step(path, key), schema[key]
    items = schema.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield step(step(path, "items"), i), sub
    elif items is not None:
        yield step(path, "items"), items
    if isinstance(schema.get("dependencies"), dict):
        for name, sub in schema["dependencies"].items():
            if not isinstance(sub, list):
                yield step(step(path, "dependencies"), name), sub


def resolve(root: object, ref: str) -> tuple[str, object] | None:
    """The path and schema a local `$ref` (#/a/b) points to, or None."""
    if ref == "#":
        return "$", root
    if not ref.startswith("#/"):
        return None
    node, path = root, "$"
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node, path = node[int(part)], step(path, int(part))
        elif isinstance(node, dict) and part in node:
            node, path = node[part], step(path, part)
        else:
            return None
    return path, node


def walk(root: object) -> Iterator[tuple[str, dict]]:
    """Every object subschema reachable from the root (through local $refs once), with its path."""
    seen: set[int] = set()
    stack = [("$", root)]
    while stack:
        path, schema = stack.pop()
        if not isinstance(schema, dict) or id(schema) in seen:
            continue
        seen.add(id(schema))
        yield path, schema
        found = resolve(root, schema["$ref"]) if isinstance(schema.get("$ref"), str) else None
        if found is not None:
            stack.append(found)
        stack.extend(reversed(list(children(schema, path))))


def check(engine: str, root: object) -> None:
    """Raises Refusal at the first keyword `engine` (xgrammar or llguidance) would not enforce
    exactly that this module finds; llguidance refuses the rest itself."""
    for path, schema in walk(root):
        gaps = xgrammar_gaps(root, schema) if engine == "xgrammar" else object_gaps(schema, closed=False)
        for keyword, why in gaps:
            raise Refusal(keyword, path, engine, why)


def object_gaps(schema: dict, closed: bool) -> Iterator[tuple[str, str]]:
    """minProperties where a key may repeat: keys the schema does not name are allowed (objects
    without `additionalProperties` are `closed` or not, as the engine makes them) and the
    `required` names alone do not reach it."""
    extra = schema.get("additionalProperties", not closed)
    free = extra is not False or "patternProperties" in schema or "propertyNames" in schema
    if free and schema.get("unevaluatedProperties") is not False:
        wanted = schema.get("minProperties", 0)
        if isinstance(wanted, (int, float)) and wanted > len(set(schema.get("required", ()))):
            yield "minProperties", "beside keys the schema does not name, which may repeat"


def xgrammar_gaps(root: object, schema: dict) -> Iterator[tuple[str, str]]:
    """(keyword, why) for each keyword of one subschema that xgrammar would not enforce exactly."""
    used = [k for k in schema if k in VALIDATION]
    for keyword in used:
        if keyword not in XGRAMMAR_EXACT:
            yield keyword, ""
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    for keyword in used:
        kind = TYPED.get(keyword)
        if kind and not (types & ({kind, "integer"} if kind == "number" else {kind})):
            yield keyword, "without a 'type' that it applies to"
    loose = loose_in_xgrammar(schema["pattern"]) if isinstance(schema.get("pattern"), str) else None
    if loose:
        yield "pattern", loose
    yield from object_gaps(schema, closed=True)
    if "format" in schema and schema["format"] not in XGRAMMAR_FORMATS:
        yield "format", f"unknown format {schema['format']!r}"
    if "multipleOf" in schema and (types != {"integer"} or not isinstance(schema["multipleOf"], int)):
        yield "multipleOf", "only on integers"
    for keyword, others in COMBINED:
        beside = [k for k in others if k in schema]
        if keyword in schema and beside:
            yield beside[0], f"beside {keyword!r}"
    if schema.get("unevaluatedProperties", False) is not False:
        yield "unevaluatedProperties", "only false"
    for keyword in ("anyOf", "$ref"):
        beside = [k for k in used if k != keyword]
        if keyword in schema and beside:
            yield keyword, f"beside {beside[0]!r}"
    if isinstance(schema.get("$ref"), str) and resolve(root, schema["$ref"]) is None:
        yield "$ref", f"{schema['$ref']!r} is not a local reference"
    yield from value_gaps(schema, used, types)
    missing = [name for name in schema.get("required", ()) if name not in schema.get("properties", {})]
    if missing:
        yield "required", f"{missing[0]!r} is not in 'properties'"


def value_gaps(schema: dict, used: list[str], types: set[str]) -> Iterator[tuple[str, str]]:
    """enum and const: xgrammar allows their values and ignores every keyword beside them."""
    for keyword in ("enum", "const"):
        if keyword not in schema:
            continue
        beside = [k for k in used if k not in ("enum", "const", "type")]
        if beside:
            yield keyword, f"beside {beside[0]!r}"
        values = schema[keyword] if keyword == "enum" and isinstance(schema[keyword], list) else [schema[keyword]]
        if types and not all(any(has_type(v, t) for t in types) for v in values):
            yield keyword, "a value is not of its 'type'"


def has_type(value: object, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, PYTHON_TYPES.get(name, ()))


LLGUIDANCE_ERRORS = [
    (re.compile(r'Unimplemented keys: \["([^"]+)"'), None),
    (re.compile(r"oneOf constraints are not supported"), "oneOf"),
    (re.compile(r"Unknown format: (\S+)"), "format"),
]


def llguidance_refusal(root: object, message: str) -> Refusal | None:
    """The keyword and path an llguidance error names, if it names a keyword."""
    for pattern, keyword in LLGUIDANCE_ERRORS:
        found = pattern.search(message)
        if found:
            keyword = keyword or found.group(1)
            return Refusal(keyword, locate(root, keyword) or "$", "llguidance")
    return None


def locate(root: object, keyword: str) -> str | None:
    """The path of the first reachable subschema that uses `keyword`."""
    return next((path for path, schema in walk(root) if keyword in schema), None)
