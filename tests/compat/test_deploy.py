"""The deployment files of docs/deploy.md: the systemd unit passes `systemd-analyze verify`, and nginx
with the documented proxy block passes streamed answers on as they are made, to the openai SDK."""

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.live_server import smollm2_server as serve_smollm2
from tests.nginx import nginx
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
KEY = "deploy-test-key"


def test_the_systemd_unit_verifies():
    systemd_analyze = shutil.which("systemd-analyze")
    assert systemd_analyze, "systemd-analyze is needed (.ci/run installs systemd)"
    result = subprocess.run([systemd_analyze, "verify", str(ROOT / "deploy" / "reame.service")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "reame.service" not in result.stderr, result.stderr


@pytest.fixture(scope="module")
def proxied(native_libraries, smollm2_path, tmp_path_factory):
    """Reame on a free port, nginx in front of it with deploy/reame-proxy.conf (the port put in)."""
    work = tmp_path_factory.mktemp("nginx")
    with serve_smollm2(smollm2_path, KEY, parallel=2) as base:
        upstream = base.rsplit(":", 1)[1]
        proxy = (ROOT / "deploy" / "reame-proxy.conf").read_text().replace("127.0.0.1:8080", f"127.0.0.1:{upstream}")
        (work / "reame-proxy.conf").write_text(proxy)
        with nginx(work, f"server {{ listen 127.0.0.1:{{port}}; include {work}/reame-proxy.conf; }}") as port:
            front = f"http://127.0.0.1:{port}"
            wait_until(lambda: _answers(front))
            yield front, base


def _answers(base: str) -> bool:
    try:
        return urllib.request.urlopen(base + "/health", timeout=2).status == 200
    except OSError:
        return False


def busy_slots(base: str) -> float:
    request = urllib.request.Request(base + "/stats", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return sum(s["value"] for s in json.loads(response.read())["samples"] if s["name"] == "reame_busy_slots")


def test_nginx_passes_a_stream_through_token_by_token(proxied):
    front, upstream = proxied
    client = openai.OpenAI(base_url=front + "/v1", api_key=KEY, max_retries=0)
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell a long story."}],
                                            max_tokens=40, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            break
    # The first piece is here while the server is still generating: the stream reaches the client through the
    # proxy as it is made (proxy_buffering off in the block; Reame also sends X-Accel-Buffering: no).
    assert busy_slots(upstream) == 1
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell a long story."}],
                                           max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert "".join(pieces) == whole.choices[0].message.content
    assert urllib.request.urlopen(front + "/", timeout=10).read().startswith(b"<!doctype html>")


def test_nginx_limits_what_one_client_address_may_ask(proxied):
    front, _ = proxied
    statuses = []
    for _ in range(40):  # faster than 5 a second, past the burst of 20
        try:
            statuses.append(urllib.request.urlopen(front + "/health", timeout=10).status)
        except urllib.error.HTTPError as error:
            statuses.append(error.code)
    assert statuses[0] == 200 and 429 in statuses and set(statuses) <= {200, 429}
