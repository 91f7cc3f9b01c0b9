"""The cache's folders on disk, opened so that no other user can steer where its bytes go.

A tensor server's cache holds its tensors byte for byte, and a server that trusts an entry fills
a tensor from it. So the folder must be the server's own: another user who could write in it
could plant a symlink in place of a fan-out folder and redirect the server's writes (a root
server would then write a file of chosen content wherever the link points), and one who could
read it would read the tensors without the server's token.

* The root must be a folder owned by the server's user and writable by no one else (neither
  group nor others); otherwise :func:`open_root` refuses it with a CacheError saying what to
  fix. The way to it must be the user's or root's too (:func:`check_path`): every folder above
  it owned by the user or root and writable by no one else unless sticky (as /tmp), and every
  symlink on the way owned by the user or root, so another user cannot steer the root itself
  elsewhere. A root made here is made :data:`FOLDER_MODE`; one that exists is left as it is
  (its fan-out folders and entries are narrowed, which is what keeps their bytes private).
* Everything below the root is reached by descriptor, ``openat``-style: each operation opens the
  root (checked again, and refused if another folder took its place), then the fan-out folder
  and the entry relative to it with ``O_NOFOLLOW``, so a name swapped for a link after a check
  cannot redirect anything. No descriptor is held between operations. A fan-out folder that is a
  link is removed (the link itself, never what it points to) and made afresh before anything
  is written there; one that is a file or another user's folder is left alone and nothing is
  cached under its name (the writer fails); a read treats either as missing. Nothing but a
  link and the cache's own temporary files is ever removed, so a root that holds other data
  loses none of it.
* Folders are made :data:`FOLDER_MODE` (0700) and entries :data:`ENTRY_MODE` (0600), set with
  ``fchmod`` after creation so that the umask can neither widen nor narrow them.
"""

from __future__ import annotations

import errno
import os
import stat

from weightlift.errors import CacheError

__all__ = [
    "FOLDER_MODE",
    "ENTRY_MODE",
    "check_root",
    "check_path",
    "open_root",
    "reopen_root",
    "open_folder",
    "remove_tree",
    "names_in",
    "reason",
]

#: Mode of the cache root and of every fan-out folder: the server's user only.
FOLDER_MODE = 0o700
#: Mode of every entry and temporary file: read and write for the server's user only.
ENTRY_MODE = 0o600

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# what opening a link or a non-folder with O_DIRECTORY | O_NOFOLLOW fails with
_NOT_A_FOLDER = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EMLINK})


def reason(exc: OSError) -> str:
    """The human part of an OSError: its strerror, or its text."""
    return exc.strerror or str(exc)


