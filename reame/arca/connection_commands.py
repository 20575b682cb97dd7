"""ARCA's connection commands: PING, ECHO, QUIT, SELECT, AUTH, HELLO, CLIENT, COMMAND, CONFIG GET, INFO."""

from __future__ import annotations

import fnmatch
import hmac
import os
import time
from collections.abc import Mapping

from reame import __version__
from reame.arca.resp import OK, Error, Reply, Simple
from reame.arca.state import ArcaState
from reame.arca.store import integer
from reame.arca.types import Client

PONG = Simple("PONG")
REDIS_VERSION = "7.0.0"  # the protocol level ARCA speaks, for clients that check


def cmd_ping(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    if len(args) > 1:
        return Error("ERR wrong number of arguments for 'ping' command")
    return args[0] if args else PONG


def cmd_echo(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    return args[0]


def cmd_quit(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    client.closing = True
    return OK


def cmd_select(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    index = integer(args[0])
    return OK if index == 0 else Error("ERR DB index is out of range")


def cmd_auth(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    if len(args) > 2:
        return Error("ERR syntax error")
    return _authenticate(state, client, args[0] if len(args) == 2 else b"default", args[-1])


def _authenticate(state: ArcaState, client: Client, user: bytes, password: bytes) -> Reply:
    if not state.settings.requirepass:
        return Error("ERR AUTH <password> called without any password configured for the default user. "
                     "Are you sure your configuration is correct?")
    if user != b"default" or not hmac.compare_digest(password, state.settings.requirepass.encode()):
        return Error("WRONGPASS invalid username-password pair or user is disabled.")
    client.authenticated = True
    return OK


def cmd_hello(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    version = 2 if client.resp3 is False else 3
    rest = args
    if rest:
        try:
            version = int(rest[0])
        except ValueError:
            return Error("ERR Protocol version is not an integer or out of range")
        if version not in (2, 3):
            return Error("NOPROTO unsupported protocol version")
        rest = rest[1:]
    while rest:
        option = rest[0].upper()
        if option == b"AUTH" and len(rest) >= 3:
            reply = _authenticate(state, client, rest[1], rest[2])
            if isinstance(reply, Error):
                return reply
            rest = rest[3:]
        elif option == b"SETNAME" and len(rest) >= 2:
            client.name = rest[1]
            rest = rest[2:]
        else:
            return Error(f"ERR Syntax error in HELLO option '{rest[0].decode('utf-8', 'replace')}'")
    if state.settings.requirepass and not client.authenticated:
        return Error("NOAUTH HELLO must be called with the client already authenticated, otherwise the "
                     "HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and "
                     "select the RESP protocol version at the same time")
    client.resp3 = version == 3
    return {"server": "redis", "version": REDIS_VERSION, "proto": version, "id": client.id,
            "mode": "standalone", "role": "master", "modules": []}


def cmd_client(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    sub = args[0].upper()
    if sub == b"SETNAME" and len(args) == 2:
        if b" " in args[1]:
            return Error("ERR Client names cannot contain spaces, newlines or special characters.")
        client.name = args[1]
        return OK
    if sub == b"GETNAME" and len(args) == 1:
        return client.name or None
    if sub == b"ID" and len(args) == 1:
        return client.id
    if sub == b"INFO" and len(args) == 1:
        return _client_line(client)
    if sub == b"LIST":
        return "".join(_client_line(other) for other in state.clients.values())
    if sub == b"SETINFO" and len(args) == 3:
        if args[1].upper() == b"LIB-NAME":
            client.library = args[2]
        return OK
    return Error(f"ERR unknown subcommand or wrong number of arguments for '{sub.decode('utf-8', 'replace')}'")


def _client_line(client: Client) -> str:
    age = int(time.monotonic() - client.created)
    return (f"id={client.id} addr={client.address} name={client.name.decode('utf-8', 'replace')} age={age} "
            f"db=0 resp={3 if client.resp3 else 2} cmd={client.last_command.decode().lower()} "
            f"lib-name={client.library.decode('utf-8', 'replace')}\n")


def cmd_command(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    sub = args[0].upper() if args else b""
    if sub == b"COUNT":
        return len(state.command_table)
    if sub == b"DOCS":
        return {}
    if sub == b"INFO":
        return [command_info(name, state.command_table) if name.upper() in state.command_table else None
                for name in args[1:]]
    if sub == b"":
        return [command_info(name, state.command_table) for name in state.command_table]
    return Error(f"ERR unknown subcommand '{sub.decode('utf-8', 'replace')}'")


def cmd_config(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    if args[0].upper() != b"GET" or len(args) < 2:
        return Error("ERR CONFIG: only CONFIG GET is supported by ARCA")
    values = {"maxmemory": str(state.settings.max_bytes), "maxmemory-policy": "allkeys-lru",
              "appendonly": "yes", "appendfsync": "everysec", "save": "", "databases": "1",
              "requirepass": "", "port": str(state.settings.port)}
    found: dict[str, str] = {}
    for pattern in args[1:]:
        for key, value in values.items():
            if fnmatch.fnmatchcase(key, pattern.decode("utf-8", "replace").lower()):
                found[key] = value
    return found


def cmd_info(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    aof = state.aof
    assert aof is not None, "INFO is never replayed from the log"
    sections: dict[str, dict[str, object]] = {
        "server": {"redis_version": REDIS_VERSION, "arca_version": __version__, "redis_mode": "standalone",
                   "os": os.uname().sysname, "process_id": os.getpid(), "tcp_port": state.settings.port,
                   "uptime_in_seconds": int(time.time() - state.started)},
        "clients": {"connected_clients": len(state.clients),
                    "blocked_clients": sum(1 for other in state.clients.values() if other.blocked)},
        "memory": {"used_memory": state.keyspace.used_bytes, "maxmemory": state.settings.max_bytes,
                   "maxmemory_policy": "allkeys-lru"},
        "persistence": {"loading": 0, "aof_enabled": 1, "aof_rewrite_in_progress": int(aof._rewrite_tail
                                                                                      is not None),
                        "aof_rewrites": aof.rewrites, "aof_current_size": aof.size(),
                        "aof_fsynced_size": aof.synced_size, "aof_base_size": aof.base_size},
        "stats": {"total_connections_received": state.connections_received,
                  "total_commands_processed": state.commands_processed,
                  "expired_keys": state.keyspace.expired, "evicted_keys": state.keyspace.evicted},
        "keyspace": {"db0": f"keys={len(state.keyspace)},expires={state.keyspace.expiring()},avg_ttl=0"}
        if len(state.keyspace) else {},
    }
    wanted = {arg.decode("utf-8", "replace").lower() for arg in args} - {"all", "everything", "default"}
    lines = []
    for section, values in sections.items():
        if wanted and section not in wanted:
            continue
        lines.append(f"# {section.capitalize()}")
        lines += [f"{key}:{value}" for key, value in values.items()]
        lines.append("")
    return "\r\n".join(lines)


def command_info(name: bytes, table: Mapping[bytes, tuple[object, int]]) -> list:
    """COMMAND's description of one command: name, arity, flags, first key, last key, key step."""
    arity = table[name.upper()][1]
    keyless = name.upper() in (b"PING", b"ECHO", b"QUIT", b"SELECT", b"AUTH", b"HELLO", b"CLIENT", b"COMMAND",
                               b"CONFIG", b"INFO", b"DBSIZE", b"FLUSHDB", b"FLUSHALL", b"SCAN", b"KEYS",
                               b"XREAD")
    return [name.lower(), arity, [], 0 if keyless else 1, 0 if keyless else (-1 if arity < 0 and name.upper() in (
        b"MGET", b"DEL", b"UNLINK", b"EXISTS") else 1), 0 if keyless else 1]
