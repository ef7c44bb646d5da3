"""The registry of runtimes: entry points `kiln.devices` plus in-process registrations, one runtime per device."""
from __future__ import annotations

import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from kiln.codegen.choose.base import Target
from kiln.codegen.spec import DeviceSpec
from kiln.ir.errors import DeviceError

if TYPE_CHECKING:
  from kiln.codegen.protocols import Runtime

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
    rt = factory(spec)
    _instances[name] = rt
    return rt


def target_of(device: str | DeviceSpec) -> Target | None:
  """The machine model the device's renderer chooses options for (kiln.codegen.choose), for layers above that ask the
  option choice with a device; None for a runtime that renders nothing (DISK) or renders without it."""
  target = getattr(getattr(get_runtime(device), "renderer", None), "target", None)  # the Renderer protocol leaves it optional
  return target if isinstance(target, Target) else None
