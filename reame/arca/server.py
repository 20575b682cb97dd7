"""The ARCA daemon: a Redis-protocol server (RESP2, RESP3 after HELLO 3) on one asyncio event loop.

Every connection is a coroutine on the loop thread, which owns the keyspace (store.py):
commands run one at a time, so no locks. A connection's pipelined commands are
answered in order and their replies written together. Only standard Redis
commands, with Redis's replies and error texts, so redis-cli, redis-py and
redis-benchmark work unmodified, and a real Redis or Valkey can replace ARCA under
the same clients (reame/arca/client.py).

Safety: it binds 127.0.0.1 unless told otherwise; with `requirepass` every command
but AUTH, HELLO and QUIT needs authentication first (compared in constant time);
request sizes are bounded (resp.py); the keyspace has a byte budget (LRU eviction).
"""

from __future__ import annotations

import asyncio
import bisect
import fnmatch
import hmac
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reame import __version__
from reame.arca.resp import OK, Error, ProtocolError, Reply, RequestParser, Simple, command_bytes, encode
from reame.arca.store import (
    AppendOnlyFile,
    Keyspace,
    StoreError,
    Stream,
    StreamId,
    fields_size,
    format_id,
    now_ms,
    parse_id,
    read_log,
    snapshot_records,
    truncate_log,
)

log = logging.getLogger("reame.arca")

REDIS_VERSION = "7.0.0"  # the protocol level ARCA speaks, for clients that check
READ_CHUNK = 64 * 1024
EXPIRE_EVERY_S = 0.1
SYNC_EVERY_S = 1.0
NO_AUTH_NEEDED = {b"AUTH", b"HELLO", b"QUIT"}


@dataclass(frozen=True)
class ArcaSettings:
    host: str = "127.0.0.1"
    port: int = 6420
    directory: Path = Path("arca")
    max_bytes: int = 0  # 0: no budget
    requirepass: str = ""


class Client:
    """One connection's state."""

    ids = itertools.count(1)

    def __init__(self, address: str) -> None:
        self.id = next(Client.ids)
        self.address = address
        self.name = b""
        self.library = b""
        self.authenticated = False
        self.resp3 = False
        self.created = time.monotonic()
        self.last_command = b"NULL"
        self.closing = False


class Blocked:
    """An XREAD BLOCK that found nothing yet: the connection waits for an XADD or the timeout."""

    def __init__(self, retry: Callable[[], Reply], timeout_ms: int) -> None:
        self.retry, self.timeout_ms = retry, timeout_ms


