"""CUDA graphs for runs of a plan's kernel launches (kiln issue 16: launch overhead), over libcuda through ctypes.

pycuda (2026.1) has no graph API, and one cuLaunchKernel through it costs ~5 us of host time; a run of N launches recorded
once into a CUDA graph is one cuGraphLaunch per execute. `GraphRun` is that: built from a run's bound calls (CUDABoundCall:
function, grid, block, dynamic shared bytes, packed argument buffer each), one kernel node per non-empty launch, each node
depending on the one before (the run's order: the executor already orders dependent kernels, so a chain is exactly the
plain path's order), instantiated, and launched on the legacy default stream (handle 0, where pycuda's launches and copies
go), so ordering against copies and other launches is unchanged.

The driver functions are the ones cuda.h (CUDA 12/13) maps the unversioned names to: cuGraphAddKernelNode is
cuGraphAddKernelNode_v2 and cuGraphExecKernelNodeSetParams is ..._v2, both taking CUDA_KERNEL_NODE_PARAMS_v2 (v1's fields
plus `kern` and `ctx`, ignored when `func` is set); cuGraphInstantiate is cuGraphInstantiateWithFlags(exec*, graph,
unsigned long long flags). An older libcuda without the _v2 symbols gets the v1 names with the same struct (v1 is its
prefix). Arguments go in `extra` (CU_LAUNCH_PARAM_BUFFER_POINTER/SIZE/END) pointing at a copy of the packed buffer that
lives as long as the graph.

The CUfunction: pycuda's Function does not expose its handle, so each program loads its own copy of its binary with
cuModuleLoadData for its graph nodes (CUDAProgram.graph_function; unloaded with the program, in its context). Module-scope
__device__ state (a BLOCKS reduction's counts) is then per module, which is safe: every launch runs on the one stream.

Every call here needs the runtime's context current: a GraphRun is built and launched inside the runtime's session (the
executor's run), and destroyed under its ContextGuard. Where graphs cannot be used -- no libcuda in this process, a
stand-in driver, KILN_CUDA_GRAPHS=0, fewer than GRAPH_MIN_KERNELS launches, an error building or instantiating -- the run's
calls launch one by one as before: a graph is an optimisation, never a different result.

NOTE: not run on a real GPU in this commit. Tested against a Python stand-in for libcuda's graph calls
(tests/test_graph.py), which decodes the structs and `extra` arrays these functions pass.
"""
from __future__ import annotations

import ctypes
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

from kiln.runtime.cuda import settings
from kiln.runtime.cuda.sticky import is_sticky

GRAPH_MIN_KERNELS = 4  # a run of fewer launches runs them one by one (a graph's build and its bookkeeping are not worth it)
_PARAM_END, _PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE = 0, 1, 2  # CU_LAUNCH_PARAM_*
_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_STATIC_SHARED = 48 << 10


class KernelNodeParams(ctypes.Structure):
  """CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA 12.0+; CUDA_KERNEL_NODE_PARAMS is this one): 72 bytes on 64-bit hosts."""
  _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
              ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
              ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
              ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class LibcudaError(Exception):
  """A libcuda call here returned an error: str() is "cuXxx failed: <cuGetErrorString> (<CUresult name>)", the shape
  pycuda's errors have, so ContextGuard.failure recognises the sticky ones (an illegal address: the context is dead).
  Like pycuda's errors it is the driver's, not kiln's: ContextGuard.failure turns it into a DeviceError or a
  RuntimeLaunchError (a KilnError would pass through it unchanged, and a dead context would go unmarked)."""

  def __init__(self, what: str, code: int, name: str, text: str):
    super().__init__(f"{what} failed: {text} ({name})")
    self.code, self.name = code, name


_VP, _P = ctypes.c_void_p, ctypes.POINTER
_SIGNATURES: dict[str, tuple[list[Any], bool]] = {  # name: (argtypes, required)
  "cuGraphCreate": ([_P(_VP), ctypes.c_uint], True),
  "cuGraphInstantiateWithFlags": ([_P(_VP), _VP, ctypes.c_ulonglong], True),
  "cuGraphLaunch": ([_VP, _VP], True),
  "cuGraphExecDestroy": ([_VP], True),
  "cuGraphDestroy": ([_VP], True),
  "cuModuleLoadData": ([_P(_VP), _VP], True),
  "cuModuleGetFunction": ([_P(_VP), _VP, ctypes.c_char_p], True),
  "cuModuleUnload": ([_VP], True),
  "cuFuncSetAttribute": ([_VP, ctypes.c_int, ctypes.c_int], True),
  "cuGetErrorName": ([ctypes.c_int, _P(ctypes.c_char_p)], False),
  "cuGetErrorString": ([ctypes.c_int, _P(ctypes.c_char_p)], False),
}
_ADD_NODE = [_P(_VP), _VP, _P(_VP), ctypes.c_size_t, _P(KernelNodeParams)]
_SET_PARAMS = [_VP, _VP, _P(KernelNodeParams)]


