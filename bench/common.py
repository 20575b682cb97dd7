"""Helpers shared by the benchmarks: models, llama.cpp tools, tables."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reame import catalog, fetch, native
from reame.model.backend import usable_cores

# The benchmarks measure computing: a repeated deterministic request answered from the exact answer cache
# would skip it. Those that measure the cache itself (arca.py, workload.py) turn it back on for their servers.
os.environ.setdefault("REAME_CACHE_ANSWERS", "0")
# They measure what drafting buys a greedy answer: with `speculative.exact` (the default) a greedy answer
# drafts only in batches computed exactly as one row, which on an f16 KV is none past 256 cells
# (docs/speculative.md#exactness). held_out.py compares both settings.
os.environ.setdefault("REAME_SPECULATIVE_EXACT", "0")


def bench_parser(doc: str, model: str | None, tokens: int, reps: int, tokens_help: str | None = None,
                 reps_help: str | None = None) -> argparse.ArgumentParser:
    """The options every benchmark takes: the model (`None`: repeatable, none by default), 2 threads,
    tokens per measurement and repetitions; the description is `doc`'s first line."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if model is None:
        parser.add_argument("--model", action="append", help="catalog name or path (repeatable)")
    else:
        parser.add_argument("--model", default=model, help="catalog name or path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=tokens, help=tokens_help)
    parser.add_argument("--reps", type=int, default=reps, help=reps_help)
    return parser


def model_path(name: str) -> Path:
    """A catalog name (fetched into the cache once) or a path."""
    entry = catalog.resolve(name)
    if entry is None:
        return Path(name)
    return fetch.ensure_model(entry, native.cache_root() / "models")


def llama_tool(name: str) -> Path:
    """llama-bench / llama-server built from the pinned source (`build_zipapp.py --bench-tools`)."""
    path = native.build_dir(portable=False, tools=True) / "bin" / name
    if not path.exists():
        sys.exit(f"{name} not found at {path}: run python build_zipapp.py --bench-tools")
    return path


def server_command(kind: str, path: str, port: int, threads: int, context: int, slots: int = 1) -> list[str]:
    """The command that serves `path` on `port`: Reame (`kind` "reame") or llama-server from the pinned
    build, with the same threads, context and sequence slots; callers append their own options."""
    if kind == "reame":
        return [sys.executable, "-m", "reame", "run", path, "--serve", "--port", str(port), "--threads",
                str(threads), "--ctx", str(context), "--parallel", str(slots), "-q"]
    return [str(llama_tool("llama-server")), "-m", path, "-t", str(threads), "-c", str(context), "-np", str(slots),
            "--port", str(port), "--host", "127.0.0.1"]


def rotated(names: tuple[str, ...], turn: int) -> tuple[str, ...]:
    """`names` starting at `turn` (modulo their number): who goes first changes from turn to turn."""
    turn %= len(names)
    return names[turn:] + names[:turn]


def machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {usable_cores()} usable cores, {platform.machine()}"


def summary(values: list[float], digits: int = 1) -> str:
    """Median and spread (min–max) of repeated measurements."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    print(line(headers))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


@dataclass
class Streamed:
    """One streamed answer as the client saw it."""

    text: str
    tokens: int  # usage.completion_tokens (the request must ask for include_usage)
    first: float  # perf_counter() when the first text arrived
    last: float  # … and the last
    error: str = ""  # an error event the server sent in the stream, if any

    @property
    def decode_speed(self) -> float:
        """Tokens per second between the first and the last piece of text."""
        return (self.tokens - 1) / (self.last - self.first) if self.last > self.first and self.tokens > 1 else 0.0


def read_stream(lines: Iterable[bytes]) -> Streamed:
    """Read a completions or chat completions SSE stream to its end."""
    pieces: list[str] = []
    first = last = 0.0
    tokens, error = 0, ""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("error"):
            error = str(chunk["error"])[:200]
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        piece = choice.get("text") or (choice.get("delta") or {}).get("content")
        if piece:
            pieces.append(piece)
            last = time.perf_counter()
            first = first or last
    return Streamed("".join(pieces), tokens, first, last, error)


def metrics_text(port: int) -> str:
    """A Reame server's /metrics."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    return text


def metric(port: int, name: str) -> float:
    """A Reame metric summed over its labels (every model's, every source's)."""
    return sum(float(line.split()[-1]) for line in metrics_text(port).splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def speculation_counts(port: int, source: str) -> dict[str, float]:
    """A Reame server's speculation counters from /metrics: `source`'s drafted and accepted tokens,
    every source's, and the steps that verified drafts."""
    text = metrics_text(port)
    counts = dict.fromkeys(("drafted", "accepted", "all drafted", "all accepted", "steps"), 0.0)
    for what in ("drafted", "accepted"):
        for name, value in re.findall(rf'^reame_spec_decode_{what}_total{{model="[^"]*",source="(\w+)"}} (\S+)$',
                                      text, re.M):
            counts[f"all {what}"] += float(value)
            if name == source:
                counts[what] += float(value)
    counts["steps"] = sum(map(float, re.findall(r'^reame_spec_decode_steps_total{kind="speculative",model="[^"]*"} '
                                                r'(\S+)$', text, re.M)))
    return counts
