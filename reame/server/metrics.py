"""Counters and gauges, rendered in the Prometheus text exposition format."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable, NamedTuple


class Sample(NamedTuple):
    """One labelled value a collector reports when /metrics is rendered."""

    name: str
    kind: str  # counter | gauge
    help: str
    labels: dict[str, str]
    value: float


class Metrics:
    """Thread-safe counters; gauges are read through callbacks when /metrics is rendered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        self._help: dict[str, tuple[str, str]] = {}
        self._gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self._collectors: list[Callable[[], list[Sample]]] = []

    def describe(self, name: str, kind: str, text: str) -> None:
        self._help[name] = (kind, text)

    def add(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] += value

    def total(self, name: str) -> float:
        """A counter's value summed over its labels (0 before it was ever added to)."""
        with self._lock:
            return sum(value for (counter, _), value in self._counters.items() if counter == name)

    def gauge(self, name: str, text: str, read: Callable[[], float]) -> None:
        """A value read when /metrics is rendered."""
        self._gauges[name] = (text, read)

    def collector(self, collect: Callable[[], list[Sample]]) -> None:
        """Values kept elsewhere, with labels, read at each render."""
        self._collectors.append(collect)

    def samples(self) -> list[Sample]:
        """Every counter, gauge and collected value, as of now."""
        with self._lock:
            counters = sorted(self._counters.items())
        samples = [Sample(name, *self._help.get(name, ("counter", name)), dict(labels), value)
                   for (name, labels), value in counters]
        samples += [Sample(name, "gauge", text, {}, read()) for name, (text, read) in sorted(self._gauges.items())]
        for collect in self._collectors:
            samples += collect()
        return samples

    def as_json(self) -> list[dict[str, object]]:
        """The samples for a script or the web page: name, labels, value."""
        return [{"name": sample.name, "labels": sample.labels, "value": sample.value} for sample in self.samples()]

    def render(self) -> str:
        """The Prometheus text exposition format."""
        lines: list[str] = []
        seen: set[str] = set()
        for sample in self.samples():
            if sample.name not in seen:
                seen.add(sample.name)
                lines += [f"# HELP {sample.name} {sample.help}", f"# TYPE {sample.name} {sample.kind}"]
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
            lines.append(f"{sample.name}{{{label_text}}} {_number(sample.value)}" if label_text
                         else f"{sample.name} {_number(sample.value)}")
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
