"""Real Redis stores for the fleet's benchmark and tests: one `redis-server`, or a Redis Cluster of several
made with `redis-cli --cluster create`, each on free loopback ports in a directory of the caller's,
stopped when the block ends. (Debian's redis-server and redis-tools; Redis 7.)"""

from __future__ import annotations

import random
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

START_TIMEOUT_S = 30.0
POLL_S = 0.01


def free_port(cluster: bool = False) -> int:
    """A free loopback port; `cluster`: one whose cluster bus port (10000 above it) is free too."""
    if not cluster:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return probe.getsockname()[1]
    for port in random.sample(range(20000, 45000), 200):
        try:
            with socket.socket() as first, socket.socket() as bus:
                first.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports for a cluster node")


def redis_cli(port: int, *words: str) -> str:
    result = subprocess.run(["redis-cli", "-p", str(port), *words], capture_output=True, text=True, timeout=30)
    return result.stdout


def wait_for(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    """Until `condition()` holds (a server answering, a cluster agreeing), or fail after START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(POLL_S)


@contextmanager
def redis_server(directory: Path, *options: str) -> Iterator[tuple[int, subprocess.Popen]]:
    """(port, process) of a redis-server without persistence; `options`: more of its flags."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port(cluster="--cluster-enabled" in options)
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(directory), *options],
                               stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: redis_cli(port, "PING").strip() == "PONG" or process.poll() is not None,
                 f"redis-server on port {port}")
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}")
        yield port, process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(30)


@contextmanager
def redis_cluster(directory: Path, nodes: int = 3) -> Iterator[list[int]]:
    """The ports of a Redis Cluster of `nodes` primaries (no replicas) whose slots are all served."""
    with ExitStack() as stack:
        ports = [stack.enter_context(redis_server(directory / f"node{n}", "--cluster-enabled", "yes",
                                                  "--cluster-config-file", f"nodes-{n}.conf"))[0]
                 for n in range(nodes)]
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        wait_for(lambda: all("cluster_state:ok" in redis_cli(port, "CLUSTER", "INFO") for port in ports),
                 "the cluster to serve every slot")
        yield ports
