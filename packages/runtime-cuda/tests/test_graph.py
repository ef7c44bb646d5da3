"""CUDA graphs (kiln.runtime.cuda.graph) over a stand-in for libcuda's graph calls, on top of the pycuda stand-in of
test_driver.py (no GPU here). The stand-in decodes what the ctypes layer passes (CUDA_KERNEL_NODE_PARAMS_v2, the `extra`
array, the packed argument buffer), checks the context each call runs in, and records a graph launch as ("graph_launch", n)
followed by one ("graph_kernel", name, grid, block, args) per node in dependency order, beside the pycuda stand-in's
("launch", name, grid, block, args)."""
import ctypes
import gc
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kiln.codegen.spec import Variable
from kiln.ir.errors import DeviceError, RuntimeLaunchError
from kiln.runtime.cuda import graph as cuda_graph
from kiln.runtime.cuda.compiler import find_nvcc
from kiln.runtime.cuda.driver import CUDARuntime
from kiln.runtime.cuda.graph import GraphAPI, KernelNodeParams

# no relative imports: packages/executor/tests/test_graph_runs.py loads this file on its own for make_fake_libcuda
_spec = importlib.util.spec_from_file_location("kiln_cuda_driver_tests_graph", Path(__file__).with_name("test_driver.py"))
assert _spec is not None and _spec.loader is not None
_drv_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_drv_tests)
_ERRORS = {1: (b"CUDA_ERROR_INVALID_VALUE", b"invalid argument"), 201: (b"CUDA_ERROR_INVALID_CONTEXT", b"invalid device context"),
           400: (b"CUDA_ERROR_INVALID_HANDLE", b"invalid resource handle"),
           700: (b"CUDA_ERROR_ILLEGAL_ADDRESS", b"an illegal memory access was encountered"),
           801: (b"CUDA_ERROR_NOT_SUPPORTED", b"operation not supported")}


def _h(x) -> int:
  """A handle as the ctypes layer passes it (c_void_p or int or None) -> int."""
  if isinstance(x, ctypes.c_void_p): return int(x.value or 0)
  return int(x or 0)


