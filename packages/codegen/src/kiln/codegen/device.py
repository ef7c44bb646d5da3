"""Device strings and the registry of runtimes (entry points `kiln.devices` plus in-process registrations)."""
from __future__ import annotations

import re
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator

from kiln.ir.errors import DeviceError

if TYPE_CHECKING:
  from kiln.codegen.protocols import Runtime

_DEVICE_RE = re.compile(r"^(?P<kind>[A-Za-z]+)(?::(?P<rest>.*))?$")


class DeviceSpec(BaseModel):
  """A parsed device: CPU, CUDA:<n> (GPU is an alias of CUDA), DISK:<path> (the path keeps its case)."""
  model_config = ConfigDict(frozen=True, extra="forbid")
  kind: Literal["CPU", "CUDA", "DISK"]
  index: int = 0
  path: str | None = None

  @model_validator(mode="before")
  @classmethod
  def _from_str(cls, v: Any) -> Any:
    if isinstance(v, DeviceSpec): return {"kind": v.kind, "index": v.index, "path": v.path}
    if not isinstance(v, str): return v
    return _parse(v)

  @model_validator(mode="after")
  def _check(self) -> DeviceSpec:
    if self.kind == "DISK" and not self.path: raise ValueError("DISK device needs a path: DISK:/some/file")
    if self.kind != "DISK" and self.path is not None: raise ValueError(f"{self.kind} device takes no path")
    if self.index < 0: raise ValueError(f"device index must be >= 0, got {self.index}")
    if self.kind == "CPU" and self.index != 0: raise ValueError("CPU has a single device (index 0)")
    return self

  @model_serializer
  def _ser(self) -> str: return str(self)

  @classmethod
  def parse(cls, s: str | DeviceSpec) -> DeviceSpec:
    if isinstance(s, DeviceSpec): return s
    try: return cls.model_validate(s)
    except ValueError as e: raise DeviceError(f"invalid device {s!r}: {_first_error(e)}") from None

  def __str__(self) -> str:
    if self.kind == "CPU": return "CPU"
    if self.kind == "DISK": return f"DISK:{self.path}"
    return f"CUDA:{self.index}"


def _first_error(e: Exception) -> str:
  errs = getattr(e, "errors", None)
  if callable(errs):
    try: return "; ".join(str(x.get("msg", x)) for x in errs())
    except Exception: pass  # noqa: S110
  return str(e)


def _parse(s: str) -> dict[str, Any]:
  m = _DEVICE_RE.match(s.strip())
  if m is None: raise ValueError(f"cannot parse device {s!r}; expected CPU, CUDA, CUDA:<n>, GPU or DISK:<path>")
  kind, rest = m.group("kind").upper(), m.group("rest")
  if kind == "GPU": kind = "CUDA"
  if kind == "DISK": return {"kind": "DISK", "path": rest}
  if kind not in ("CPU", "CUDA"): raise ValueError(f"unknown device kind {m.group('kind')!r}; expected CPU, CUDA, GPU or DISK")
  if rest is None: return {"kind": kind}
  if not rest.isdigit(): raise ValueError(f"device index must be a non-negative integer, got {rest!r}")
  return {"kind": kind, "index": int(rest)}


# ---- registry ----
RuntimeFactory = Callable[[DeviceSpec], "Runtime"]
_registered: dict[str, RuntimeFactory] = {}
_instances: dict[str, Runtime] = {}
_lock = threading.RLock()


def register_runtime(kind: str, factory: RuntimeFactory) -> None:
  """Register a runtime factory in this process (tests, plug-ins); overrides an entry point of the same name."""
  with _lock:
    _registered[kind.upper()] = factory
    for k in [k for k in _instances if k.split(":")[0] == kind.upper()]: del _instances[k]


def unregister_runtime(kind: str) -> None:
  with _lock:
    _registered.pop(kind.upper(), None)
    for k in [k for k in _instances if k.split(":")[0] == kind.upper()]: del _instances[k]


def _entry_point_factories() -> dict[str, Any]:
  return {ep.name.upper(): ep for ep in entry_points(group="kiln.devices")}


def available_devices() -> list[str]:
  """Kinds with a runtime: entry points and in-process registrations."""
  return sorted(set(_entry_point_factories()) | set(_registered))


def get_runtime(device: str | DeviceSpec) -> Runtime:
  """The (cached) runtime for a device; a clear DeviceError when no runtime provides it."""
  spec = DeviceSpec.parse(device)
  name = str(spec)
  with _lock:
    if (rt := _instances.get(name)) is not None: return rt
    factory = _registered.get(spec.kind)
    if factory is None:
      ep = _entry_point_factories().get(spec.kind)
      if ep is None:
        raise DeviceError(f"no runtime for device {name}: none is registered under the 'kiln.devices' entry points "
                          f"(found: {', '.join(available_devices()) or 'none'}); install kiln-runtime-{spec.kind.lower()}")
      try: factory = ep.load()
      except Exception as e: raise DeviceError(f"the runtime for {spec.kind} failed to load: {e}") from e
    rt = factory(spec)  # type: ignore[misc]
    _instances[name] = rt
    return rt
