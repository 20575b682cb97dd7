"""A real nginx for the deployment tests: the shipped files' rate-limit zones and a server block of the
caller's, in a private prefix directory, stopped when the block ends."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.live_server import free_port

ROOT = Path(__file__).resolve().parents[1]


def shipped_zones() -> str:
    """The limit_*_zone lines of deploy/nginx-reame.conf, which reame-proxy.conf's limits name."""
    return "\n".join(line for line in (ROOT / "deploy" / "nginx-reame.conf").read_text().splitlines()
                     if line.startswith(("limit_conn_zone", "limit_req_zone")))


@contextmanager
def nginx(work: Path, http_block: str) -> Iterator[int]:
    """nginx with `http_block` (its text may use {port}, the port it listens on) inside `http {}`; yields the
    port. The caller waits for it to answer."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (work / "nginx.conf").write_text(f"""user root; daemon off; pid {work}/nginx.pid;
error_log {work}/error.log;
events {{}}
http {{
    access_log off;
    client_body_temp_path {work}/body; proxy_temp_path {work}/proxy; fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi; scgi_temp_path {work}/scgi;
    {shipped_zones()}
    {http_block.replace("{port}", str(port))}
}}
""")
    executable = shutil.which("nginx") or "/usr/sbin/nginx"  # sbin: not on every PATH
    process = subprocess.Popen([executable, "-p", str(work), "-c", str(work / "nginx.conf")])
    try:
        yield port
    finally:
        process.terminate()
        process.wait(30)