def _who(mode: int) -> str:
    return " and ".join(w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others")) if mode & bit)


def check_root(root: str, st: os.stat_result, euid: int) -> None:
    """CacheError unless ``st`` (of the folder ``root``) is a folder of ``euid``'s that only it can write."""
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"cache folder {root} is not a folder")
    if st.st_uid != euid:
        raise CacheError(
            f"cache folder {root} is owned by uid {st.st_uid}, not by this server's user (uid {euid}): "
            f"another user could read the cached tensors or plant links in it; use a folder of your own "
            f"(or chown {euid} it and chmod 700 it)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"cache folder {root} is writable by {_who(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"another user could plant links or entries in it; chmod 700 it, or use a folder only you can write"
        )


def check_path(root: str, euid: int) -> None:
    """CacheError unless the way to ``root`` is the user's or root's: each symlink on it owned by
    ``euid`` or root, and each folder above the root owned by ``euid`` or root and writable by no
    one else unless sticky. Components that do not exist yet are made by this user."""
    todo = [p for p in os.path.abspath(root).split(os.sep) if p]
    cur, hops = os.sep, 0
    while todo:
        nxt = os.path.join(cur, todo.pop(0))
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise CacheError(f"cannot check the way to cache folder {root} at {nxt}: {reason(exc)}") from exc
        if not todo and not stat.S_ISLNK(st.st_mode):
            return  # the root itself: check_root's to judge
        if st.st_uid not in (euid, 0):
            what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder"
            raise CacheError(
                f"the way to cache folder {root} goes through {nxt}, {what} owned by uid {st.st_uid}: "
                f"that user could move the cache elsewhere; use a folder whose every parent is yours or root's"
            )
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > 40:
                raise CacheError(f"the way to cache folder {root} has too many symbolic links")
            target = os.readlink(nxt)
            todo = [p for p in target.split(os.sep) if p] + todo
            cur = os.sep if target.startswith(os.sep) else cur
            continue
        if todo and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise CacheError(
                f"the way to cache folder {root} goes through {nxt}, writable by {_who(st.st_mode)} and not "
                f"sticky: another user could replace what lies below it; use a folder whose every parent only "
                f"you or root can write"
            )
        cur = nxt


def open_root(root: str) -> int:
    """Open the cache folder ``root`` (made, mode 0700, if missing) and return its descriptor.

    CacheError if it cannot be made or opened, or if :func:`check_path` or :func:`check_root`
    refuses it.
    """
    euid = os.geteuid()
    check_path(root, euid)
    parent = os.path.dirname(root)
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(root, FOLDER_MODE)
            made = True
        except FileExistsError:
            made = False
        fd = os.open(root, _O_DIR)
    except OSError as exc:
        raise CacheError(f"cannot create cache folder {root}: {reason(exc)}") from exc
    try:
        st = os.fstat(fd)
        check_root(root, st, euid)
        if made and stat.S_IMODE(st.st_mode) != FOLDER_MODE:
            os.fchmod(fd, FOLDER_MODE)
    except CacheError:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise CacheError(f"cannot secure cache folder {root}: {reason(exc)}") from exc
    return fd


def reopen_root(root: str, ident: tuple[int, int]) -> int:
    """Open the root again for one operation: CacheError unless it is still the folder (device,
    inode) ``ident`` that :func:`open_root` opened, and still passes :func:`check_root`."""
    try:
        fd = os.open(root, _O_DIR)
    except OSError as exc:
        raise CacheError(f"cannot open cache folder {root}: {reason(exc)}") from exc
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != ident:
            raise CacheError(f"cache folder {root} was replaced by another folder since the cache opened")
        check_root(root, st, os.geteuid())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir(name: str, parent: int) -> int:
    return os.open(name, _O_DIR | _O_NOFOLLOW, dir_fd=parent)


def _owned(fd: int, euid: int) -> bool:
    """Whether the open folder ``fd`` is ``euid``'s; narrows it to FOLDER_MODE if it is."""
    st = os.fstat(fd)
    if st.st_uid != euid:
        return False
    if stat.S_IMODE(st.st_mode) != FOLDER_MODE:
        os.fchmod(fd, FOLDER_MODE)
    return True


def open_folder(root_fd: int, name: str, *, create: bool) -> int | None:
    """The descriptor of the fan-out folder ``name`` under the root, never through a link.

    Without ``create``: None where there is no usable folder (missing, a link, a file, another
    user's). With ``create``: a link in the way is removed (the link itself, never what it points
    to) and a folder of mode 0700 is made; OSError if that fails or if a file or another user's
    folder holds the name (left as it is).
    """
    euid = os.geteuid()
    for _ in range(3):
        try:
            fd = _open_dir(name, root_fd)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as exc:
            if not create:
                return None
            if exc.errno not in _NOT_A_FOLDER:
                raise
            if not stat.S_ISLNK(os.lstat(name, dir_fd=root_fd).st_mode):
                raise OSError(
                    errno.EEXIST, f"{name} under the cache folder is not a folder; nothing is cached there"
                ) from None
            os.unlink(name, dir_fd=root_fd)  # a link where the folder goes: the link goes, not its target
        else:
            try:
                if _owned(fd, euid):
                    return fd
            except OSError:
                os.close(fd)
                if not create:
                    return None
                raise
            os.close(fd)
            if not create:
                return None
            raise OSError(
                errno.EACCES, f"{name} under the cache folder is another user's folder; nothing is cached there"
            )
        try:
            os.mkdir(name, FOLDER_MODE, dir_fd=root_fd)
        except FileExistsError:
            pass  # made meanwhile by another writer: open that one
    raise OSError(errno.EAGAIN, f"fan-out folder {name} keeps changing")


def names_in(fd: int) -> list[str]:
    """The names in the open folder ``fd`` (empty if it cannot be listed)."""
    try:
        return os.listdir(fd)
    except OSError:
        return []


def remove_tree(parent: int, name: str) -> None:
    """Remove ``name`` under the open folder ``parent`` and, if it is a folder, all it holds.

    Walks by descriptor without following links, so a link anywhere inside is removed itself,
    never what it points to. Best effort: what cannot be removed stays.
    """
    try:
        os.unlink(name, dir_fd=parent)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.EISDIR, errno.EPERM):
            return
    try:
        fd = _open_dir(name, parent)
    except OSError:
        return
    try:
        for inner in names_in(fd):
            remove_tree(fd, inner)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent)
    except OSError:
        pass