class FakeLibCuda:
  """libcuda's graph, module and error-string calls over the pycuda stand-in `drv`'s contexts. `fail` maps a function name
  to a CUresult it returns (once per entry in the list). `v2=False` offers only the v1 names, `update=False` no
  cuGraphExecKernelNodeSetParams."""

  def __init__(self, drv, calls: list, v2: bool = True, update: bool = True):
    self.drv, self.calls, self.fail = drv, calls, {}
    self.next, self.modules, self.functions, self.graphs, self.execs = 0x1000, {}, {}, {}, {}
    self.params_seen: list = []  # every KernelNodeParams decoded, as read
    if v2:
      self.cuGraphAddKernelNode_v2 = self._add_node
      if update: self.cuGraphExecKernelNodeSetParams_v2 = self._set_params
    else:
      self.cuGraphAddKernelNode = self._add_node
      if update: self.cuGraphExecKernelNodeSetParams = self._set_params

  def _new(self) -> int:
    self.next += 0x10
    return self.next

  def _ctx(self, what: str):
    """The current context (the stand-in's rules: none, or a dead one, is an error code)."""
    if (rc := self.fail.get(what)):
      self.fail[what] = rc[1:]
      return rc[0]
    try: return self.drv._current(what)
    except self.drv.LogicError as e: return 700 if "illegal" in str(e) else 201

  def _in(self, what: str, owner_ctx):
    ctx = self._ctx(what)
    if isinstance(ctx, int): return ctx
    if owner_ctx is not None and ctx != owner_ctx: return 201
    return ctx

  def _decode(self, p) -> dict:
    """What a kernel node gets: the struct's fields and the argument bytes behind `extra` (copied now, as CUDA does)."""
    assert p.kernelParams is None and p.kern is None and p.ctx is None
    extra = (ctypes.c_void_p * 5).from_address(p.extra)
    assert extra[0] == 1 and extra[2] == 2 and not extra[4], list(extra)  # BUFFER_POINTER, ptr, BUFFER_SIZE, &size, END
    size = ctypes.c_size_t.from_address(extra[3]).value
    d = dict(func=int(p.func), grid=(p.gridDimX, p.gridDimY, p.gridDimZ), block=(p.blockDimX, p.blockDimY, p.blockDimZ),
             shared=p.sharedMemBytes, args=ctypes.string_at(extra[1], size))
    self.params_seen.append(d)
    return d

  # ---- modules ----
  def cuModuleLoadData(self, pmod, image):
    ctx = self._ctx("cuModuleLoadData")
    if isinstance(ctx, int): return ctx
    h = self._new()
    self.modules[h] = ctx
    pmod.contents.value = h
    self.calls.append(("graph_module_load", bytes(image)))
    return 0

  def cuModuleGetFunction(self, pfn, mod, name):
    if (ctx := self._in("cuModuleGetFunction", self.modules.get(_h(mod)))) and isinstance(ctx, int): return ctx
    h = self._new()
    self.functions[h] = (name.decode(), _h(mod))
    pfn.contents.value = h
    return 0

  def cuFuncSetAttribute(self, fn, attr, value):
    self.calls.append(("graph_func_attribute", self.functions[_h(fn)][0], attr, value))
    return 0

  def cuModuleUnload(self, mod):
    owner = self.modules.pop(_h(mod), None)
    ctx = self.drv.Context.get_current()
    if owner is None or ctx is None or ctx != owner: self.drv._problem(f"module {_h(mod):#x} unloaded out of its context")
    self.calls.append(("graph_module_unload", _h(mod)))
    return 0

  # ---- graphs ----
  def cuGraphCreate(self, pg, flags):
    ctx = self._ctx("cuGraphCreate")
    if isinstance(ctx, int): return ctx
    assert flags == 0
    h = self._new()
    self.graphs[h] = {"ctx": ctx, "nodes": {}, "order": []}
    pg.contents.value = h
    return 0

  def _add_node(self, pnode, graph, deps, ndeps, pparams):
    g = self.graphs.get(_h(graph))
    if g is None: return 400
    if (ctx := self._in("cuGraphAddKernelNode", g["ctx"])) and isinstance(ctx, int): return ctx
    dep_list = [int(deps[i] or 0) for i in range(ndeps)] if ndeps else []
    node = self._decode(pparams.contents)
    if node["func"] not in self.functions: return 400
    h = self._new()
    node["deps"] = dep_list
    g["nodes"][h] = node
    g["order"].append(h)
    pnode.contents.value = h
    return 0

  def cuGraphInstantiateWithFlags(self, pexec, graph, flags):
    g = self.graphs.get(_h(graph))
    if g is None: return 400
    if (ctx := self._in("cuGraphInstantiateWithFlags", g["ctx"])) and isinstance(ctx, int): return ctx
    assert flags == 0
    order, prev = [], 0  # the nodes in dependency order: here a chain, each after the one before
    for h in g["order"]:
      assert g["nodes"][h]["deps"] == ([prev] if prev else []), "kernel nodes must form a chain in the run's order"
      order.append(h)
      prev = h
    e = self._new()
    self.execs[e] = {"graph": _h(graph), "ctx": g["ctx"], "nodes": {h: dict(g["nodes"][h]) for h in order}, "order": order}
    pexec.contents.value = e
    self.calls.append(("graph_instantiate", len(order)))
    return 0

  def _set_params(self, exe, node, pparams):
    x = self.execs.get(_h(exe))
    if x is None or _h(node) not in x["nodes"]: return 400
    if (ctx := self._in("cuGraphExecKernelNodeSetParams", x["ctx"])) and isinstance(ctx, int): return ctx
    d = self._decode(pparams.contents)
    if d["func"] != x["nodes"][_h(node)]["func"]: return 1  # CUDA refuses another function in place
    x["nodes"][_h(node)].update(d)
    self.calls.append(("graph_set_params", self.functions[d["func"]][0]))
    return 0

  def cuGraphLaunch(self, exe, stream):
    x = self.execs.get(_h(exe))
    if x is None: return 400
    assert stream is None or _h(stream) == 0, "graphs launch on the legacy default stream"
    ctx = self._in("cuGraphLaunch", x["ctx"])
    if isinstance(ctx, int): return ctx
    self.calls.append(("graph_launch", len(x["order"])))
    for h in x["order"]:
      n = x["nodes"][h]
      self.calls.append(("graph_kernel", self.functions[n["func"]][0], n["grid"], n["block"], n["args"]))
    self.drv._launched(ctx)
    return 0

  def _destroy(self, table: dict, h, what: str):
    item = table.pop(_h(h), None)
    if item is None: return 400
    ctx = self.drv.Context.get_current()
    if ctx is None or ctx != item["ctx"]: self.drv._problem(f"{what} {_h(h):#x} destroyed out of its context")
    self.calls.append((what,))
    return 0

  def cuGraphExecDestroy(self, exe): return self._destroy(self.execs, exe, "graph_exec_destroy")
  def cuGraphDestroy(self, graph): return self._destroy(self.graphs, graph, "graph_destroy")

  # ---- errors ----
  def cuGetErrorName(self, rc, pstr):
    if rc not in _ERRORS: return 1
    pstr[0] = _ERRORS[rc][0]
    return 0

  def cuGetErrorString(self, rc, pstr):
    if rc not in _ERRORS: return 1
    pstr[0] = _ERRORS[rc][1]
    return 0


