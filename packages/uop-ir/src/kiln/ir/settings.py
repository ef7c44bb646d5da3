"""Settings: kiln's KILN_* environment variables. Each package declares its own in one module, kiln/<package>/settings.py
(name, type, default, one line of doc), and reads them only through those declarations; `kiln info --settings` lists
them all with their values. This module is the helper every such declaration uses, in the lowest layer so that each
package can use it.

A setting is read from the environment each time it is asked for (tests and users change it between runs); unset or
empty (an unresolved CI variable) is the default. A bad value is one SettingError naming the variable and what it takes.
A command that sets one for what reads it later (`--threads` before the CPU runtime's pool starts, a benchmark's own
cache directory) does so through set() or temporarily(), which check the value as get() does.
"""
from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Generic, TypeVar

from kiln.ir.errors import SettingError

T = TypeVar("T")
D = TypeVar("D", int, float, str, None)  # a default's type: None where unset means "decided elsewhere" (the host's CPU)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting(Generic[T]):
  """One KILN_* variable: `parse` turns its stripped text into a value (a ValueError when it cannot); `takes` says what a
  good value is; a `secret` one's value is never printed nor put in an error."""
  name: str
  default: T
  doc: str
  takes: str
  parse: Callable[[str], T]
  secret: bool = False

  def raw(self) -> str:
    """The variable's text, stripped ("" when unset)."""
    return os.environ.get(self.name, "").strip()

  def is_set(self) -> bool: return bool(self.raw())

  def get(self) -> T:
    """The value: the default when unset or empty, else the parsed text; SettingError for a value it does not take."""
    if not (text := self.raw()): return self.default
    try: return self.parse(text)
    except SettingError: raise
    except ValueError as e:
      got = "another value" if self.secret else repr(text)
      why = f" ({e})" if str(e) and not self.secret else ""
      raise SettingError(f"{self.name} must be {self.takes}, got {got}{why}") from None

  def set(self, value: object) -> None:
    """Puts str(value) in the environment (None unsets it), for what reads the setting later in this process or in a child;
    a value get() would refuse is a SettingError and leaves the variable as it was."""
    old = os.environ.get(self.name)
    if value is None: os.environ.pop(self.name, None)
    else: os.environ[self.name] = str(value)
    try: self.get()
    except SettingError:
      self._restore(old)
      raise

  @contextlib.contextmanager
  def temporarily(self, value: object) -> Iterator[None]:
    """set(value) for the block; the variable's old text (or its absence) is put back after it, however it ends."""
    old = os.environ.get(self.name)
    self.set(value)
    try: yield
    finally: self._restore(old)

  def _restore(self, old: str | None) -> None:
    if old is None: os.environ.pop(self.name, None)
    else: os.environ[self.name] = old

  def shown(self) -> str:
    """The value as `kiln info --settings` prints it: what is in force, and whether it is the default."""
    if not self.is_set(): return "(unset)" if self.default is None else f"{self.default!r} (default)"
    if self.secret: return "(set)"
    try: return repr(self.get())
    except SettingError as e: return f"BAD: {e}"


def _flag(text: str) -> bool:
  t = text.lower()
  if t in _TRUE: return True
  if t in _FALSE: return False
  raise ValueError("")


def flag(name: str, default: bool, doc: str) -> Setting[bool]:
  """On or off: 1/true/yes/on or 0/false/no/off (any case)."""
  return Setting(name, default, doc, "1 or 0 (true/false, yes/no, on/off)", _flag)


def integer(name: str, default: D, doc: str, minimum: int = 0, what: str = "") -> Setting[int | D]:
  """A whole number of at least `minimum`; `what` names its unit ("a whole number of microseconds >= 0")."""
  def parse(text: str) -> int | D:
    try: n = int(text)
    except ValueError: raise ValueError("") from None
    if n < minimum: raise ValueError("")
    return n
  return Setting(name, default, doc, what or f"a whole number >= {minimum}", parse)


def number(name: str, default: float, doc: str, what: str) -> Setting[float]:
  """A finite positive number (`what` names its unit)."""
  def parse(text: str) -> float:
    try: x = float(text)
    except ValueError: raise ValueError("") from None
    if not 0 < x < float("inf"): raise ValueError("")
    return x
  return Setting(name, default, doc, what, parse)


def choice(name: str, default: D, choices: Sequence[str], doc: str) -> Setting[str | D]:
  """One of `choices`, exactly as spelled."""
  def parse(text: str) -> str | D:
    if text not in choices: raise ValueError("")
    return text
  return Setting(name, default, doc, f"one of {', '.join(choices)}", parse)


def text(name: str, default: D, doc: str, takes: str, check: Callable[[str], str] | None = None,
         secret: bool = False) -> Setting[str | D]:
  """Free text (a CPU or architecture name, a path, a key); `check` returns it or raises a ValueError."""
  parse: Callable[[str], str | D] = check or (lambda t: t)
  return Setting(name, default, doc, takes, parse, secret)


def declared(module: ModuleType) -> list[Setting]:
  """The settings a package's settings module declares, in its order."""
  return [v for v in vars(module).values() if isinstance(v, Setting)]


def installed() -> dict[str, list[Setting]]:
  """Every installed kiln package's settings, by settings module: found as files (kiln/<package>/settings.py, or one
  level deeper for kiln.runtime.*), never named here, so this layer depends on none of the packages above it."""
  import kiln
  names = set()
  for base in kiln.__path__:
    for p in (*Path(base).glob("*/settings.py"), *Path(base).glob("*/*/settings.py")):
      names.add("kiln." + ".".join(p.relative_to(base).with_suffix("").parts))
  names.discard(__name__)
  return {n: declared(importlib.import_module(n)) for n in sorted(names)}
