"""The command table (each name in capitals to its handler and its arity as Redis states it: exact when
>= 0, at least -arity when < 0) and `execute`, which runs one command as Redis would: its arity and
authentication checked, a StoreError answered as an error reply."""

from __future__ import annotations

from reame.arca import connection_commands as C
from reame.arca import corpus_commands as L4
from reame.arca import key_commands as K
from reame.arca import stream_commands as S
from reame.arca.resp import Error, Reply
from reame.arca.state import ArcaState
from reame.arca.store import StoreError
from reame.arca.types import Blocked, Client

NO_AUTH_NEEDED = {b"AUTH", b"HELLO", b"QUIT"}

COMMANDS = {
    b"PING": (C.cmd_ping, -1), b"ECHO": (C.cmd_echo, 2), b"QUIT": (C.cmd_quit, -1),
    b"SELECT": (C.cmd_select, 2), b"AUTH": (C.cmd_auth, -2), b"HELLO": (C.cmd_hello, -1),
    b"CLIENT": (C.cmd_client, -2), b"COMMAND": (C.cmd_command, -1), b"CONFIG": (C.cmd_config, -2),
    b"INFO": (C.cmd_info, -1), b"DBSIZE": (K.cmd_dbsize, 1), b"FLUSHDB": (K.cmd_flushdb, -1),
    b"FLUSHALL": (K.cmd_flushdb, -1), b"GET": (K.cmd_get, 2), b"SET": (K.cmd_set, -3),
    b"MGET": (K.cmd_mget, -2), b"MSET": (K.cmd_mset, -3), b"DEL": (K.cmd_del, -2),
    b"UNLINK": (K.cmd_del, -2), b"EXISTS": (K.cmd_exists, -2), b"TYPE": (K.cmd_type, 2),
    b"EXPIRE": (K.cmd_expire, -3), b"PEXPIRE": (K.cmd_pexpire, -3), b"EXPIREAT": (K.cmd_expireat, -3),
    b"PEXPIREAT": (K.cmd_pexpireat, -3), b"TTL": (K.cmd_ttl, 2), b"PTTL": (K.cmd_pttl, 2),
    b"PERSIST": (K.cmd_persist, 2), b"SCAN": (K.cmd_scan, -2), b"KEYS": (K.cmd_keys, 2),
    b"XADD": (S.cmd_xadd, -5), b"XRANGE": (S.cmd_xrange, -4), b"XREAD": (S.cmd_xread, -4),
    b"XLEN": (S.cmd_xlen, 2), b"XTRIM": (S.cmd_xtrim, -4), b"XSETID": (S.cmd_xsetid, 3),
    b"ARCA.OBSERVE": (L4.cmd_arca_observe, 2), b"ARCA.DRAFT": (L4.cmd_arca_draft, 3),
}


def execute(state: ArcaState, client: Client, command: list[bytes]) -> Reply | Blocked:
    name = command[0]
    spec = COMMANDS.get(name)  # clients send names in capitals: most lookups need no upper()
    if spec is None:
        name = name.upper()
        spec = COMMANDS.get(name)
    client.last_command = name
    state.commands_processed += 1
    if spec is None:
        args = " ".join(f"'{word.decode('utf-8', 'replace')[:64]}'" for word in command[1:4])
        return Error(f"ERR unknown command '{command[0].decode('utf-8', 'replace')[:64]}', "
                     f"with args beginning with: {args}")
    handler, arity = spec
    if (arity >= 0 and len(command) != arity) or (arity < 0 and len(command) < -arity):
        return Error(f"ERR wrong number of arguments for '{name.decode().lower()}' command")
    if state.settings.requirepass and not client.authenticated and name not in NO_AUTH_NEEDED:
        return Error("NOAUTH Authentication required.")
    try:
        return handler(state, client, command[1:])
    except StoreError as error:
        text = str(error)
        return Error(text if text.split(" ", 1)[0].isupper() else "ERR " + text)