class Arca:
    """The keyspace, its log, and the commands over them."""

    def __init__(self, settings: ArcaSettings) -> None:
        self.settings = settings
        self.keyspace = Keyspace(settings.max_bytes)
        self.clients: dict[int, Client] = {}
        self.started = time.time()
        self.commands_processed = 0
        self.connections_received = 0
        self.stream_added = asyncio.Event()  # set (and replaced) whenever an XADD lands
        self._loading = True
        self.aof = self._load(settings.directory)
        self._loading = False

    # --- persistence ---

    def _load(self, directory: Path) -> AppendOnlyFile:
        path = directory / "appendonly.aof"
        directory.mkdir(parents=True, exist_ok=True)
        commands, good = read_log(path)
        if path.exists():
            truncate_log(path, good)
        client = Client("aof")
        client.authenticated = True
        for command in commands:
            reply = self.execute(client, command)
            if isinstance(reply, Error):
                log.warning("the append-only file holds a command that failed: %s", reply)
        if commands:
            log.info("loaded %d keys from %s (%d commands)", len(self.keyspace), path, len(commands))
        return AppendOnlyFile(directory)

    def _log(self, *words: bytes | str | int) -> None:
        if not self._loading:
            self.aof.append(command_bytes(*words))

    async def rewrite(self) -> None:
        """Write the keyspace anew in a worker thread; writes made meanwhile are appended after it."""
        self.aof.start_rewrite()
        records = snapshot_records(self.keyspace)
        temporary = None
        try:
            temporary = await asyncio.to_thread(self.aof.write_rewrite, records)
            self.aof.finish_rewrite(temporary)
            log.info("rewrote the append-only file: %d keys, %d bytes", len(self.keyspace), self.aof.size())
        except OSError as error:
            log.warning("append-only file rewrite failed: %s", error)
            self.aof.abandon_rewrite(temporary)

    # --- serving ---

    async def serve(self, on_ready: Callable[[int], None] | None = None) -> None:
        server = await asyncio.start_server(self._connection, self.settings.host, self.settings.port,
                                            reuse_address=True, limit=READ_CHUNK)
        port = server.sockets[0].getsockname()[1]
        log.info("ARCA listening on %s:%d (data in %s%s)", self.settings.host, port, self.settings.directory,
                 ", password required" if self.settings.requirepass else "")
        if on_ready is not None:
            on_ready(port)
        chores = asyncio.create_task(self._chores())
        try:
            async with server:
                await server.serve_forever()
        finally:
            chores.cancel()
            self.aof.close()

    async def _chores(self) -> None:
        """Active expiry every 100 ms; fsync and a rewrite check every second."""
        last_sync = time.monotonic()
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            while self.keyspace.expire_some(now_ms()) >= 20:
                pass
            if time.monotonic() - last_sync >= SYNC_EVERY_S:
                last_sync = time.monotonic()
                try:
                    await asyncio.to_thread(self.aof.sync)
                except OSError as error:
                    log.warning("cannot fsync the append-only file: %s", error)
                if self.aof.wants_rewrite():
                    await self.rewrite()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client = Client(f"{peer[0]}:{peer[1]}" if peer else "?")
        self.clients[client.id] = client
        self.connections_received += 1
        parser = RequestParser()
        try:
            while not client.closing:
                data = await reader.read(READ_CHUNK)
                if not data:
                    break
                try:
                    commands = parser.feed(data)
                except ProtocolError as error:
                    writer.write(encode(Error(f"ERR Protocol error: {error}")))
                    break
                out = bytearray()
                for command in commands:
                    reply = self.execute(client, command)
                    if isinstance(reply, Blocked):
                        writer.write(out)
                        out = bytearray()
                        reply = await self._wait(reply)
                    out += encode(reply, client.resp3)
                    if client.closing:
                        break
                self.aof.flush()  # to the OS before the client hears OK (fsynced within a second)
                writer.write(out)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.clients.pop(client.id, None)
            try:
                await writer.drain()
                writer.close()
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    async def _wait(self, blocked: Blocked) -> Reply:
        deadline = None if blocked.timeout_ms == 0 else time.monotonic() + blocked.timeout_ms / 1000
        while True:
            event = self.stream_added
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                return None
            reply = blocked.retry()
            if reply is not None:
                return reply

    def _stream_added(self) -> None:
        event, self.stream_added = self.stream_added, asyncio.Event()
        event.set()

    # --- commands ---

    def execute(self, client: Client, command: list[bytes]) -> Reply | Blocked:
        name = command[0]
        spec = COMMANDS.get(name)  # clients send names in capitals: most lookups need no upper()
        if spec is None:
            name = name.upper()
            spec = COMMANDS.get(name)
        client.last_command = name
        self.commands_processed += 1
        if spec is None:
            args = " ".join(f"'{word.decode('utf-8', 'replace')[:64]}'" for word in command[1:4])
            return Error(f"ERR unknown command '{command[0].decode('utf-8', 'replace')[:64]}', "
                         f"with args beginning with: {args}")
        handler, arity = spec
        if (arity >= 0 and len(command) != arity) or (arity < 0 and len(command) < -arity):
            return Error(f"ERR wrong number of arguments for '{name.decode().lower()}' command")
        if self.settings.requirepass and not client.authenticated and name not in NO_AUTH_NEEDED:
            return Error("NOAUTH Authentication required.")
        try:
            return handler(self, client, command[1:])
        except StoreError as error:
            text = str(error)
            return Error(text if text.split(" ", 1)[0].isupper() else "ERR " + text)

    # connection

    def cmd_ping(self, client: Client, args: list[bytes]) -> Reply:
        if len(args) > 1:
            return Error("ERR wrong number of arguments for 'ping' command")
        return args[0] if args else Simple("PONG")

    def cmd_echo(self, client: Client, args: list[bytes]) -> Reply:
        return args[0]

    def cmd_quit(self, client: Client, args: list[bytes]) -> Reply:
        client.closing = True
        return OK

    def cmd_select(self, client: Client, args: list[bytes]) -> Reply:
        index = integer(args[0])
        return OK if index == 0 else Error("ERR DB index is out of range")

    def cmd_auth(self, client: Client, args: list[bytes]) -> Reply:
        if len(args) > 2:
            return Error("ERR syntax error")
        return self._authenticate(client, args[0] if len(args) == 2 else b"default", args[-1])

    def _authenticate(self, client: Client, user: bytes, password: bytes) -> Reply:
        if not self.settings.requirepass:
            return Error("ERR AUTH <password> called without any password configured for the default user. "
                         "Are you sure your configuration is correct?")
        if user != b"default" or not hmac.compare_digest(password, self.settings.requirepass.encode()):
            return Error("WRONGPASS invalid username-password pair or user is disabled.")
        client.authenticated = True
        return OK

    def cmd_hello(self, client: Client, args: list[bytes]) -> Reply:
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
                reply = self._authenticate(client, rest[1], rest[2])
                if isinstance(reply, Error):
                    return reply
                rest = rest[3:]
            elif option == b"SETNAME" and len(rest) >= 2:
                client.name = rest[1]
                rest = rest[2:]
            else:
                return Error(f"ERR Syntax error in HELLO option '{rest[0].decode('utf-8', 'replace')}'")
        if self.settings.requirepass and not client.authenticated:
            return Error("NOAUTH HELLO must be called with the client already authenticated, otherwise the "
                         "HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and "
                         "select the RESP protocol version at the same time")
        client.resp3 = version == 3
        return {"server": "redis", "version": REDIS_VERSION, "proto": version, "id": client.id,
                "mode": "standalone", "role": "master", "modules": []}

    def cmd_client(self, client: Client, args: list[bytes]) -> Reply:
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
            return self._client_line(client)
        if sub == b"LIST":
            return "".join(self._client_line(other) for other in self.clients.values())
        if sub == b"SETINFO" and len(args) == 3:
            if args[1].upper() == b"LIB-NAME":
                client.library = args[2]
            return OK
        return Error(f"ERR unknown subcommand or wrong number of arguments for '{sub.decode('utf-8', 'replace')}'")

    def _client_line(self, client: Client) -> str:
        age = int(time.monotonic() - client.created)
        return (f"id={client.id} addr={client.address} name={client.name.decode('utf-8', 'replace')} age={age} "
                f"db=0 resp={3 if client.resp3 else 2} cmd={client.last_command.decode().lower()} "
                f"lib-name={client.library.decode('utf-8', 'replace')}\n")

    def cmd_command(self, client: Client, args: list[bytes]) -> Reply:
        sub = args[0].upper() if args else b""
        if sub == b"COUNT":
            return len(COMMANDS)
        if sub == b"DOCS":
            return {}
        if sub == b"INFO":
            return [command_info(name) if name.upper() in COMMANDS else None for name in args[1:]]
        if sub == b"":
            return [command_info(name) for name in COMMANDS]
        return Error(f"ERR unknown subcommand '{sub.decode('utf-8', 'replace')}'")

    def cmd_config(self, client: Client, args: list[bytes]) -> Reply:
        if args[0].upper() != b"GET" or len(args) < 2:
            return Error("ERR CONFIG: only CONFIG GET is supported by ARCA")
        values = {"maxmemory": str(self.settings.max_bytes), "maxmemory-policy": "allkeys-lru",
                  "appendonly": "yes", "appendfsync": "everysec", "save": "", "databases": "1",
                  "requirepass": "", "port": str(self.settings.port)}
        found: dict[str, str] = {}
        for pattern in args[1:]:
            for key, value in values.items():
                if fnmatch.fnmatchcase(key, pattern.decode("utf-8", "replace").lower()):
                    found[key] = value
        return found

    def cmd_info(self, client: Client, args: list[bytes]) -> Reply:
        aof = self.aof
        sections = {
            "server": {"redis_version": REDIS_VERSION, "arca_version": __version__, "redis_mode": "standalone",
                       "os": os.uname().sysname, "process_id": os.getpid(), "tcp_port": self.settings.port,
                       "uptime_in_seconds": int(time.time() - self.started)},
            "clients": {"connected_clients": len(self.clients)},
            "memory": {"used_memory": self.keyspace.used_bytes, "maxmemory": self.settings.max_bytes,
                       "maxmemory_policy": "allkeys-lru"},
            "persistence": {"loading": 0, "aof_enabled": 1, "aof_rewrite_in_progress": int(aof._rewrite_tail
                                                                                          is not None),
                            "aof_rewrites": aof.rewrites, "aof_current_size": aof.size(),
                            "aof_fsynced_size": aof.synced_size, "aof_base_size": aof.base_size},
            "stats": {"total_connections_received": self.connections_received,
                      "total_commands_processed": self.commands_processed,
                      "expired_keys": self.keyspace.expired, "evicted_keys": self.keyspace.evicted},
            "keyspace": {"db0": f"keys={len(self.keyspace)},expires={self.keyspace.expiring()},avg_ttl=0"}
            if len(self.keyspace) else {},
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

    # keys

    def cmd_dbsize(self, client: Client, args: list[bytes]) -> Reply:
        return len(self.keyspace)

    def cmd_flushdb(self, client: Client, args: list[bytes]) -> Reply:
        if args and (len(args) > 1 or args[0].upper() not in (b"ASYNC", b"SYNC")):
            return Error("ERR syntax error")
        self.keyspace.clear()
        self._log(b"FLUSHDB")
        return OK

    def cmd_get(self, client: Client, args: list[bytes]) -> Reply:
        return self.keyspace.get(args[0])

    def cmd_mget(self, client: Client, args: list[bytes]) -> Reply:
        values: list[bytes | None] = []
        for key in args:
            entry = self.keyspace.get_entry(key)
            values.append(entry.value if entry is not None and isinstance(entry.value, bytes) else None)
        return values

    def cmd_set(self, client: Client, args: list[bytes]) -> Reply:
        if len(args) == 2:  # the common case, without options
            self.keyspace.set(args[0], args[1], None)
            self._log(b"SET", args[0], args[1])
            return OK
        key, value, options = args[0], args[1], [option.upper() for option in args[2:]]
        condition, give_old, keep_ttl, expires_at = None, False, False, None
        i = 0
        while i < len(options):
            option = options[i]
            if option in (b"NX", b"XX") and condition is None:
                condition = option
            elif option == b"GET":
                give_old = True
            elif option == b"KEEPTTL" and expires_at is None:
                keep_ttl = True
            elif option in (b"EX", b"PX", b"EXAT", b"PXAT") and expires_at is None and not keep_ttl \
                    and i + 1 < len(options):
                amount = integer(args[2 + i + 1])
                if amount <= 0:
                    return Error("ERR invalid expire time in 'set' command")
                expires_at = {b"EX": now_ms() + amount * 1000, b"PX": now_ms() + amount,
                              b"EXAT": amount * 1000, b"PXAT": amount}[option]
                i += 1
            else:
                return Error("ERR syntax error")
            i += 1
        entry = self.keyspace.get_entry(key)
        if give_old and entry is not None and isinstance(entry.value, Stream):
            raise StoreError("WRONGTYPE Operation against a key holding the wrong kind of value")
        old = entry.value if entry is not None else None
        if (condition == b"NX" and entry is not None) or (condition == b"XX" and entry is None):
            return old if give_old else None
        if keep_ttl and entry is not None:
            expires_at = entry.expires_at
        self.keyspace.set(key, value, expires_at)
        self._log(b"SET", key, value, *((b"PXAT", expires_at) if expires_at is not None else ()))
        return old if give_old else OK

    def cmd_mset(self, client: Client, args: list[bytes]) -> Reply:
        if len(args) % 2:
            return Error("ERR wrong number of arguments for 'mset' command")
        for key, value in zip(args[::2], args[1::2]):
            self.keyspace.set(key, value, None)
        self._log(b"MSET", *args)
        return OK

    def cmd_del(self, client: Client, args: list[bytes]) -> Reply:
        removed = [key for key in args if self.keyspace.delete(key)]
        if removed:
            self._log(b"DEL", *removed)
        return len(removed)

    def cmd_exists(self, client: Client, args: list[bytes]) -> Reply:
        return sum(1 for key in args if self.keyspace.get_entry(key) is not None)

    def cmd_type(self, client: Client, args: list[bytes]) -> Reply:
        entry = self.keyspace.get_entry(args[0])
        return Simple("none" if entry is None else "stream" if isinstance(entry.value, Stream) else "string")

    def cmd_expire(self, client: Client, args: list[bytes]) -> Reply:
        return self._expire(args, 1000, relative=True)

    def cmd_pexpire(self, client: Client, args: list[bytes]) -> Reply:
        return self._expire(args, 1, relative=True)

    def cmd_expireat(self, client: Client, args: list[bytes]) -> Reply:
        return self._expire(args, 1000, relative=False)

    def cmd_pexpireat(self, client: Client, args: list[bytes]) -> Reply:
        return self._expire(args, 1, relative=False)

    def _expire(self, args: list[bytes], unit_ms: int, relative: bool) -> Reply:
        key, amount, options = args[0], integer(args[1]), {option.upper() for option in args[2:]}
        if not options <= {b"NX", b"XX", b"GT", b"LT"} or len(options) != len(args) - 2 or \
                (b"NX" in options and len(options) > 1) or {b"GT", b"LT"} <= options:
            return Error("ERR NX and XX, GT or LT options at the same time are not compatible")
        entry = self.keyspace.get_entry(key)
        if entry is None:
            return 0
        deadline = (now_ms() if relative else 0) + amount * unit_ms
        current = entry.expires_at
        if (b"NX" in options and current is not None) or (b"XX" in options and current is None) or \
                (b"GT" in options and (current is None or deadline <= current)) or \
                (b"LT" in options and current is not None and deadline >= current):
            return 0
        if deadline <= now_ms():
            self.keyspace.delete(key)
            self._log(b"DEL", key)
            return 1
        entry.expires_at = deadline
        self._log(b"PEXPIREAT", key, deadline)
        return 1

    def cmd_ttl(self, client: Client, args: list[bytes]) -> Reply:
        left = self._left_ms(args[0])
        return left if left < 0 else (left + 500) // 1000

    def cmd_pttl(self, client: Client, args: list[bytes]) -> Reply:
        return self._left_ms(args[0])

    def _left_ms(self, key: bytes) -> int:
        entry = self.keyspace.get_entry(key)
        if entry is None:
            return -2
        return -1 if entry.expires_at is None else max(0, entry.expires_at - now_ms())

    def cmd_persist(self, client: Client, args: list[bytes]) -> Reply:
        entry = self.keyspace.get_entry(args[0])
        if entry is None or entry.expires_at is None:
            return 0
        entry.expires_at = None
        self._log(b"PERSIST", args[0])
        return 1

    def cmd_keys(self, client: Client, args: list[bytes]) -> Reply:
        """Every live key matching the pattern (SCAN is the way for large keyspaces, as in Redis)."""
        return self.keyspace.scan(0, len(self.keyspace) + 1, args[0], None)[1]

    def cmd_scan(self, client: Client, args: list[bytes]) -> Reply:
        cursor = integer(args[0], "ERR invalid cursor")
        pattern, count, kind = None, 10, None
        rest = args[1:]
        while rest:
            option = rest[0].upper()
            if len(rest) < 2:
                return Error("ERR syntax error")
            if option == b"MATCH":
                pattern = rest[1]
            elif option == b"COUNT":
                count = integer(rest[1])
                if count < 1:
                    return Error("ERR syntax error")
            elif option == b"TYPE":
                kind = rest[1]
            else:
                return Error("ERR syntax error")
            rest = rest[2:]
        following, keys = self.keyspace.scan(cursor, count, pattern, kind)
        return [str(following).encode(), keys]

    # streams

    def cmd_xadd(self, client: Client, args: list[bytes]) -> Reply:
        key, rest = args[0], args[1:]
        create, max_length, min_id = True, None, None
        while rest and rest[0].upper() in (b"NOMKSTREAM", b"MAXLEN", b"MINID"):
            option = rest[0].upper()
            if option == b"NOMKSTREAM":
                create, rest = False, rest[1:]
                continue
            rest = rest[1:]
            if rest and rest[0] in (b"=", b"~"):
                rest = rest[1:]
            if not rest:
                return Error("ERR syntax error")
            if option == b"MAXLEN":
                max_length = integer(rest[0])
                if max_length < 0:
                    return Error("ERR The MAXLEN argument must be >= 0.")
            else:
                min_id = parse_id(rest[0])
            rest = rest[1:]
            if rest and rest[0].upper() == b"LIMIT" and len(rest) >= 2:
                rest = rest[2:]
        if len(rest) < 3 or len(rest) % 2 == 0:
            return Error("ERR wrong number of arguments for 'xadd' command")
        stream = self.keyspace.stream(key, create)
        if stream is None:
            return None
        stream_id = self._new_id(stream, rest[0])
        pairs = list(rest[1:])
        stream.ids.append(stream_id)
        stream.fields.append(pairs)
        stream.last_id = stream_id
        added = fields_size(pairs)
        stream.size += added
        removed_size = stream.size
        if max_length is not None:
            stream.trim(max_length)
        if min_id is not None:
            self._trim_min_id(stream, min_id)
        self.keyspace.stream_grew(key, added - (removed_size - stream.size))
        trim = (b"MAXLEN", max_length) if max_length is not None else (b"MINID", format_id(min_id)) \
            if min_id is not None else ()
        self._log(b"XADD", key, *trim, format_id(stream_id), *pairs)
        self._stream_added()
        return format_id(stream_id)

    @staticmethod
    def _new_id(stream: Stream, text: bytes) -> StreamId:
        last = stream.last_id
        if text == b"*":
            ms = max(now_ms(), last[0])
            return (ms, last[1] + 1) if ms == last[0] else (ms, 0)
        if text.endswith(b"-*"):
            ms = parse_id(text[:-2])[0]
            candidate = (ms, last[1] + 1) if ms == last[0] else (ms, 0 if ms else 1)
        else:
            candidate = parse_id(text)
        if candidate == (0, 0):
            raise StoreError("ERR The ID specified in XADD must be greater than 0-0")
        if candidate <= last:
            raise StoreError("ERR The ID specified in XADD is equal or smaller than the target stream top item")
        return candidate

    def _trim_min_id(self, stream: Stream, min_id: StreamId) -> int:
        cut = bisect.bisect_left(stream.ids, min_id)
        return stream.trim(len(stream.ids) - cut) if cut else 0

    def cmd_xsetid(self, client: Client, args: list[bytes]) -> Reply:
        stream = self.keyspace.stream(args[0], create=False)
        if stream is None:
            return Error("ERR no such key")
        last = parse_id(args[1])
        if stream.ids and last < stream.ids[-1]:
            return Error("ERR The ID specified in XSETID is smaller than the target stream top item")
        stream.last_id = last
        self._log(b"XSETID", args[0], args[1])
        return OK

    def cmd_xlen(self, client: Client, args: list[bytes]) -> Reply:
        stream = self.keyspace.stream(args[0], create=False)
        return len(stream.ids) if stream is not None else 0

    def cmd_xtrim(self, client: Client, args: list[bytes]) -> Reply:
        key, rest = args[0], args[1:]
        strategy = rest[0].upper()
        rest = rest[1:]
        if rest and rest[0] in (b"=", b"~"):
            rest = rest[1:]
        if strategy not in (b"MAXLEN", b"MINID") or not rest:
            return Error("ERR syntax error")
        stream = self.keyspace.stream(key, create=False)
        if stream is None:
            return 0
        before = stream.size
        if strategy == b"MAXLEN":
            length = integer(rest[0])
            if length < 0:
                return Error("ERR The MAXLEN argument must be >= 0.")
            removed = stream.trim(length)
        else:
            removed = self._trim_min_id(stream, parse_id(rest[0]))
        if removed:
            self.keyspace.stream_grew(key, stream.size - before)
            self._log(b"XTRIM", key, strategy, rest[0])
        return removed

    def cmd_xrange(self, client: Client, args: list[bytes]) -> Reply:
        key, start, end = args[0], args[1], args[2]
        count = None
        if len(args) == 5 and args[3].upper() == b"COUNT":
            count = integer(args[4])
        elif len(args) != 3:
            return Error("ERR syntax error")
        stream = self.keyspace.stream(key, create=False)
        if stream is None or (count is not None and count <= 0):
            return []
        low = (0, 0) if start == b"-" else bound(start, low=True)
        high = (2**64 - 1, 2**64 - 1) if end == b"+" else bound(end, low=False)
        return entries(stream, low, high, count)

    def cmd_xread(self, client: Client, args: list[bytes]) -> Reply | Blocked:
        count, block, rest = None, None, args
        while rest and rest[0].upper() in (b"COUNT", b"BLOCK"):
            if len(rest) < 2:
                return Error("ERR syntax error")
            value = integer(rest[1], "ERR timeout is not an integer or out of range")
            if rest[0].upper() == b"COUNT":
                count = value
            else:
                if value < 0:
                    return Error("ERR timeout is negative")
                block = value
            rest = rest[2:]
        if not rest or rest[0].upper() != b"STREAMS" or len(rest) < 3 or len(rest) % 2 == 0:
            return Error("ERR Unbalanced 'xread' list of streams: for each stream key an ID or '$' must be "
                         "specified.")
        keys = rest[1:1 + (len(rest) - 1) // 2]
        starts = []
        for key, text in zip(keys, rest[1 + len(keys):]):
            stream = self.keyspace.stream(key, create=False)
            if text == b"$":
                starts.append(stream.last_id if stream is not None else (0, 0))
            else:
                starts.append(parse_id(text))

        def read() -> Reply:
            found = []
            for key, after in zip(keys, starts):
                stream = self.keyspace.stream(key, create=False)
                if stream is None:
                    continue
                low = (after[0], after[1] + 1)
                got = entries(stream, low, (2**64 - 1, 2**64 - 1), count)
                if got:
                    found.append([key, got])
            if not found:
                return None
            return {key: got for key, got in found} if client.resp3 else found

        reply = read()
        if reply is None and block is not None:
            return Blocked(read, block)
        return reply


def integer(text: bytes, message: str = "ERR value is not an integer or out of range") -> int:
    try:
        value = int(text)
    except ValueError:
        raise StoreError(message) from None
    if not -2**63 <= value < 2**63:
        raise StoreError(message)
    return value


def bound(text: bytes, low: bool) -> StreamId:
    """An XRANGE bound: `ms-seq`, `ms` (the whole millisecond), `(id` (exclusive)."""
    exclusive = text.startswith(b"(")
    if exclusive:
        text = text[1:]
    stream_id = parse_id(text, 0 if low else 2**64 - 1)
    if exclusive:
        stream_id = (stream_id[0], stream_id[1] + 1) if low else (stream_id[0], stream_id[1] - 1)
    return stream_id


def entries(stream: Stream, low: StreamId, high: StreamId, count: int | None) -> list:
    start = bisect.bisect_left(stream.ids, low)
    found = []
    for index in range(start, len(stream.ids)):
        if stream.ids[index] > high or (count is not None and len(found) >= count):
            break
        found.append([format_id(stream.ids[index]), list(stream.fields[index])])
    return found


# name: (handler, arity as Redis states it: exact when >= 0, at least -arity when < 0)
COMMANDS: dict[bytes, tuple[Callable[[Arca, Client, list[bytes]], Reply | Blocked], int]] = {
    b"PING": (Arca.cmd_ping, -1), b"ECHO": (Arca.cmd_echo, 2), b"QUIT": (Arca.cmd_quit, -1),
    b"SELECT": (Arca.cmd_select, 2), b"AUTH": (Arca.cmd_auth, -2), b"HELLO": (Arca.cmd_hello, -1),
    b"CLIENT": (Arca.cmd_client, -2), b"COMMAND": (Arca.cmd_command, -1), b"CONFIG": (Arca.cmd_config, -2),
    b"INFO": (Arca.cmd_info, -1), b"DBSIZE": (Arca.cmd_dbsize, 1), b"FLUSHDB": (Arca.cmd_flushdb, -1),
    b"FLUSHALL": (Arca.cmd_flushdb, -1), b"GET": (Arca.cmd_get, 2), b"SET": (Arca.cmd_set, -3),
    b"MGET": (Arca.cmd_mget, -2), b"MSET": (Arca.cmd_mset, -3), b"DEL": (Arca.cmd_del, -2),
    b"UNLINK": (Arca.cmd_del, -2), b"EXISTS": (Arca.cmd_exists, -2), b"TYPE": (Arca.cmd_type, 2),
    b"EXPIRE": (Arca.cmd_expire, -3), b"PEXPIRE": (Arca.cmd_pexpire, -3), b"EXPIREAT": (Arca.cmd_expireat, -3),
    b"PEXPIREAT": (Arca.cmd_pexpireat, -3), b"TTL": (Arca.cmd_ttl, 2), b"PTTL": (Arca.cmd_pttl, 2),
    b"PERSIST": (Arca.cmd_persist, 2), b"SCAN": (Arca.cmd_scan, -2), b"KEYS": (Arca.cmd_keys, 2),
    b"XADD": (Arca.cmd_xadd, -5),
    b"XRANGE": (Arca.cmd_xrange, -4), b"XREAD": (Arca.cmd_xread, -4), b"XLEN": (Arca.cmd_xlen, 2),
    b"XTRIM": (Arca.cmd_xtrim, -4), b"XSETID": (Arca.cmd_xsetid, 3),
}


def command_info(name: bytes) -> list:
    """COMMAND's description of one command: name, arity, flags, first key, last key, key step."""
    arity = COMMANDS[name.upper()][1]
    keyless = name.upper() in (b"PING", b"ECHO", b"QUIT", b"SELECT", b"AUTH", b"HELLO", b"CLIENT", b"COMMAND",
                               b"CONFIG", b"INFO", b"DBSIZE", b"FLUSHDB", b"FLUSHALL", b"SCAN", b"KEYS",
                               b"XREAD")
    return [name.lower(), arity, [], 0 if keyless else 1, 0 if keyless else (-1 if arity < 0 and name.upper() in (
        b"MGET", b"DEL", b"UNLINK", b"EXISTS") else 1), 0 if keyless else 1]


def run(settings: ArcaSettings, on_ready: Callable[[int], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; the log is fsynced on the way out."""
    async def main() -> None:
        arca = Arca(settings)
        task = asyncio.create_task(arca.serve(on_ready))
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass
        log.info("ARCA stopped; the append-only file is synced")

    asyncio.run(main())
    return 0
