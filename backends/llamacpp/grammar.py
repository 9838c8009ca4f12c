"""Structured output on llama.cpp: an ``OutputConstraint`` as a GBNF grammar for llama.cpp's own
grammar sampler (``llama_sampler_init_grammar``), in the single session's sampler and in each
batched slot's sampler chain (batch.sampler_chain).

Each JSON Schema goes through llama-cpp-python's JSON-Schema-to-GBNF converter. That converter
ignores some keywords (number bounds, ``not``, most formats, ...) and reads others only in some
combinations, so a schema is first checked here keyword by keyword: one it cannot enforce is refused
with the keyword and where it is (the server answers 400), never sampled loosely. Its string rule lets
raw control characters through, which JSON forbids; the grammar here replaces that rule."""
from __future__ import annotations

import functools
import json
import re

from localctx.backends.base import OutputConstraint
from localctx.kvcache.errors import UserError

ANNOTATIONS = {"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
               "readOnly", "writeOnly"}
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
            "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "pattern", "minLength",
            "maxLength", "format"} | ANNOTATIONS
TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
HINTS = {"oneOf": "use anyOf", "allOf": "merge the schemas into one"}
MAX_DEPTH = 64
# JSON's string character: no raw quote, backslash or control character (llama-cpp-python's own rule
# lets control characters through)
CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
_RULE_LINE = re.compile(r"^([a-zA-Z0-9-]+) ::= (.*)$")
_BODY_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[a-zA-Z0-9-]+|\s+|.')


class Unenforceable(ValueError):
    """A schema keyword llama.cpp's grammar cannot enforce; ``where`` is its path in the schema."""

    def __init__(self, what: str, where: str):
        super().__init__(f"{what} at {where}")


def _check_text(value, where: str) -> None:
    if isinstance(value, str) and "\\" in value:
        raise Unenforceable("a backslash in a literal string", where)


def check_schema(node, where: str = "$", depth: int = 0) -> None:
    """Raises Unenforceable for what llama-cpp-python's converter would not enforce exactly."""
    if depth > MAX_DEPTH:
        raise Unenforceable(f"nesting deeper than {MAX_DEPTH}", where)
    if not isinstance(node, dict):
        raise Unenforceable("a schema that is not an object (true/false schemas)", where)
    for key in node:
        if key not in KEYWORDS:
            raise Unenforceable(f"'{key}'" + (f" ({HINTS[key]})" if key in HINTS else ""), where)
    structural = set(node) - ANNOTATIONS
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in TYPES for k in kinds) or (isinstance(kind, list) and not kind):
        raise Unenforceable(f"type {kind!r}", where)
    if isinstance(kind, list) and structural - {"type"}:
        raise Unenforceable("a list of types beside other keywords (use anyOf)", where)
    for alone in ("$ref", "anyOf"):
        if alone in node and structural - {alone, "$defs", "definitions"}:
            raise Unenforceable(f"'{alone}' beside other keywords", where)
    if "$ref" in node and not (isinstance(node["$ref"], str) and node["$ref"].startswith("#/")):
        raise Unenforceable("a $ref outside this schema", where)
    if "format" in node and node["format"] not in FORMATS:
        raise Unenforceable(f"format {node['format']!r}", where)
    if ("pattern" in node or "format" in node) and {"minLength", "maxLength"} & structural:
        raise Unenforceable("minLength/maxLength beside pattern or format", where)
    if {"minLength", "maxLength"} & structural and kind != "string":
        raise Unenforceable("minLength/maxLength without \"type\": \"string\"", where)
    if "pattern" in node and ('"' in str(node["pattern"]) or "\\" in str(node["pattern"])):
        raise Unenforceable("a quote or backslash in a pattern", where)
    if "prefixItems" in node and {"items", "minItems", "maxItems"} & structural:
        raise Unenforceable("prefixItems beside items, minItems or maxItems", where)
    _check_text(node.get("const"), where)
    for value in node.get("enum", []) if isinstance(node.get("enum"), list) else []:
        _check_text(value, where)
    properties = node.get("properties", {})
    if not isinstance(properties, dict):
        raise Unenforceable("properties that are not an object", where)
    required = node.get("required", [])
    if not isinstance(required, list) or any(r not in properties for r in required):
        raise Unenforceable("'required' naming a property that 'properties' does not define", where)
    for name, sub in properties.items():
        _check_text(name, f"{where}.properties")
        check_schema(sub, f"{where}.properties.{name}", depth + 1)
    for key in ("$defs", "definitions"):
        for name, sub in (node.get(key) or {}).items():
            check_schema(sub, f"{where}.{key}.{name}", depth + 1)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        check_schema(extra, f"{where}.additionalProperties", depth + 1)
    items = node.get("items", node.get("prefixItems"))
    for i, sub in enumerate(items if isinstance(items, list) else [items] if items is not None else []):
        check_schema(sub, f"{where}.items[{i}]", depth + 1)
    for i, sub in enumerate(node.get("anyOf") or []):
        check_schema(sub, f"{where}.anyOf[{i}]", depth + 1)


