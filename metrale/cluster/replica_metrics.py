"""vLLM's series of every replica at the ingress's /metrics, each sample with a `replica`
label: dashboards and load generators written for vLLM (Grafana, inference-perf) query
one endpoint and sum or split by replica as they would across vLLM pods."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

PREFIX = "vllm:"


def merge_replica_series(expositions: dict[str, str]) -> str:
    """replica id -> that replica's /metrics text; returns the `vllm:` families of all of
    them, each family once (its HELP and TYPE), its samples labelled with their replica."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(expositions.items()):
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(PREFIX):
                continue
            _, _, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{sample.name}{{{body}}} {floatToGoString(sample.value)}")
    out = []
    for name, (doc, kind, lines) in families.items():
        # the text format declares a counter by its sample's name (the parser strips _total)
        declared = f"{name}_total" if kind == "counter" else name
        out += [f"# HELP {declared} {_escape(doc)}", f"# TYPE {declared} {kind}", *lines]
    return "\n".join(out) + "\n" if out else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

