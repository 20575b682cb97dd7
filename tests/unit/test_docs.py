"""The docs say only what the code does: every message docs/troubleshooting.md explains is one the code prints."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source_text() -> str:
    """Reame's source and build script, with adjacent string literals joined (messages split over lines)."""
    files = [*sorted((ROOT / "reame").rglob("*.py")), ROOT / "build_zipapp.py"]
    text = "\n".join(path.read_text() for path in files)
    return re.sub(r"[\"']\s*\n\s*f?[\"']", "", text)


def explained_messages() -> list[str]:
    """The messages headings quote: ### `message` or ### ``message with `backticks` ``."""
    found = []
    for line in (ROOT / "docs" / "troubleshooting.md").read_text().splitlines():
        quoted = re.match(r"### ``(.+?)``$", line) or re.match(r"### `([^`]+)`", line)
        if quoted:
            found.append(quoted.group(1).strip())
    return found


def test_every_troubleshooting_message_is_printed_by_the_code():
    source = source_text()
    messages = explained_messages()
    assert len(messages) >= 20
    missing = []
    for message in messages:
        fragments = [fragment.strip() for fragment in message.split("…")]
        missing += [f"{message!r}: {fragment!r}" for fragment in fragments if len(fragment) >= 4
                    and fragment not in source]
    assert not missing, "docs/troubleshooting.md quotes messages the code does not print:\n" + "\n".join(missing)


# A measured figure: a ratio or range before ×, a time before ms or s, or a score like 22/24.
FIGURE = re.compile(r"\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)?(?=×| ms\b| s\b)|\d+/\d+")


def test_every_figure_of_the_readmes_measured_table_is_traced_in_benchmarks():
    """README's "Measured" section quotes ranges over runs; BENCHMARKS.md's "Where the README's figures
    come from" lists each with the runs it spans, so a figure nobody can trace fails here."""
    readme = (ROOT / "README.md").read_text()
    measured = readme[readme.index("## Measured"):]
    measured = measured[:measured.index("\n## ", 1)] if "\n## " in measured[1:] else measured
    table = [line.split("|")[2:4] for line in measured.splitlines() if line.startswith("| ") and "---" not in line]
    quoted = [figure for cells in table[1:] for cell in cells for figure in FIGURE.findall(cell)]
    quoted += FIGURE.findall(measured[measured.index("A batch of 16 rows"):])
    benchmarks = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    traced = benchmarks[benchmarks.index("## Where the README's figures come from"):]
    traced = traced[:traced.index("\n## ", 1)]
    assert len(quoted) >= 20 and [figure for figure in quoted if figure not in traced] == []
