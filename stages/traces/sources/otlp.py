"""OTLP JSON values, shared by the span-based readers (OpenTelemetry GenAI, OpenInference)."""

from __future__ import annotations


def any_value(value: object) -> object:
    """An OTLP AnyValue as a plain Python value (int64s come as decimal strings in OTLP JSON)."""
    if not isinstance(value, dict):
        return value
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [any_value(v) for v in (value["arrayValue"] or {}).get("values") or []]
    if "kvlistValue" in value:
        return {kv["key"]: any_value(kv.get("value"))
                for kv in (value["kvlistValue"] or {}).get("values") or []}
    return value.get("bytesValue")
