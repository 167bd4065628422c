"""A small value that satisfies a JSON schema: what the fake Gemini answers to a JSON-schema request."""

from __future__ import annotations

from typing import Any


def instance_of(schema: Any, name: str = "") -> Any:
    """A small value satisfying a JSON schema (as gemini-cli's JSON requests use them)."""
    if not isinstance(schema, dict):
        return "ok"
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        choices = list(schema["enum"])
        return "user" if "user" in choices else choices[0]  # hand the turn back to the user when asked
    if options := schema.get("anyOf") or schema.get("oneOf"):
        return instance_of(options[0], name)
    if schema.get("allOf"):
        return instance_of({k: v for sub in schema["allOf"] if isinstance(sub, dict) for k, v in sub.items()}, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).lower() if kind else ("object" if "properties" in schema else "string")
    if kind == "object":
        return {key: instance_of(sub, key) for key, sub in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [instance_of(schema.get("items"), name) for _ in range(max(1, int(schema.get("minItems", 1))))]
    if kind in ("integer", "number"):
        low = schema.get("minimum", 1)
        if isinstance(schema.get("exclusiveMinimum"), (int, float)):
            low = schema["exclusiveMinimum"] + 1
        value = min(max(1, low), schema.get("maximum", max(1, low)))
        return int(value) if kind == "integer" else float(value)
    return {"boolean": False, "null": None}.get(kind, f"fake {name}".strip())