class GraphAPI:
  """The graph calls of a libcuda (ctypes.CDLL("libcuda.so.1"), or a test's stand-in with the same function names), each
  raising LibcudaError on a CUresult other than CUDA_SUCCESS. Handles are ints (0: none)."""

  def __init__(self, lib: Any):
    self.lib = lib
    fns: dict[str, Any] = {}
    for name, (argtypes, required) in _SIGNATURES.items():
      try: fns[name] = self._bind(name, argtypes)
      except AttributeError:
        if required: raise
    fns["add_node"] = self._first(("cuGraphAddKernelNode_v2", "cuGraphAddKernelNode"), _ADD_NODE)
    try: fns["set_params"] = self._first(("cuGraphExecKernelNodeSetParams_v2", "cuGraphExecKernelNodeSetParams"), _SET_PARAMS)
    except AttributeError: fns["set_params"] = None  # a changed launch then rebuilds the graph
    self._fns = fns
    self._launch = fns["cuGraphLaunch"]

  def _bind(self, name: str, argtypes: list[Any]) -> Any:
    fn = getattr(self.lib, name)  # AttributeError: this libcuda lacks it
    if hasattr(fn, "argtypes"):  # a real ctypes function (a test's stand-in takes what it is given)
      fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn

  def _first(self, names: tuple[str, ...], argtypes: list[Any]) -> Any:
    for n in names:
      try: return self._bind(n, argtypes)
      except AttributeError: continue
    raise AttributeError(names[0])

  def error(self, what: str, rc: int) -> LibcudaError:
    name, text = f"CUresult {rc}", "unknown error"
    for fn_name, i in (("cuGetErrorName", 0), ("cuGetErrorString", 1)):
      fn, out = self._fns.get(fn_name), ctypes.c_char_p()
      if fn is not None and fn(rc, ctypes.pointer(out)) == 0 and out.value:
        if i == 0: name = out.value.decode(errors="replace")
        else: text = out.value.decode(errors="replace")
    return LibcudaError(what, rc, name, text)

  def _call(self, name: str, *args: Any) -> None:
    rc = self._fns[name](*args)
    if rc: raise self.error(name, rc)

  # ---- modules ----
  def load_function(self, image: bytes, name: str, shared: int) -> tuple[int, int]:
    """(module, function) of `name` in a new module of `image` (cubin or fatbin), allowed `shared` dynamic shared bytes."""
    mod, fn = _VP(), _VP()
    self._call("cuModuleLoadData", ctypes.pointer(mod), image)
    try:
      self._call("cuModuleGetFunction", ctypes.pointer(fn), mod, name.encode())
      if shared > _STATIC_SHARED: self._call("cuFuncSetAttribute", fn, _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
    except LibcudaError:
      self._fns["cuModuleUnload"](mod)
      raise
    return int(mod.value or 0), int(fn.value or 0)

  def unload_module(self, mod: int) -> None: self._call("cuModuleUnload", _VP(mod))

  # ---- graphs ----
  def create(self) -> int:
    g = _VP()
    self._call("cuGraphCreate", ctypes.pointer(g), 0)
    return int(g.value or 0)

  def add_kernel_node(self, graph: int, after: int, params: KernelNodeParams) -> int:
    node = _VP()
    deps = (_VP * 1)(after) if after else None
    rc = self._fns["add_node"](ctypes.pointer(node), _VP(graph), deps, 1 if after else 0, ctypes.pointer(params))
    if rc: raise self.error("cuGraphAddKernelNode", rc)
    return int(node.value or 0)

  def instantiate(self, graph: int) -> int:
    e = _VP()
    self._call("cuGraphInstantiateWithFlags", ctypes.pointer(e), _VP(graph), 0)
    return int(e.value or 0)

  @property
  def can_update(self) -> bool: return self._fns["set_params"] is not None

  def set_params(self, exe: int, node: int, params: KernelNodeParams) -> None:
    rc = self._fns["set_params"](_VP(exe), _VP(node), ctypes.pointer(params))
    if rc: raise self.error("cuGraphExecKernelNodeSetParams", rc)

  def launch(self, exe: int) -> None:
    """cuGraphLaunch on the legacy default stream (0): ordered with pycuda's launches and copies."""
    rc = self._launch(exe, None)
    if rc: raise self.error("cuGraphLaunch", rc)

  def destroy(self, graph: int, exe: int) -> None:
    if exe: self._call("cuGraphExecDestroy", _VP(exe))
    if graph: self._call("cuGraphDestroy", _VP(graph))


def enabled() -> bool:
  """KILN_CUDA_GRAPHS=0 turns graphs off (read when a plan groups its runs, i.e. when it is built)."""
  return settings.GRAPHS.get()


def _real_driver(drv: Any) -> bool:
  """A driver whose contexts are libcuda's: pycuda's own module (a stand-in module has no __file__) or kiln's cuda-python
  adapter. Over anything else the ctypes calls would not see the driver's contexts."""
  if type(drv).__name__ == "CudaPythonDriver": return True
  return getattr(drv, "__name__", "") == "pycuda.driver" and getattr(drv, "__file__", None) is not None


_api_cache: dict[str, GraphAPI | None] = {}


def open_api(drv: Any) -> GraphAPI | None:
  """The GraphAPI over the libcuda this process already loaded (pycuda links libcuda.so.1), or None where there is none or
  `drv` is not a real driver (a stand-in): plain launches then. Tests replace this function to inject a stand-in libcuda."""
  if not _real_driver(drv): return None
  if "libcuda" not in _api_cache:
    try: _api_cache["libcuda"] = GraphAPI(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError): _api_cache["libcuda"] = None  # no libcuda, or one too old for graphs (CUDA < 11.4)
  return _api_cache["libcuda"]


class _Node:
  """One kernel node: its call, handle, and the ctypes objects its parameters point at (alive as long as the graph)."""
  __slots__ = ("call", "handle", "params", "keep", "grid", "block", "arg_buf")

  def __init__(self, call: Any, func: int):
    self.call, self.handle = call, 0
    self.params = KernelNodeParams()
    self.keep: tuple[Any, ...] = ()
    self.pack(func)

  def pack(self, func: int) -> None:
    c = self.call
    self.grid, self.block, self.arg_buf = c.grid, c.block, c.arg_buf
    buf = ctypes.create_string_buffer(bytes(c.arg_buf), len(c.arg_buf))
    size = ctypes.c_size_t(len(c.arg_buf))
    extra = (_VP * 5)(_PARAM_BUFFER_POINTER, ctypes.addressof(buf), _PARAM_BUFFER_SIZE, ctypes.addressof(size), _PARAM_END)
    p = self.params
    p.func = func
    p.gridDimX, p.gridDimY, p.gridDimZ = (int(x) for x in c.grid)
    p.blockDimX, p.blockDimY, p.blockDimZ = (int(x) for x in c.block)
    p.sharedMemBytes, p.kernelParams, p.extra, p.kern, p.ctx = int(c.prog.shared), None, ctypes.addressof(extra), None, None
    self.keep = (buf, size, extra)  # CUDA reads these at add/set time; kept for the graph's life all the same


class GraphRun:
  """A run of one runtime's bound calls (CUDABoundCall), launched as one CUDA graph. Call it only inside the runtime's
  session (its context current on this thread), as ExecutionPlan does. A call's set_vals (a runtime variable changed its
  arguments or grid) marks it changed here: the next call updates those nodes in place (cuGraphExecKernelNodeSetParams),
  or rebuilds the graph when that fails or a launch's grid became empty or non-empty. Building failing (other than by a
  sticky error, which kills the context and raises) gives graphs up for this run: its calls launch one by one from then on."""

  def __init__(self, runtime: Any, api: GraphAPI, calls: Sequence[Any]):
    self.runtime, self.api, self.guard, self.calls = runtime, api, runtime.guard, list(calls)
    self._h = [0, 0]  # (graph, graph exec): shared with the finaliser, which must not keep self alive
    self.nodes: list[_Node] = []
    self.changed: set[int] = set()  # indexes into calls whose arguments changed since the graph was built
    self.stale = True  # no graph yet, or calls changed
    self.broken: str | None = None  # why this run gave graphs up (plain launches from then on)
    self.launches = 0  # graph launches so far (for tests and tools)
    self._index = {id(c): i for i, c in enumerate(self.calls)}
    for c in self.calls: c.graph_runs.add(self)
    fin = weakref.finalize(self, GraphRun._release, api, self.guard, self._h)
    fin.atexit = False  # at exit the process takes the graphs with it; the driver may be half torn down by then

  @property
  def exe(self) -> int: return self._h[1]

  def note_change(self, call: Any) -> None:
    """call.set_vals ran: its node must be updated before the next launch."""
    if (i := self._index.get(id(call))) is not None:
      self.changed.add(i)
      self.stale = True

  def __call__(self) -> None:
    if self.broken is None:
      if self.stale: self._prepare()
      if self.broken is None:
        if (exe := self._h[1]):
          if (vs := self.runtime.vars).dirty: vs.flush()  # variables its kernels read from memory (device_vars.py)
          try: self.api.launch(exe)
          except LibcudaError as e:
            raise self.guard.failure(e, f"launching a CUDA graph of {len(self.nodes)} kernels", launch=True) from e
          self.launches += 1
        return
    for c in self.calls: c.in_session()

  def _prepare(self) -> None:
    try:
      if not (self._h[1] and self.changed and self._update()): self._build()
    except LibcudaError as e:
      err = self.guard.failure(e, "building a CUDA graph")  # a sticky error marks the context dead
      if self.guard.dead is not None: raise err from e
      self.broken = str(e)
      try: self._destroy()
      except LibcudaError as e2: warnings.warn(f"{self.runtime.device}: destroying a CUDA graph failed: {e2}", RuntimeWarning, stacklevel=2)
      warnings.warn(f"{self.runtime.device}: CUDA graph of {len(self.calls)} launches unavailable ({e}); launching them one by one",
                    RuntimeWarning, stacklevel=3)
      return
    self.changed.clear()
    self.stale = False

  def _update(self) -> bool:
    """Update the changed nodes in place; False when the graph must be rebuilt instead."""
    if not self.api.can_update: return False
    by_call = {id(n.call): n for n in self.nodes}
    todo: list[_Node] = []
    for i in sorted(self.changed):
      c = self.calls[i]
      n = by_call.get(id(c))
      if (n is None) != bool(c.empty): return False  # a launch appeared or vanished: the chain changes
      if n is not None and (n.grid, n.block, n.arg_buf) != (c.grid, c.block, c.arg_buf): todo.append(n)
    for n in todo:
      n.pack(int(n.params.func or 0))
      try: self.api.set_params(self._h[1], n.handle, n.params)
      except LibcudaError as e:
        if is_sticky(e): raise
        return False  # e.g. a change the driver cannot apply in place: rebuild
    return True

  def _build(self) -> None:
    self._destroy()
    live = [c for c in self.calls if not c.empty]
    if not live: return  # every grid is empty: nothing to launch
    nodes = [_Node(c, c.prog.graph_function(self.api)) for c in live]
    g = self._h[0] = self.api.create()
    prev = 0
    for n in nodes: prev = n.handle = self.api.add_kernel_node(g, prev, n.params)
    self._h[1] = self.api.instantiate(g)
    self.nodes = nodes

  def _destroy(self) -> None:
    """Destroy the graph now (inside the session: the context is current)."""
    graph, exe = self._h
    self._h[0] = self._h[1] = 0
    self.nodes = []
    if graph or exe: self.api.destroy(graph, exe)

  def release(self) -> None:
    """Destroy the graph with the runtime's context current (pushed if it is not); the next call builds it again."""
    GraphRun._release(self.api, self.guard, self._h)
    self.nodes, self.stale = [], True

  @staticmethod
  def _release(api: GraphAPI, guard: Any, handles: list[int]) -> None:
    """Also the finaliser: destroy the graph in its context; never raises (a dead context's graphs went with it)."""
    graph, exe = handles
    if not (graph or exe): return
    handles[0] = handles[1] = 0
    try:
      with guard.for_free() as alive:
        if alive: api.destroy(graph, exe)
    except Exception as e:  # a finaliser has no caller to tell: say so
      warnings.warn(f"{guard.device}: destroying a CUDA graph failed: {e}", RuntimeWarning, stacklevel=2)
