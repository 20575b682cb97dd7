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
