"""Opening a file kiln was handed (a model, its external data, a weights file, a .npy array): untrusted until checked.
Every layer that opens such a file does it here.

`open_regular` opens without blocking (a FIFO would hang a plain open or read forever), then refuses anything that is not
a regular file, naming what it is, before a byte is read. Every failure is the caller's typed error, never an OSError or
a ValueError (a NUL byte in a path).
"""
from __future__ import annotations

import errno
import os
import stat

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def kind(mode: int) -> str:
  return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str], what: str, error: type[Exception]) -> int:
  """A read-only descriptor of the regular file at path (the caller closes it); `error(message)` naming `what` otherwise."""
  p = os.fspath(path)
  if "\0" in p: raise error(f"{what}: the path {p!r} holds a NUL byte")
  try: fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
  except OSError as e:
    why = "does not exist" if e.errno == errno.ENOENT else f"cannot be opened: {e.strerror}"
    raise error(f"{what} {why} ({p})") from None
  try: mode = os.fstat(fd).st_mode
  except OSError as e:
    os.close(fd)
    raise error(f"{what} cannot be read: {e.strerror} ({p})") from None
  if not stat.S_ISREG(mode):
    os.close(fd)
    raise error(f"{what} is {kind(mode)}, not a regular file ({p})")
  return fd


def regular_size(path: str | os.PathLike[str], what: str, error: type[Exception]) -> int:
  """The size in bytes of the regular file at path, checked as open_regular checks it."""
  fd = open_regular(path, what, error)
  try: return os.fstat(fd).st_size
  finally: os.close(fd)
