"""OTLP JSON values and documents, shared by the span-based readers (OpenTelemetry GenAI, OpenInference)."""

from __future__ import annotations

from stages.traces.schema import BadRecord


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


_SIGNALS = (("resourceSpans", ("scopeSpans", "instrumentationLibrarySpans"), "scopeSpans", "spans"),
            ("resourceLogs", ("scopeLogs", "instrumentationLibraryLogs"), "scopeLogs",
             "logRecords"))


def detect(record: object) -> bool:
    """True for an OTLP JSON document of spans (`resourceSpans`) or log records
    (`resourceLogs`), as the Collector's file exporter writes one a line.
    """
    return isinstance(record, dict) and (isinstance(record.get("resourceSpans"), list)
                                         or isinstance(record.get("resourceLogs"), list))


def by_trace(documents: list[dict]) -> dict[str, dict]:
    """OTLP JSON documents split into one document per trace id, in order of first appearance:
    each holds that trace's spans and log records under copies of their resource and scope.
    Log records of no trace (plain application logs) are left out.

    Raises BadRecord for a malformed document or a span without a trace id.
    """
    traces: dict[str, dict] = {}
    holders: dict[tuple, list] = {}  # (trace, document, signal, resource, scope) -> its items
    for n, document in enumerate(documents, 1):
        for signal, scope_keys, scope_key, items_key in _SIGNALS:
            for i, resource in enumerate(document.get(signal) or []):
                if not isinstance(resource, dict):
                    raise BadRecord(f"OTLP document {n}: {signal}[{i}] is not an object")
                scopes = next((resource[k] for k in scope_keys if resource.get(k)), [])
                for j, scope in enumerate(scopes if isinstance(scopes, list) else []):
                    items = scope.get(items_key) if isinstance(scope, dict) else None
                    for k, item in enumerate(items if isinstance(items, list) else []):
                        where = f"OTLP document {n}: {signal}[{i}].{scope_key}[{j}]." \
                                f"{items_key}[{k}]"
                        if not isinstance(item, dict):
                            raise BadRecord(f"{where} is not an object")
                        trace_id = item.get("traceId")
                        if not isinstance(trace_id, str) or not trace_id:
                            if signal == "resourceLogs":
                                continue
                            raise BadRecord(f"{where} has no 'traceId'")
                        key = (trace_id, n, signal, i, j)
                        if key not in holders:
                            doc = traces.setdefault(trace_id, {})
                            res = {k: v for k, v in resource.items() if k not in scope_keys}
                            res[scope_key] = [{**scope, items_key: []}]
                            doc.setdefault(signal, []).append(res)
                            holders[key] = res[scope_key][0][items_key]
                        holders[key].append(item)
    return traces
