"""Probe the host and the model; choose threads, context, KV type and batch sizes.

Every choice carries the reason it was made, so `reame run … --print-config`
can show the user why. Explicit settings (flags, environment, config file)
always win; autoconfig fills only what is left at 0/auto.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reame import gguf
from reame.model.backend import usable_cores
from reame.model.fingerprint import remembered

CGROUP_ROOT = Path("/sys/fs/cgroup")
KV_BYTES_PER_ELEMENT = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
DEFAULT_CONTEXT = 4096
MIN_CONTEXT = 512
CONTEXT_STEP = 256
RAM_SHARE_FOR_MODEL = 0.8  # of available memory: leave room for the OS and Python
KV_SHARE_BEFORE_QUANTIZING = 0.25  # an f16 KV taking more than this of the free RAM becomes q8_0


@dataclass(frozen=True)
class Choice:
    value: Any
    why: str


@dataclass(frozen=True)
class Host:
    cores: Choice  # usable CPU cores
    ram_bytes: Choice  # memory this process may use


def probe_host(cgroup_root: Path = CGROUP_ROOT, meminfo: Path = Path("/proc/meminfo")) -> Host:
    affinity = usable_cores()
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None and math.ceil(quota) < affinity:
        cores = Choice(max(1, math.ceil(quota)), f"cgroup CPU quota {quota:g} cores (affinity allows {affinity})")
    else:
        cores = Choice(affinity, f"{affinity} cores in the affinity mask"
                       + ("" if quota is None else f", cgroup quota {quota:g}"))
    available = meminfo_available(meminfo)
    limit = cgroup_memory_room(cgroup_root)
    if limit is not None and (available is None or limit < available):
        ram = Choice(limit, f"cgroup memory limit leaves {limit / 2**30:.1f} GiB")
    elif available is not None:
        ram = Choice(available, f"MemAvailable {available / 2**30:.1f} GiB")
    else:
        ram = Choice(4 << 30, "memory unknown; assuming 4 GiB")
    return Host(cores, ram)


def cgroup_cpu_quota(root: Path) -> float | None:
    """CPU limit in cores from cgroup v2 `cpu.max` or v1 `cfs_quota_us`; None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def cgroup_memory_room(root: Path) -> int | None:
    """Bytes left under the cgroup memory limit (v2 or v1); None when unlimited."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            raw = (root / limit_file).read_text().strip()
        except OSError:
            continue
        if raw == "max":
            return None
        try:
            limit = int(raw)
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # v1 spells "unlimited" as a huge number
            return None
        return max(0, limit - usage)
    return None


def meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def kv_bytes_per_token(facts: dict[str, int], kv_type: str) -> float:
    return facts["layers"] * facts["kv_heads"] * (facts["key_size"] + facts["value_size"]) * \
        KV_BYTES_PER_ELEMENT[kv_type]


def architecture_facts(model_path: str | Path) -> dict[str, int]:
    """gguf.architecture_facts of the model, read from the file once per model: stepping over its
    vocabulary to reach them cost every start 30-300 ms."""
    return remembered(model_path, "architecture facts",
                      lambda: json.dumps(gguf.architecture_facts(gguf.read_metadata(model_path))), parse_facts)


def parse_facts(text: str) -> dict[str, int]:
    """Remembered architecture facts read back: exactly gguf's keys, each a whole number, or ValueError."""
    facts = json.loads(text)
    if not isinstance(facts, dict) or sorted(facts) != sorted(gguf.ARCHITECTURE_FACTS) or \
            not all(type(value) is int and value >= 0 for value in facts.values()):
        raise ValueError("not architecture facts")
    return facts


SERVED_SEQUENCES = 4  # as llama-server's default; one-shot runs use one


def choose(model_path: str | Path, host: Host, *, threads: int = 0, context: int = 0, kv_type: str = "auto",
           batch: int = 0, ubatch: int = 0, preferred_context: int = 0, parallel: int = 0) -> dict[str, Choice]:
    """Fill every setting left at 0/auto, with reasons. `preferred_context`: the catalog's suggestion."""
    chosen: dict[str, Choice] = {"host.cores": host.cores, "host.ram": Choice(
        f"{host.ram_bytes.value / 2**30:.1f} GiB", host.ram_bytes.why)}
    cores = host.cores.value
    if threads:
        chosen["model.threads"] = Choice(threads, "set explicitly")
    elif cores <= 4:
        chosen["model.threads"] = Choice(cores, f"one per usable core ({cores})")
    else:
        chosen["model.threads"] = Choice(cores - 1, f"{cores} usable cores, one left for the OS and HTTP")

    model_bytes = Path(model_path).stat().st_size
    facts = architecture_facts(model_path)
    budget = host.ram_bytes.value * RAM_SHARE_FOR_MODEL - model_bytes
    trained = facts["context_train"] or DEFAULT_CONTEXT
    wanted = min(preferred_context or DEFAULT_CONTEXT, trained)
    why_wanted = (f"the catalog's {preferred_context}" if preferred_context else f"default {DEFAULT_CONTEXT}") + \
        (f", capped by the trained {trained}" if trained < (preferred_context or DEFAULT_CONTEXT) else "")

    if kv_type != "auto":
        chosen["memory.kv_cache_type"] = Choice(kv_type, "set explicitly")
    else:
        f16_bytes = kv_bytes_per_token(facts, "f16") * (context or wanted)
        if budget > 0 and f16_bytes > budget * KV_SHARE_BEFORE_QUANTIZING:
            chosen["memory.kv_cache_type"] = Choice("q8_0", f"an f16 KV of {f16_bytes / 2**20:.0f} MiB would take "
                                                    f"over {KV_SHARE_BEFORE_QUANTIZING:.0%} of the free memory")
        else:
            chosen["memory.kv_cache_type"] = Choice("f16", f"the f16 KV ({f16_bytes / 2**20:.0f} MiB) fits easily")
    per_token = kv_bytes_per_token(facts, chosen["memory.kv_cache_type"].value)

    if context:
        chosen["model.context_length"] = Choice(context, "set explicitly")
    else:
        fits = int(budget / per_token) if per_token and budget > 0 else wanted
        value = max(MIN_CONTEXT, min(wanted, fits) // CONTEXT_STEP * CONTEXT_STEP)
        why = why_wanted if fits >= wanted else \
            f"memory after the {model_bytes / 2**20:.0f} MiB model holds {fits} tokens of KV"
        chosen["model.context_length"] = Choice(value, why)
    n_ctx = chosen["model.context_length"].value
    chosen["model.batch"] = Choice(batch, "set explicitly") if batch else \
        Choice(min(512, n_ctx), "llama.cpp's default physical batch, within the context")
    chosen["model.ubatch"] = Choice(ubatch, "set explicitly") if ubatch else \
        Choice(min(512, chosen["model.batch"].value), "at most the batch")
    chosen["model.kv_bytes"] = Choice(f"{per_token * n_ctx / 2**20:.0f} MiB",
                                      f"{per_token / 1024:.1f} KiB per token × {n_ctx} tokens")
    chosen["server.parallel"] = Choice(parallel, "set explicitly") if parallel else \
        Choice(SERVED_SEQUENCES, f"when serving, {SERVED_SEQUENCES} requests share each step in one {n_ctx}-token KV "
                                 "(4 streams gave 1.35-1.46x one stream's throughput on 2 cores)")
    return chosen