def _literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _schema_rules(schema: dict, prefix: str) -> list[str]:
    """The converter's rules for ``schema``, each name prefixed (so that several schemas' rules,
    $defs included, never collide), with JSON's string character rule."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    text = json_schema_to_gbnf(json.dumps(schema))
    rules = dict(_RULE_LINE.match(line).groups() for line in text.splitlines() if line.strip())
    if "char" in rules:
        rules["char"] = CHAR_RULE

    def rename(body: str) -> str:
        return "".join(prefix + t if t in rules else t for t in _BODY_TOKEN.findall(body))
    return [f"{prefix}{name} ::= {rename(body)}" for name, body in rules.items()]


@functools.lru_cache(maxsize=64)
def gbnf(constraint: OutputConstraint) -> str:
    """The grammar text (root rule ``root``); raises UserError naming what cannot be enforced."""
    lines, alternatives = [], []
    for i, shape in enumerate(constraint.shapes):
        schema = json.loads(shape.schema)
        try:
            check_schema(schema)
            rules = _schema_rules(schema, f"s{i}-")
        except Unenforceable as exc:
            raise UserError(f"{constraint.field}: llama.cpp's grammar cannot enforce {exc}; simplify the schema, "
                            "or use the torch backend (llguidance takes more of JSON Schema)") from None
        except Exception as exc:  # the converter's own refusals (asserts, unknown patterns)
            raise UserError(f"{constraint.field}: llama-cpp-python's JSON-Schema converter refused the schema "
                            f"({type(exc).__name__}: {exc}); simplify it") from None
        lines += rules
        parts = [_literal(shape.prefix)] if shape.prefix else []
        parts.append(f"s{i}-root")
        if shape.suffix:
            parts.append(_literal(shape.suffix))
        alternatives.append("(" + " ".join(parts) + ")")
    return "\n".join([f"root ::= {' | '.join(alternatives)}"] + lines)


def grammar_sampler(vocab, constraint: OutputConstraint):
    """A llama.cpp grammar sampler for ``constraint`` over ``vocab`` (``llama_model_get_vocab``); the
    caller frees it, or a sampler chain that owns it does."""
    import llama_cpp

    sampler = llama_cpp.llama_sampler_init_grammar(vocab, gbnf(constraint).encode("utf-8"), b"root")
    if not sampler:
        raise UserError(f"{constraint.field}: llama.cpp could not parse the grammar made from this schema; "
                        "simplify the schema")
    return sampler


def refusal(vocab, constraint: OutputConstraint) -> str | None:
    """Why llama.cpp cannot sample under ``constraint``, or None (the grammar parses over ``vocab``)."""
    import llama_cpp

    try:
        llama_cpp.llama_sampler_free(grammar_sampler(vocab, constraint))
    except UserError as exc:
        return str(exc)
    return None


def llama_grammar(constraint: OutputConstraint):
    """The grammar as llama-cpp-python's ``LlamaGrammar`` (``Llama.generate(grammar=...)``)."""
    from llama_cpp.llama_grammar import LlamaGrammar

    return LlamaGrammar.from_string(gbnf(constraint), verbose=False)
