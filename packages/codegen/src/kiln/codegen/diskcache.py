"""Authenticated disk-cache entries: the rules every kiln cache that keeps code it will later run follows (the executor's
kernel cache, the CUDA emulator's host libraries). It lives here, in the lowest layer both of them import.

What an entry is trusted on:
- A secret key kept outside the cache directory: KILN_CACHE_KEY (64 hex digits, for a team or CI that shares a cache on
  purpose), else $XDG_CONFIG_HOME/kiln/cache.key (default ~/.config/kiln/cache.key), 32 random bytes made 0600 on first
  use in a 0700 directory. Every entry carries HMAC-SHA256 over the format, the entry's place (area and name) and all of
  its payload; an entry whose MAC does not verify is never used. Whoever can write the cache but not read the key cannot
  make kiln run their code, nor move a good entry to another kernel's name.
- Directories as ssh and pip keep them: created 0700; a cache directory owned by another user or writable by group or
  others is neither read nor written (one warning, then no disk cache); below the root nothing is reached through a
  symbolic link (descriptor-relative opens with O_NOFOLLOW); an entry is read only when it is a regular file of this user's
  and under a size bound; it is written as a temporary file in its directory, fsynced, then renamed over the old one.
The root itself (KILN_CACHE_DIR, or ~/.cache/kiln) may be a link the user made: its target is what is checked.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import hmac
import json
import mmap
import os
import re
import secrets
import stat
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.codegen import settings
from kiln.ir.errors import CacheError, SettingError

FORMAT = 2  # of the framing; entries of an older kiln (no MAC) are misses
MAX_ENTRY_BYTES = 64 << 20  # an entry larger than this is rejected before it is read
KEY_BYTES = 32
KEY_ENV = settings.CACHE_KEY.name
_BIN_HEAD = b"\x7fkiln-cache-2\n"  # binary entries: this, the 32-byte tag, the payload
_JSON_HEAD, _JSON_SEP = b'{"mac": "', b'", '  # JSON entries: the tag as the object's first member, then the payload's members
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,249}")  # a file name (255 bytes at most), never a path


class CacheKeyError(CacheError, SettingError):
  """KILN_CACHE_KEY does not hold a key."""


class KilnCacheWarning(RuntimeWarning):
  """The disk cache is not used (an unsafe directory or key file), or an entry could not be written; kernels still run."""


class BadEntry(Exception):
  """An entry that exists but is not used (its message says why). The caller builds again and overwrites it."""


def current_uid() -> int:
  """The owner every cache directory, entry and the key file must have (tests patch this to simulate a foreign owner)."""
  return os.geteuid()


def enabled() -> bool: return settings.CACHE.get()


def cache_root() -> Path: return Path(settings.CACHE_DIR.get() or Path.home() / ".cache" / "kiln").expanduser()


def key_path() -> Path:
  base = os.environ.get("XDG_CONFIG_HOME", "")
  return (Path(base) if os.path.isabs(base) else Path.home() / ".config") / "kiln" / "cache.key"


_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(what: str, msg: str) -> None:
  with _warn_lock:
    if what in _warned: return
    _warned.add(what)
  warnings.warn(msg, KilnCacheWarning, stacklevel=4)


# ---- the key ----
class _Unsafe(Exception):
  """A directory or key file that must not be trusted (the message says why)."""


_keys: dict[str, bytes] = {}


def cache_key() -> bytes | None:
  """The MAC key: KILN_CACHE_KEY if set (a malformed one raises CacheKeyError), else the key file, made on first use.
  None when there is no usable key (warned once): the caller runs without the disk cache."""
  if env := settings.CACHE_KEY.get(): return _parse_key(env)  # empty counts as unset (an unresolved CI secret)
  p = key_path()
  if (k := _keys.get(str(p))) is not None: return k
  try: k = _read_or_make_key(p)
  except (_Unsafe, OSError) as e:
    _warn_once(f"key:{p}", f"kiln: no usable disk-cache key at {p} ({e}); running without the disk cache. Fix or remove the file "
                           f"(kiln makes a new one), or set {KEY_ENV}")
    return None
  _keys[str(p)] = k
  return k


@functools.lru_cache(maxsize=4)
def _parse_key(text: str) -> bytes:
  # the messages never echo the value: it is a secret
  if len(text) != 2 * KEY_BYTES:
    raise CacheKeyError(f"{KEY_ENV} must be {2 * KEY_BYTES} hex digits ({KEY_BYTES} bytes, e.g. from `openssl rand -hex 32`); "
                        f"it holds {len(text)} characters")
  try: return bytes.fromhex(text)
  except ValueError: raise CacheKeyError(f"{KEY_ENV} must be hex digits (0-9, a-f); it holds another character") from None


def _read_or_make_key(p: Path) -> bytes:
  d = p.parent
  os.makedirs(d, mode=0o700, exist_ok=True)
  if bad := _dir_problem(os.stat(d), d): raise _Unsafe(bad)  # a link the user made (dotfiles) is fine: its target is checked
  with contextlib.suppress(FileNotFoundError): return _read_key(p)
  tmp = d / f".cache.key.{os.getpid()}.{secrets.token_hex(4)}"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
  try:
    try:
      _write_all(fd, secrets.token_bytes(KEY_BYTES))
      os.fsync(fd)
    finally: os.close(fd)
    try: os.link(tmp, p)  # publish only if absent: two first users end up with the same key
    except FileExistsError: pass
    except OSError:  # a file system without hard links
      if not os.path.lexists(p): os.replace(tmp, p)
  finally:
    with contextlib.suppress(FileNotFoundError): os.unlink(tmp)
  return _read_key(p)


def _read_key(p: Path) -> bytes:
  try: fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
  except OSError as e:
    if e.errno == errno.ELOOP: raise _Unsafe(f"{p} is a symbolic link") from None
    raise
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode): raise _Unsafe(f"{p} is not a regular file")
    if st.st_uid != current_uid(): raise _Unsafe(f"{p} is owned by uid {st.st_uid}, not by this user (uid {current_uid()})")
    if st.st_mode & 0o077: raise _Unsafe(f"{p} is open to other users (mode {stat.S_IMODE(st.st_mode):o}; chmod 600 it)")
    data = _read_at_most(fd, KEY_BYTES + 1)
  finally: os.close(fd)
  if len(data) != KEY_BYTES: raise _Unsafe(f"{p} holds {len(data)} bytes, not {KEY_BYTES}")
  return data


# ---- directories and files ----
def _dir_problem(st: os.stat_result, path: Path) -> str | None:
  if not stat.S_ISDIR(st.st_mode): return f"{path} is not a directory"
  if st.st_uid != current_uid(): return f"{path} is owned by uid {st.st_uid}, not by this user (uid {current_uid()})"
  if st.st_mode & 0o022:
    who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
    return f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
  return None


def _read_at_most(fd: int, limit: int) -> bytes:
  parts, n = [], 0
  while n < limit and (chunk := os.read(fd, min(limit - n, 1 << 20))):
    parts.append(chunk)
    n += len(chunk)
  return b"".join(parts)


def _write_all(fd: int, data: bytes | bytearray) -> None:
  """Every byte of data to fd (the one place entries are written: tests make it fail as a full disk would)."""
  view = memoryview(data)
  while view: view = view[os.write(fd, view):]


def _check_name(name: str) -> None:
  if not _NAME.fullmatch(name): raise CacheError(f"disk-cache name {name!r} is not a plain file name")


def _tag(key: bytes, area: str, name: str, payload: bytes) -> bytes:
  h = hmac.new(key, b"kiln-cache %d\0%s\0%s\0" % (FORMAT, area.encode(), name.encode()), hashlib.sha256)
  h.update(payload)
  return h.digest()


class DiskCache:
  """One area of the disk cache (root/area, e.g. "kernels"), named `what` in messages. Sealed entries (load/store,
  load_json/store_json) are authenticated; read_plain/write_plain keep only the directory rules, for entries that
  decide no code."""

  def __init__(self, area: str, what: str, root: Path | None = None):
    _check_name(area)
    self.area, self.what, self.root = area, what, root if root is not None else cache_root()

  @property
  def path(self) -> Path: return self.root / self.area

  def _unsafe(self, problem: str) -> None:
    _warn_once(f"unsafe:{self.path}", f"kiln: not using the {self.what} at {self.path}: {problem}. A cache directory another user "
                                      f"can write could hand kiln code to run; running without the disk cache (use a directory "
                                      f"of your own, mode 700)")

  def _open_area(self, create: bool) -> int | None:
    """A descriptor of root/area after the directory checks, or None: absent (create False), or not usable (warned once;
    reading only warns about unsafe directories: a write that follows says why it cannot write)."""
    try: return self._open_checked(create)
    except _Unsafe as e: self._unsafe(str(e))
    except OSError as e:
      if create: self._write_failed(e)
    return None

  def _open_checked(self, create: bool) -> int | None:
    if create: os.makedirs(self.root, mode=0o700, exist_ok=True)
    try: rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
      if create: raise
      return None
    try:
      if bad := _dir_problem(os.fstat(rfd), self.root): raise _Unsafe(bad)
      if create:
        with contextlib.suppress(FileExistsError): os.mkdir(self.area, 0o700, dir_fd=rfd)
      try: afd = os.open(self.area, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=rfd)
      except FileNotFoundError:
        if create: raise
        return None
      except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR): raise _Unsafe(f"{self.path} is a symbolic link or not a directory; kiln follows no "
                                                                   f"link inside its cache") from None
        raise
      if bad := _dir_problem(os.fstat(afd), self.path):
        os.close(afd)
        raise _Unsafe(bad)
      return afd
    finally: os.close(rfd)

  def _write_failed(self, e: OSError) -> None:
    _warn_once(f"write:{self.path}:{e.errno}", f"kiln: could not write to the {self.what} at {self.path} ({e}); the kernel "
                                               f"runs, and the next process builds it again")

  def read_plain(self, name: str, max_bytes: int = MAX_ENTRY_BYTES) -> bytes | None:
    """The entry's bytes, or None when it is absent (or the area is not usable). Raises BadEntry for one that is there
    but must not be read: a link, not a regular file, another user's, larger than max_bytes."""
    if (opened := self._open_entry(name, max_bytes)) is None: return None
    fd, _ = opened
    try:
      data = _read_at_most(fd, max_bytes + 1)
      if len(data) > max_bytes: raise BadEntry(f"it grew past the bound of {max_bytes} bytes while being read")
      return data
    finally: os.close(fd)

  def map_plain(self, name: str, max_bytes: int) -> tuple[mmap.mmap, os.stat_result] | None:
    """The entry mapped read-only (no copy: a large entry's pages are read as they are touched) and its stat, under
    read_plain's rules (None when absent; BadEntry for a link, not a regular file, another user's, over max_bytes, empty).
    The caller verifies its contents (its MAC'd description carries their hash)."""
    if (opened := self._open_entry(name, max_bytes)) is None: return None
    fd, st = opened
    try:
      if st.st_size == 0: raise BadEntry("it is empty")
      try: return mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ), st
      except (OSError, ValueError) as e: raise BadEntry(f"it cannot be mapped ({e})") from None
    finally: os.close(fd)

  def _open_entry(self, name: str, max_bytes: int) -> tuple[int, os.stat_result] | None:
    """A descriptor of the entry (the caller closes it) and its stat after the checks, or None when it is absent."""
    _check_name(name)
    if (afd := self._open_area(create=False)) is None: return None
    try:
      try: fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=afd)  # NONBLOCK: a FIFO must not hang us
      except FileNotFoundError: return None
      except OSError as e: raise BadEntry("it is a symbolic link" if e.errno == errno.ELOOP else f"it cannot be opened ({e})") from None
      try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode): raise BadEntry("it is not a regular file")
        if st.st_uid != current_uid(): raise BadEntry(f"it is owned by uid {st.st_uid}, not by this user")
        if st.st_size > max_bytes: raise BadEntry(f"it holds {st.st_size} bytes, over the bound of {max_bytes}")
      except BaseException:
        os.close(fd)
        raise
      return fd, st
    finally: os.close(afd)

  def write_plain(self, name: str, data: bytes | bytearray, durable: bool = True) -> bool:
    """Write the entry atomically (temporary file in the area, fsync, rename over the old entry or link). A failure
    (full disk, quota, read-only file system, no permission) is one warning, never an error; False then. durable=False
    skips the fsync, for an entry whose reader verifies every byte against a hash kept elsewhere (a plan's weights): a
    crash may then leave it torn, which is a miss, and a large file is not waited on."""
    _check_name(name)
    if (afd := self._open_area(create=True)) is None: return False
    tmp = f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
    try:
      fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=afd)
      try:
        _write_all(fd, data)
        if durable: os.fsync(fd)  # a crash must not leave a renamed but empty entry (it would fail its MAC, but cost a rebuild)
      finally: os.close(fd)
      os.replace(tmp, name, src_dir_fd=afd, dst_dir_fd=afd)
      return True
    except OSError as e:
      with contextlib.suppress(OSError): os.unlink(tmp, dir_fd=afd)
      self._write_failed(e)
      return False
    finally: os.close(afd)

  # ---- authenticated entries ----
  def load(self, name: str, max_bytes: int = MAX_ENTRY_BYTES) -> bytes | None:
    """The verified payload of a binary entry, or None (absent, or no disk cache). Raises BadEntry if it does not verify."""
    if (key := cache_key()) is None or (data := self.read_plain(name, max_bytes)) is None: return None
    n = len(_BIN_HEAD) + 32
    if not data.startswith(_BIN_HEAD) or len(data) < n: raise BadEntry("it carries no MAC (an older kiln's entry, or not kiln's)")
    if not hmac.compare_digest(data[len(_BIN_HEAD):n], _tag(key, self.area, name, data[n:])):
      raise BadEntry("its MAC does not verify (written with another key, or altered)")
    return data[n:]

  def store(self, name: str, payload: bytes) -> bool:
    if (key := cache_key()) is None: return False
    return self.write_plain(name, _BIN_HEAD + _tag(key, self.area, name, payload) + payload)

  def load_json(self, name: str, max_bytes: int = MAX_ENTRY_BYTES) -> dict[str, Any] | None:
    """A JSON entry's object once its MAC verifies (before it is parsed), or None. Raises BadEntry as load does."""
    if (key := cache_key()) is None or (data := self.read_plain(name, max_bytes)) is None: return None
    n = len(_JSON_HEAD) + 64
    if not data.startswith(_JSON_HEAD) or data[n:n + len(_JSON_SEP)] != _JSON_SEP:
      raise BadEntry("it carries no MAC (an older kiln's entry, or not kiln's)")
    body = b"{" + data[n + len(_JSON_SEP):]
    try: tag = bytes.fromhex(data[len(_JSON_HEAD):n].decode("ascii"))
    except (UnicodeDecodeError, ValueError): raise BadEntry("its MAC is not hex") from None
    if not hmac.compare_digest(tag, _tag(key, self.area, name, body)):
      raise BadEntry("its MAC does not verify (written with another key, or altered)")
    obj = json.loads(body)
    if not isinstance(obj, dict): raise BadEntry("it is not a JSON object")
    return obj

  def store_json(self, name: str, obj: dict[str, Any]) -> bool:
    """Write obj as {"mac": <hex>, ...obj's members}: still one JSON object, the MAC over the rest of it."""
    if not obj: raise CacheError("a sealed JSON entry needs at least one member")
    if (key := cache_key()) is None: return False
    body = json.dumps(obj).encode()
    return self.write_plain(name, _JSON_HEAD + _tag(key, self.area, name, body).hex().encode() + _JSON_SEP + body[1:])

  @contextlib.contextmanager
  def scratch(self) -> Iterator[Path]:
    """A private temporary directory inside the area when it is usable (code loaded from it then sits where the cache
    does, not in a /tmp that may be mounted noexec), else in the system's temporary directory. Removed afterwards."""
    where = None
    if enabled() and (afd := self._open_area(create=True)) is not None:
      os.close(afd)
      where = str(self.path)
    with tempfile.TemporaryDirectory(prefix=".scratch-", dir=where) as d: yield Path(d)


__all__ = ["DiskCache", "BadEntry", "CacheKeyError", "KilnCacheWarning", "cache_key", "cache_root", "enabled", "key_path",
           "current_uid", "FORMAT", "MAX_ENTRY_BYTES"]
