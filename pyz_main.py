"""The `__main__.py` of dist/reame.pyz (build_zipapp.py writes PYTHON_TREE and BUNDLE_SHA256 in).

zipimport cannot cache bytecode, so a .pyz compiles every module it imports from
source on every start: 0.4 s of a one-shot prompt for Reame and jinja2. Instead,
the first run extracts the .pyz's Python files once to
<cache>/lib/<PYTHON_TREE>-python/ and compiles them for this interpreter; every
run then imports from there. The directory is named by the files' content hash
and made in a temporary directory renamed into place, like the native libraries
(reame/native.py), so a half-written tree is never used and two first runs
racing are harmless; the bytecode is checked against that hash, not against
file times. A read-only or full cache directory still works: Reame runs from
the .pyz itself, slower, and says so.

Code is run from the cache only if no one else could have written it: the tree
and the native parts are extracted private (umask 077, whatever the user's),
and before anything is imported from them, they, and every directory above
them, must belong to this user (or root) and be writable by no one else (a
sticky directory such as /tmp excepted); what is below a directory no one else
may enter is not walked. Otherwise Reame refuses to start and
says which path and why: a .pyc planted by another local user would run as
whoever runs Reame next.

Only the standard library is imported before the tree is on sys.path.
"""

import os
import sys

# Written in by build_zipapp.py: the sha256 of the .pyz's Python files, and of its native bundle.
PYTHON_TREE = ""
BUNDLE_SHA256 = ""
NATIVE_DIR = "reame_native"  # reame/native.py's BUNDLE_DIR: extracted by reame itself, per machine
COMPILED_MARK = ".compiled"


def cache_root() -> str:
    """As reame/native.py's cache_root, which cannot be imported before the tree is chosen."""
    return os.environ.get("REAME_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "reame")


def tree_directory() -> str:
    return os.path.join(cache_root(), "lib", f"{PYTHON_TREE}-python")


def compiled_mark(directory: str) -> str:
    """The file saying the tree's bytecode for this interpreter and optimisation level is complete."""
    return os.path.join(directory, f"{COMPILED_MARK}-{sys.implementation.cache_tag}-O{sys.flags.optimize}")


def unsafe(path: str, below: bool) -> str:
    """Why code under `path` could have been written by another user ("" if it could not): `path` itself
    and, with `below`, everything under it must be this user's or root's and writable by no one else."""
    import stat

    owners = (os.geteuid(), 0)
    top = os.lstat(path)
    if below and stat.S_ISDIR(top.st_mode) and top.st_uid in owners and not top.st_mode & 0o077:
        return ""  # no one else may even enter it (as this version extracts it): nothing below to check
    entries = [path]
    if below:
        entries += [os.path.join(root, name) for root, dirs, files in os.walk(path) for name in dirs + files]
    for entry in entries:
        info = os.lstat(entry)
        if stat.S_ISLNK(info.st_mode):
            return f"{entry} is a symbolic link"
        if info.st_uid not in owners:
            return f"{entry} belongs to user {info.st_uid}"
        if info.st_mode & 0o022 and not (stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX):
            return f"{entry} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return ""


def unsafe_cache(lib: str) -> str:
    """Why the code Reame would import or load from `lib` (the cache's lib/) could be another user's: a
    directory above it they could replace things in, or this .pyz's tree or native parts not safe."""
    if not os.path.isdir(lib):
        return ""
    directory = os.path.realpath(lib)
    while True:
        problem = unsafe(directory, below=False)
        if problem:
            return problem
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    ours = [name for name in os.listdir(lib) if name.startswith((PYTHON_TREE + "-", BUNDLE_SHA256 + "-"))]
    return next((problem for problem in (unsafe(os.path.join(lib, name), below=True) for name in ours)
                 if problem), "")


def extract(archive: str, directory: str) -> None:
    """The .pyz's Python files (not its native parts, not this file) into `directory`, atomically."""
    import shutil
    import tempfile
    import zipfile

    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".extract-", dir=parent)
    try:
        with zipfile.ZipFile(archive) as bundle:
            for member in bundle.infolist():
                name = member.filename
                if member.is_dir() or name == "__main__.py" or name.startswith(NATIVE_DIR + "/"):
                    continue
                bundle.extract(member, staging)
        try:
            os.rename(staging, directory)
        except OSError:
            if not os.path.isdir(directory):  # another first run won the race: use its tree
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def compile_tree(directory: str) -> None:
    """Bytecode for every module of the tree, for this interpreter. A module that does not compile here
    (a file for another Python version) is left to fail when imported, as it would from the .pyz."""
    import py_compile

    for root, _, files in os.walk(directory):
        for name in files:
            if name.endswith(".py"):
                try:
                    py_compile.compile(os.path.join(root, name), doraise=True,
                                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
                except py_compile.PyCompileError:
                    continue
    with open(compiled_mark(directory), "w"):
        pass


def prepared_tree(archive: str) -> str | None:
    """The directory to import from, extracted and compiled; None (after saying why) when the cache
    cannot hold it."""
    directory = tree_directory()
    mask = os.umask(0o077)  # what is extracted and compiled is this user's alone, whatever their umask
    try:
        if not os.path.isdir(os.path.join(directory, "reame")):
            extract(archive, directory)
        if not os.path.exists(compiled_mark(directory)):
            compile_tree(directory)
    except OSError as error:
        print(f"reame: cannot keep compiled Python in {directory} ({error.strerror or error}); running from "
              "the .pyz, which compiles every module again on every start", file=sys.stderr)
        return None
    finally:
        os.umask(mask)
    return directory


def main() -> None:
    archive = os.path.dirname(os.path.abspath(__file__))
    lib = os.path.dirname(tree_directory())
    try:
        problem = unsafe_cache(lib)
    except OSError as error:
        problem = f"{error.filename}: {error.strerror}"
    if problem:
        print(f"reame: refusing to run code from {lib}: {problem}; another user could have put code there. "
              "Remove it, or set REAME_CACHE to a directory only you can write to.", file=sys.stderr)
        sys.exit(1)
    tree = prepared_tree(archive) if PYTHON_TREE else None
    if tree is not None:
        sys.path.insert(0, tree)
    # The tree comes compiled; nothing imported later (the native parts' zstandard) writes bytecode into the
    # cache under the user's umask, which the check above would then refuse.
    sys.dont_write_bytecode = True
    import runpy

    import reame.native

    reame.native.ARCHIVE = archive  # imported from the tree, it cannot find its .pyz by its loader
    reame.native.BUNDLE_SHA256 = BUNDLE_SHA256 or None
    runpy.run_module("reame", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