def make_fake_libcuda(drv, calls: list, **kw) -> FakeLibCuda: return FakeLibCuda(drv, calls, **kw)


def install_fake_graphs(monkeypatch, drv, calls: list, **kw) -> FakeLibCuda:
  """Make the runtime's graph layer use a FakeLibCuda over `drv` (the pycuda stand-in)."""
  lib = FakeLibCuda(drv, calls, **kw)
  api = GraphAPI(lib)
  monkeypatch.setattr(cuda_graph, "open_api", lambda d: api if d is drv else None)
  monkeypatch.delenv("KILN_CUDA_GRAPHS", raising=False)
  return lib


@pytest.fixture
def fake(monkeypatch):
  calls: list = []
  drv = _drv_tests.install_fake(monkeypatch, calls)
  lib = install_fake_graphs(monkeypatch, drv, calls)
  yield calls, drv, lib
  gc.collect()
  assert drv._problems() == []  # pycuda's context rules held; graphs and their modules died in their context


def _calls(rt, n: int = 6):
  prog = rt.load(_drv_tests._compiled())
  return prog, [prog.bind([8 * i, 8 * i + 8, 8 * i + 16], [1 + i % 3, 100 * (i + 1)]) for i in range(n)]


def _kernels(calls: list, kind: str) -> list:
  return [c[1:] for c in calls if c[0] == kind]


