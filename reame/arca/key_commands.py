"""ARCA's key commands: strings, expiry, DEL/EXISTS/TYPE, SCAN/KEYS, DBSIZE, FLUSHDB."""

from __future__ import annotations


from reame.arca.resp import OK, Error, Reply, Simple, set_command
from reame.arca.state import ArcaState
from reame.arca.store import StoreError, Stream, integer, now_ms
from reame.arca.types import Client



MAX_MS = 2**63 - 1  # Redis keeps deadlines in a signed 64-bit count of milliseconds


def deadline_ms(amount: int, unit_ms: int, relative: bool, allow_past: bool = False) -> int | None:
    """The absolute deadline `amount` units of `unit_ms` (from now when `relative`) stand for, or None when
    it is no time Redis can keep (past its 64 bits, or, unless `allow_past`, not after the epoch), which it
    answers "invalid expire time": such a key would otherwise be kept now and refused when the log replays."""
    deadline = amount * unit_ms + (now_ms() if relative else 0)
    if not -MAX_MS <= amount * unit_ms <= MAX_MS or deadline > MAX_MS or (deadline <= 0 and not allow_past):
        return None
    return deadline


def cmd_dbsize(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    return len(state.keyspace)


def cmd_flushdb(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    if args and (len(args) > 1 or args[0].upper() not in (b"ASYNC", b"SYNC")):
        return Error("ERR syntax error")
    state.keyspace.clear()
    state.log(b"FLUSHDB")
    return OK


def cmd_get(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    return state.keyspace.get(args[0])


def cmd_mget(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    values: list[bytes | None] = []
    for key in args:
        entry = state.keyspace.get_entry(key)
        values.append(entry.value if entry is not None and isinstance(entry.value, bytes) else None)
    return values


def cmd_set(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    if len(args) == 2:  # the common case, without options
        state.keyspace.set(args[0], args[1], None)
        state.log_record(set_command(args[0], args[1]))
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
            expires_at = deadline_ms(amount, 1000 if option in (b"EX", b"EXAT") else 1,
                                     relative=option in (b"EX", b"PX"))
            if amount <= 0 or expires_at is None:
                return Error("ERR invalid expire time in 'set' command")
            i += 1
        else:
            return Error("ERR syntax error")
        i += 1
    entry = state.keyspace.get_entry(key)
    old: bytes | None = None  # what GET asked for
    if give_old and entry is not None:
        if isinstance(entry.value, Stream):
            raise StoreError("WRONGTYPE Operation against a key holding the wrong kind of value")
        old = entry.value
    if (condition == b"NX" and entry is not None) or (condition == b"XX" and entry is None):
        return old
    if keep_ttl and entry is not None:
        expires_at = entry.expires_at
    state.keyspace.set(key, value, expires_at)
    state.log(b"SET", key, value, *((b"PXAT", expires_at) if expires_at is not None else ()))
    return old if give_old else OK


def cmd_mset(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    if len(args) % 2:
        return Error("ERR wrong number of arguments for 'mset' command")
    for key, value in zip(args[::2], args[1::2]):
        state.keyspace.set(key, value, None)
    state.log(b"MSET", *args)
    return OK


def cmd_del(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    removed = [key for key in args if state.keyspace.delete(key)]
    if removed:
        state.log(b"DEL", *removed)
    return len(removed)


def cmd_exists(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    return sum(1 for key in args if state.keyspace.get_entry(key) is not None)


def cmd_type(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    entry = state.keyspace.get_entry(args[0])
    return Simple("none" if entry is None else "stream" if isinstance(entry.value, Stream) else "string")


def cmd_expire(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    return _expire(state, args, 1000, relative=True, name="expire")


def cmd_pexpire(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    return _expire(state, args, 1, relative=True, name="pexpire")


def cmd_expireat(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    return _expire(state, args, 1000, relative=False, name="expireat")


def cmd_pexpireat(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    return _expire(state, args, 1, relative=False, name="pexpireat")


def _expire(state: ArcaState, args: list[bytes], unit_ms: int, relative: bool, name: str) -> Reply:
    key, amount, options = args[0], integer(args[1]), {option.upper() for option in args[2:]}
    deadline = deadline_ms(amount, unit_ms, relative, allow_past=True)
    if deadline is None:
        return Error(f"ERR invalid expire time in '{name}' command")
    if not options <= {b"NX", b"XX", b"GT", b"LT"} or len(options) != len(args) - 2 or \
            (b"NX" in options and len(options) > 1) or {b"GT", b"LT"} <= options:
        return Error("ERR NX and XX, GT or LT options at the same time are not compatible")
    entry = state.keyspace.get_entry(key)
    if entry is None:
        return 0
    current = entry.expires_at
    if (b"NX" in options and current is not None) or (b"XX" in options and current is None) or \
            (b"GT" in options and (current is None or deadline <= current)) or \
            (b"LT" in options and current is not None and deadline >= current):
        return 0
    if deadline <= now_ms():
        state.keyspace.delete(key)
        state.log(b"DEL", key)
        return 1
    state.keyspace.set_expiry(key, deadline)
    state.log(b"PEXPIREAT", key, deadline)
    return 1


def cmd_ttl(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    left = _left_ms(state, args[0])
    return left if left < 0 else (left + 500) // 1000


def cmd_pttl(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    return _left_ms(state, args[0])


def _left_ms(state: ArcaState, key: bytes) -> int:
    entry = state.keyspace.get_entry(key)
    if entry is None:
        return -2
    return -1 if entry.expires_at is None else max(0, entry.expires_at - now_ms())


def cmd_persist(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    entry = state.keyspace.get_entry(args[0])
    if entry is None or entry.expires_at is None:
        return 0
    state.keyspace.set_expiry(args[0], None)
    state.log(b"PERSIST", args[0])
    return 1


def cmd_keys(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
    """Every live key matching the pattern (SCAN is the way for large keyspaces, as in Redis)."""
    return state.keyspace.scan(0, len(state.keyspace) + 1, args[0], None)[1]


def cmd_scan(state: ArcaState, client: Client, args: list[bytes]) -> Reply:
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
    following, keys = state.keyspace.scan(cursor, count, pattern, kind)
    return [str(following).encode(), keys]


