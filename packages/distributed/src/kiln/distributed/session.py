"""The Ray session a fleet lives in, and Ray's errors as kiln's.

A fleet remembers the Ray job its workers were started in, and checks before each Ray call that this process is still
connected to that job. Ray's own calls start a fresh local Ray when none is connected (its auto-init), and then fail on
the old session's object refs ("No owner found for object"); a fleet whose session ended raises ClusterLost instead and
starts nothing. Another thread may shut Ray down between that check and the call, so while a fleet's calls run Ray's
auto-init is off (its module switch; a count, since several threads may run fleets), and a call that was waiting then
(Ray raises SystemExit in it) or finds Ray gone is ClusterLost too."""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kiln.distributed.errors import ClusterLost, DistributedError, WorkerError
from kiln.ir.errors import KilnError


def ray_module() -> Any:
  try:
    import ray
  except ImportError as e: raise DistributedError(f"kiln.distributed needs ray ({e}); pip install kiln-distributed") from None
  if not ray.is_initialized(): raise DistributedError("no Ray cluster: call ray.init(...) (or ray.init(address=...) to join one) first")
  return ray


def actor_errors() -> tuple[type[BaseException], ...]:
  import ray.exceptions as rx
  return (rx.RayActorError, rx.ActorUnavailableError, rx.WorkerCrashedError)


def _job_id(ray: Any) -> str | None:
  ctx = getattr(ray.get_runtime_context, "__wrapped__", ray.get_runtime_context)  # without Ray's auto-init wrapper
  try: return str(ctx().get_job_id())
  except Exception: return None  # shut down between the caller's check and this call


class _AutoInit:
  lock = threading.Lock()
  held = 0       # fleets' call blocks running now, all threads
  saved = True   # Ray's switch as it was before the first of them


@contextmanager
def _no_auto_init() -> Iterator[None]:
  try:
    import ray._private.auto_init_hook as hook
  except ImportError:  # another Ray: only the checks before each call remain
    yield
    return
  with _AutoInit.lock:
    if _AutoInit.held == 0: _AutoInit.saved, hook.enable_auto_connect = hook.enable_auto_connect, False
    _AutoInit.held += 1
  try: yield
  finally:
    with _AutoInit.lock:
      _AutoInit.held -= 1
      if _AutoInit.held == 0: hook.enable_auto_connect = _AutoInit.saved


def kiln_error(e: BaseException, worker: str) -> KilnError:
  """An error of a Ray call about `worker` as kiln's: a kiln error raised in the worker as itself, anything else the
  worker raised as WorkerError, Ray's own errors as DistributedError."""
  import ray.exceptions as rx
  if isinstance(e, rx.RayTaskError):  # before KilnError: Ray's wrapper of a kiln error is an instance of both
    cause = e.cause
    if isinstance(cause, KilnError): return cause
    return WorkerError(f"{worker}: {type(cause).__name__}: {cause}\n{e.traceback_str}")
  if isinstance(e, KilnError) and not isinstance(e, rx.RayError): return e
  if isinstance(e, actor_errors()): return DistributedError(f"{worker} is not available: {type(e).__name__}: {e}")
  return DistributedError(f"{worker}: {type(e).__name__}: {e}")


class Session:
  """The Ray job this process was connected to when a fleet started."""

  def __init__(self) -> None:
    self._ray = ray_module()
    self.job = _job_id(self._ray)

  def alive(self) -> bool:
    return bool(self._ray.is_initialized()) and _job_id(self._ray) == self.job

  def ray(self) -> Any:
    """The ray module, once this session is known to be the connected one (else ClusterLost: no Ray is started)."""
    if not self.alive(): raise self.lost()
    return self._ray

  def lost(self, results: Sequence[Any] = ()) -> ClusterLost:
    done = f"; {sum(r is not None for r in results)} of {len(results)} requests had come back (ClusterLost.results)" if results else ""
    return ClusterLost("the Ray session these workers ran in has ended (ray.shutdown() was called, or this process lost the "
                       f"cluster){done}: its workers are gone; after ray.init() start them again", results)

  @contextmanager
  def translated(self, worker: str, results: Sequence[Any] = ()) -> Iterator[None]:
    """Errors of the Ray calls inside as kiln errors about `worker`; the session's end as ClusterLost holding `results`.
    Ray's auto-init is off inside, so no call here can start a Ray."""
    try:
      with _no_auto_init(): yield
    except GeneratorExit: raise  # a generator of results closed by its caller
    except ClusterLost: raise self.lost(results) from None
    except BaseException as e:
      if not self.alive(): raise self.lost(results) from e
      if not isinstance(e, Exception): raise  # KeyboardInterrupt, or the caller's own SystemExit
      err = kiln_error(e, worker)
      if err is e: raise
      raise err from e