# ---- the ctypes layer ----
def test_kernel_node_params_layout_is_cuda_h_v2() -> None:
  """CUDA_KERNEL_NODE_PARAMS_v2 as cuda.h (12/13) lays it out; checked against the real header where a C compiler has it."""
  f = {n: getattr(KernelNodeParams, n).offset for n, _ in KernelNodeParams._fields_}
  assert ctypes.sizeof(KernelNodeParams) == 72
  assert (f["func"], f["gridDimX"], f["blockDimX"], f["sharedMemBytes"], f["kernelParams"], f["extra"], f["kern"], f["ctx"]) == \
         (0, 8, 20, 32, 40, 48, 56, 64)
  nvcc, cc = find_nvcc(), shutil.which("cc") or shutil.which("gcc")
  homes = [Path(nvcc).resolve().parents[1]] if nvcc else []
  homes += [Path(p) for p in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda") if p]
  inc = next((h / "include" for h in homes if (h / "include" / "cuda.h").exists()), None)
  if inc is None or cc is None: return
  src = "#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\nint main(void){printf(\"%zu\", sizeof(CUDA_KERNEL_NODE_PARAMS));" + \
        "".join(f"printf(\" %zu\", offsetof(CUDA_KERNEL_NODE_PARAMS, {n}));" for n, _ in KernelNodeParams._fields_) + "return 0;}"
  import tempfile
  with tempfile.TemporaryDirectory() as d:
    (Path(d) / "p.c").write_text(src)
    r = subprocess.run([cc, "-I", str(inc), "p.c", "-o", "p"], cwd=d, capture_output=True, text=True)
    if r.returncode != 0: pytest.skip(f"cannot compile against cuda.h: {r.stderr[:200]}")
    out = subprocess.run([str(Path(d) / "p")], capture_output=True, text=True, check=True).stdout.split()
  assert [int(x) for x in out] == [72] + [f[n] for n, _ in KernelNodeParams._fields_]


def test_graph_api_binds_the_v2_names_and_falls_back_to_v1(fake) -> None:
  calls, drv, _ = fake
  for v2 in (True, False):
    lib = FakeLibCuda(drv, calls, v2=v2)
    api = GraphAPI(lib)
    assert api._fns["add_node"] == (lib.cuGraphAddKernelNode_v2 if v2 else lib.cuGraphAddKernelNode) and api.can_update
  assert not GraphAPI(FakeLibCuda(drv, calls, update=False)).can_update

  class Bare: pass
  with pytest.raises(AttributeError): GraphAPI(Bare())  # no graph calls at all: open_api gives None for such a libcuda


def test_graph_errors_read_as_pycudas() -> None:
  class Lib(FakeLibCuda):
    def __init__(self): super().__init__(None, [])
  e = GraphAPI(Lib()).error("cuGraphLaunch", 700)
  assert str(e) == "cuGraphLaunch failed: an illegal memory access was encountered (CUDA_ERROR_ILLEGAL_ADDRESS)" and e.code == 700
  assert "CUresult 12345" in str(GraphAPI(Lib()).error("cuGraphCreate", 12345))


def test_open_api_refuses_a_stand_in_driver(monkeypatch) -> None:
  drv = _drv_tests.make_fake_driver([])
  assert cuda_graph.open_api(drv) is None  # its contexts are not libcuda's: plain launches


# ---- GraphRun ----
def test_a_run_becomes_one_graph_launch_with_the_plain_launches_params(fake) -> None:
  calls, drv, lib = fake
  rt = CUDARuntime("CUDA:0")
  _, bound = _calls(rt, 6)
  with rt.session():
    for b in bound: b.in_session()
  plain = _kernels(calls, "launch")
  run = rt.graph_calls(bound)
  assert isinstance(run, cuda_graph.GraphRun)
  calls.clear()
  with rt.session():
    run()
    run()
  kinds = [c[0] for c in calls]
  assert kinds.count("graph_module_load") == 1 and kinds.count("graph_instantiate") == 1  # built once, at the first call
  assert kinds.count("graph_launch") == 2 and "launch" not in kinds  # no kernel launched one by one
  got = _kernels(calls, "graph_kernel")
  assert got == plain + plain  # same kernels, order, grids, blocks and argument bytes
  assert all(p["shared"] == 0 for p in lib.params_seen) and run.launches == 2
  assert drv.Context.get_current() is None


def test_fewer_than_the_threshold_or_graphs_off_is_plain(fake, monkeypatch) -> None:
  calls, drv, _ = fake
  rt = CUDARuntime("CUDA:0")
  _, bound = _calls(rt, 6)
  assert rt.graph_calls(bound[:cuda_graph.GRAPH_MIN_KERNELS - 1]) is None
  monkeypatch.setenv("KILN_CUDA_GRAPHS", "0")
  assert rt.graph_calls(bound) is None
  monkeypatch.delenv("KILN_CUDA_GRAPHS")
  assert rt.graph_calls(bound) is not None
  rt2 = CUDARuntime("CUDA:0")
  rt2._graph_api = None  # no libcuda graph API (a stand-in driver, no libcuda): plain
  assert rt2.graph_calls(_calls(rt2, 6)[1]) is None


def test_set_vals_updates_the_graph_in_place_or_rebuilds(fake) -> None:
  calls, drv, lib = fake
  rt = CUDARuntime("CUDA:0")
  _, bound = _calls(rt, 5)
  run = rt.graph_calls(bound)
  with rt.session(): run()
  bound[2].set_vals([7, 5000])  # new args and grid: updated in place
  calls.clear()
  with rt.session(): run()
  assert [c[0] for c in calls if c[0].startswith("graph_")][:2] == ["graph_set_params", "graph_launch"]
  assert "graph_instantiate" not in [c[0] for c in calls]
  g = _kernels(calls, "graph_kernel")
  assert g[2][1] == ((5000 + 127) // 128, 7, 1) and _drv_tests.unpack(g[2][3])[3:] == (7, 5000)
  bound[3].set_vals([1, 0])  # an empty grid: the node goes, the graph is rebuilt without it
  calls.clear()
  with rt.session(): run()
  assert [c[0] for c in calls if c[0] in ("graph_exec_destroy", "graph_destroy", "graph_instantiate")] == \
         ["graph_exec_destroy", "graph_destroy", "graph_instantiate"]
  assert len(_kernels(calls, "graph_kernel")) == 4
  bound[3].set_vals([1, 64])
  calls.clear()
  with rt.session(): run()
  assert len(_kernels(calls, "graph_kernel")) == 5 and "graph_instantiate" in [c[0] for c in calls]
  lib.cuGraphExecKernelNodeSetParams_v2 = lambda *a: 801  # the driver refuses the update: rebuilt instead
  rt3 = CUDARuntime("CUDA:0")
  rt3._graph_api = GraphAPI(lib)
  _, b3 = _calls(rt3, 4)
  run3 = rt3.graph_calls(b3)
  with rt3.session(): run3()
  b3[0].set_vals([2, 999])
  calls.clear()
  with rt3.session(): run3()
  assert "graph_instantiate" in [c[0] for c in calls] and _drv_tests.unpack(_kernels(calls, "graph_kernel")[0][3])[3:] == (2, 999)


def test_variables_read_from_memory_leave_the_graph_as_built(fake) -> None:
  """Kernels rendered with vars_in_memory (kiln.codegen.render.cuda_vars) take a pointer to their variables, and their grid
  at the variables' upper bounds: set_vals writes the values to the runtime's array (device_vars.py) and changes no node, so
  the next run copies the written span once (before the graph, on the same stream) and launches the graph as built."""
  calls, drv, lib = fake
  rt = CUDARuntime("CUDA:0")
  prog = rt.load(_drv_tests._compiled(vars_in_memory=True, vars=[Variable(name="m", min=1, max=4), Variable(name="n", min=1, max=300)]))
  bound = [prog.bind([8 * i, 8 * i + 8, 8 * i + 16], [1 + i % 3, 100 * (i + 1)]) for i in range(5)]
  assert all(b.grid == ((300 + 127) // 128, 4, 1) for b in bound)  # the upper bounds'
  run = rt.graph_calls(bound)
  with rt.session(): run()
  args = [b.arg_buf for b in bound]
  slots = [b.slot for b in bound]
  assert all(s is not None and _drv_tests.unpack(a)[3] == s.ptr for a, s in zip(args, slots))  # the pointer after the buffers
  bound[2].set_vals([3, 250])
  bound[4].set_vals([2, 7])
  calls.clear()
  with rt.session(): run()
  work = [c for c in calls if c[0] == "htod" or c[0].startswith("graph_") and c[0] != "graph_kernel"]
  assert [c[0] for c in work] == ["htod", "graph_launch"], work  # nothing updated, nothing rebuilt
  copied = np.frombuffer(work[0][2], np.int32).tolist()
  assert work[0][1] == slots[2].ptr and len(copied) == (slots[4].ptr + 8 - slots[2].ptr) // 4  # the span written
  assert copied[:2] == [3, 250] and copied[-2:] == [2, 7] and [b.arg_buf for b in bound] == args
  calls.clear()
  with rt.session(): run()
  assert [c[0] for c in calls if c[0] == "htod" or c[0] == "graph_launch"] == ["graph_launch"]  # nothing written since: no copy


def test_an_instantiate_error_falls_back_to_plain_launches(fake) -> None:
  calls, drv, lib = fake
  rt = CUDARuntime("CUDA:0")
  _, bound = _calls(rt, 4)
  run = rt.graph_calls(bound)
  lib.fail["cuGraphInstantiateWithFlags"] = [801]
  calls.clear()
  with pytest.warns(RuntimeWarning, match="launching them one by one"):
    with rt.session(): run()
  assert [c[0] for c in calls if c[0] in ("launch", "graph_launch", "graph_destroy")] == ["graph_destroy"] + ["launch"] * 4
  assert run.broken is not None and rt.dead is None
  calls.clear()
  with rt.session(): run()  # given up for good: no second try, no second warning
  assert [c[0] for c in calls if "launch" in c[0]] == ["launch"] * 4


def test_a_fault_in_a_graph_kills_the_context(fake) -> None:
  calls, drv, lib = fake
  rt = CUDARuntime("CUDA:0")
  _, bound = _calls(rt, 4)
  run = rt.graph_calls(bound)
  drv._fault_next_launch()
  with pytest.raises(RuntimeLaunchError, match="launching a CUDA graph of 4 kernels failed.*CUDA_ERROR_ILLEGAL_ADDRESS.*context is dead"):
    with rt.session():
      run()  # the fault shows at the next call, as on a GPU
      run()
  assert rt.dead is not None and drv.Context.get_current() is None
  with pytest.raises(DeviceError, match="device context is dead"):
    with rt.session(): run()
  calls.clear()
  del run
  gc.collect()  # a dead context's graphs are dropped, not destroyed in it
  assert not any(c[0] in ("push", "graph_exec_destroy") for c in calls)


def test_a_graph_launch_that_reports_a_fault_kills_the_context(fake) -> None:
  calls, drv, lib = fake
  rt = CUDARuntime("CUDA:0")
  run = rt.graph_calls(_calls(rt, 4)[1])
  lib.fail["cuGraphLaunch"] = [700]
  with pytest.raises(RuntimeLaunchError, match="cuGraphLaunch failed: an illegal memory access"):
    with rt.session(): run()
  assert rt.dead is not None and drv.Context.get_current() is None


def test_graphs_and_their_modules_are_destroyed_in_their_context(fake) -> None:
  calls, drv, lib = fake
  rt = CUDARuntime("CUDA:0")
  prog, bound = _calls(rt, 4)
  run = rt.graph_calls(bound)
  with rt.session(): run()
  calls.clear()
  run.release()  # outside any session: the context is pushed for it
  assert [c[0] for c in calls] == ["push", "graph_exec_destroy", "graph_destroy", "pop"]
  with rt.session(): run()  # rebuilt on the next call
  calls.clear()
  del run
  gc.collect()
  assert [c[0] for c in calls] == ["push", "graph_exec_destroy", "graph_destroy", "pop"] and not lib.graphs and not lib.execs

  def drop():  # the program dies on another thread: its graph module is unloaded with its context pushed there
    nonlocal prog, bound
    del prog, bound
    gc.collect()
  calls.clear()
  _drv_tests.run_in_thread(drop)
  assert [c[0] for c in calls if c[0] in ("push", "graph_module_unload", "pop")][:3] == ["push", "graph_module_unload", "pop"]
  assert not lib.modules
  assert drv._problems() == []


def test_big_shared_memory_is_allowed_on_the_graph_module_too(fake) -> None:
  calls, drv, lib = fake
  rt = CUDARuntime("CUDA:0")
  prog = rt.load(_drv_tests._compiled(shared_bytes=96 << 10))
  run = rt.graph_calls([prog.bind([16, 32, 48], [1, 64]) for _ in range(4)])
  with rt.session(): run()
  assert ("graph_func_attribute", "k", 8, 96 << 10) in calls and {p["shared"] for p in lib.params_seen} == {96 << 10}


def test_the_real_libcuda_when_present() -> None:
  """On a machine with a driver: the symbols bind (no GPU work)."""
  try: lib = ctypes.CDLL("libcuda.so.1")
  except OSError: pytest.skip("no libcuda.so.1 here")
  api = GraphAPI(lib)
  assert api.can_update and str(api.error("cuGraphLaunch", 700)).endswith("(CUDA_ERROR_ILLEGAL_ADDRESS)")
