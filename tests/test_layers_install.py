"""Each layer installs on its own: a clean venv gets only that layer's folder and the sibling folders it depends on
(non-editable, built by pip), and then the layer imports while every layer above it, and the heavy dependencies
it must not pull in, are absent.

Adding a layer is one line in LAYERS. Each layer also runs a smoke check of what it can do alone: codegen renders a
matmul to LLVM IR and CUDA C with neither llvmlite nor pycuda; runtime-cpu compiles and runs it; runtime-cuda without
its driver extra says what to install; the executor without a runtime says which one is missing; llm opens a GGUF file
written by the gguf package's writer and refuses a truncated one.
The venvs are built once per session, in parallel threads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# always fine to find in a venv: the installer itself
TOOLING = {"pip", "setuptools", "wheel"}


@dataclass(frozen=True)
class Layer:
  name: str
  folders: tuple[str, ...]  # under packages/, installed together (non-editable)
  imports: tuple[str, ...]  # must import
  absent: tuple[str, ...]  # must NOT be importable: upper layers, heavy dependencies
  third_party: frozenset[str] = field(default_factory=frozenset)  # exact set of non-kiln direct dependencies, if given
  check: str = ""  # extra python run in the venv after the imports (a smoke check)


UPPER_OF_IR = ("kiln.codegen", "kiln.runtime", "kiln.runtime.cpu", "kiln.runtime.cuda", "kiln.executor", "llvmlite", "pycuda")
UPPER_OF_CODEGEN = ("kiln.runtime", "kiln.runtime.cpu", "kiln.runtime.cuda", "kiln.executor", "llvmlite", "pycuda")

MATMUL = """
from kiln.ir import UOp, Ops, AxisType, dtypes
M = N = K = 64
c, a = UOp.define_global(0, dtypes.float32.ptr(M * N)), UOp.define_global(1, dtypes.float32.ptr(M * K))
b = UOp.define_global(2, dtypes.float32.ptr(K * N))
i, j, k = UOp.range(M, 0), UOp.range(N, 1), UOp.range(K, 2, AxisType.REDUCE)
matmul = UOp.sink(c.index(i * N + j).store((a.index(i * K + k).load() * b.index(k * N + j).load()).reduce(Ops.ADD, k)), name="matmul")
"""
CHECK_CODEGEN = MATMUL + """
from kiln.codegen.render.llvm import LLVMRenderer
from kiln.codegen.render.cuda import CUDARenderer
ll, cu = LLVMRenderer().render(matmul).src, CUDARenderer().render(matmul).src
assert "define void @matmul" in ll and '__global__' in cu and 'matmul' in cu, (ll[:200], cu[:200])
report["rendered"] = [len(ll.splitlines()), len(cu.splitlines())]
"""
CHECK_CPU = MATMUL + """
import numpy as np
from kiln.codegen.registry import get_runtime
rt = get_runtime("CPU")
prog = rt.load(rt.compiler.compile(rt.renderer.render(matmul)))
A, B, C = np.random.rand(M, K).astype(np.float32), np.random.rand(K, N).astype(np.float32), np.zeros(M * N, np.float32)
prog([C.ctypes.data, A.ctypes.data, B.ctypes.data])
assert np.allclose(C.reshape(M, N), A @ B, rtol=1e-4)
report["ran"] = True
"""
CHECK_CUDA = MATMUL + """
from kiln.codegen.registry import get_runtime
from kiln.ir.errors import DeviceError
try: get_runtime("CUDA"); raise AssertionError("a CUDA runtime without pycuda")
except DeviceError as e: assert "kiln-runtime-cuda[driver]" in str(e), str(e)
report["driver_error"] = True
import shutil
if shutil.which("nvcc"):  # compiles with no driver and no pycuda
  from kiln.codegen.render.cuda import CUDARenderer
  from kiln.runtime.cuda.compiler import CUDACompiler
  cs = CUDACompiler().compile(CUDARenderer().render(matmul))
  assert cs.bytes and ".entry" in CUDACompiler().compile_ptx(cs.src, cs.name), "no cubin/PTX"
  report["compiled"] = len(cs.bytes)
"""
CHECK_EXECUTOR = MATMUL + """
from kiln.executor import Buffer, ExecutionPlanBuilder
from kiln.ir.errors import DeviceError
b = ExecutionPlanBuilder("CPU")
try:
  b.add_kernel(matmul, [b.add_buffer(Buffer("CPU", M * N, dtypes.float32)) for _ in range(3)]); b.set_outputs([0]); b.build()
  raise AssertionError("built a CPU plan with no CPU runtime installed")
except DeviceError as e: assert "kiln-runtime-cpu" in str(e), str(e)
report["no_runtime_error"] = True
"""
CHECK_GRAPH = """
import numpy as np
from kiln.graph import Tensor, compile
x, w, b = (np.random.rand(*s).astype(np.float32) for s in ((8, 16), (24, 16), (24,)))
c = compile([Tensor(x).linear(Tensor(w), Tensor(b)).relu().softmax()])
y = np.maximum(x @ w.T + b, 0)
want = np.exp(y - y.max(-1, keepdims=True)); want /= want.sum(-1, keepdims=True)
assert np.allclose(c.run()[0], want, rtol=1e-4, atol=1e-6)
report["kernels"] = c.kernel_count
from kiln.graph import ONNXError
import kiln.graph.onnx
try: kiln.graph.onnx.load("model.onnx"); raise AssertionError("loaded ONNX without onnx installed")
except ONNXError as e: assert "kiln-graph[onnx]" in str(e), str(e)
report["onnx_error"] = True
"""
CHECK_DISTRIBUTED = """
from kiln.distributed import DistributedError, Placement, serve
from kiln.distributed.fleet import ray_module
try: ray_module(); raise AssertionError("a Ray cluster without ray.init")
except DistributedError as e: assert "ray.init" in str(e), str(e)
try: serve(None); raise AssertionError("served something that is not a PlanSpec")  # type: ignore[arg-type]
except DistributedError as e: assert "PlanSpec" in str(e), str(e)
assert Placement(resources={"host1": 1}).actor_options()["resources"] == {"host1": 1}
report["typed_errors"] = True
"""

CHECK_LLM = """
import os, tempfile
import gguf
import numpy as np
from gguf.quants import dequantize, quantize
from kiln.llm.checkpoint_open import open_checkpoint
from kiln.llm.errors import CheckpointError
p = os.path.join(tempfile.mkdtemp(), "m.gguf")
h, f, v, Q8 = 32, 64, 16, gguf.GGMLQuantizationType.Q8_0
w = gguf.GGUFWriter(p, "llama")
w.add_context_length(64); w.add_embedding_length(h); w.add_block_count(1); w.add_feed_forward_length(f)
w.add_head_count(4); w.add_head_count_kv(4); w.add_layer_norm_rms_eps(1e-5)
shapes = {"token_embd": (v, h), "output_norm": (h,), "output": (v, h), "blk.0.attn_norm": (h,), "blk.0.ffn_norm": (h,), "blk.0.attn_q": (h, h),
          "blk.0.attn_k": (h, h), "blk.0.attn_v": (h, h), "blk.0.attn_output": (h, h), "blk.0.ffn_gate": (f, h), "blk.0.ffn_up": (f, h),
          "blk.0.ffn_down": (h, f)}
rng, raw = np.random.default_rng(0), {}
for n, s in shapes.items():
  a = rng.standard_normal(s).astype(np.float32)
  if len(s) == 2: raw[n] = quantize(a, Q8); w.add_tensor(n + ".weight", raw[n], raw_dtype=Q8)
  else: w.add_tensor(n + ".weight", a)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
ck = open_checkpoint(p)
assert ck.config.arch == "llama" and len(ck.names()) == len(shapes), ck.names()
assert np.array_equal(ck.tensor("model.layers.0.mlp.up_proj.weight"), dequantize(raw["blk.0.ffn_up"], Q8))
with open(p, "r+b") as fh: fh.truncate(200)
try: open_checkpoint(p); raise AssertionError("opened a truncated GGUF")
except CheckpointError as e: assert p in str(e), str(e)
report["checkpoint"] = True
"""

LAYERS = [
  Layer("uop-ir", ("uop-ir",), ("kiln.ir",), UPPER_OF_IR, frozenset({"numpy", "pydantic"})),
  Layer("codegen", ("uop-ir", "codegen"), ("kiln.ir", "kiln.codegen"), UPPER_OF_CODEGEN, check=CHECK_CODEGEN),
  Layer("runtime-cpu", ("uop-ir", "codegen", "runtime-cpu"), ("kiln.runtime.cpu",), ("kiln.executor", "kiln.runtime.cuda", "pycuda"),
        check=CHECK_CPU),
  Layer("runtime-cuda", ("uop-ir", "codegen", "runtime-cuda"), ("kiln.runtime.cuda",), ("kiln.executor", "kiln.runtime.cpu", "llvmlite", "pycuda"),
        check=CHECK_CUDA),
  Layer("executor", ("uop-ir", "codegen", "executor"), ("kiln.executor",), ("kiln.runtime.cpu", "kiln.runtime.cuda", "llvmlite", "pycuda"),
        check=CHECK_EXECUTOR),
  Layer("graph", ("uop-ir", "codegen", "runtime-cpu", "executor", "graph"), ("kiln.graph",),
        ("onnx", "onnxruntime", "torch", "kiln.runtime.cuda", "pycuda"), check=CHECK_GRAPH),
  Layer("distributed", ("uop-ir", "codegen", "executor", "distributed"), ("kiln.distributed",),
        ("kiln.graph", "kiln.runtime.cpu", "kiln.runtime.cuda", "llvmlite", "pycuda", "onnx", "torch"), check=CHECK_DISTRIBUTED),
  Layer("llm", ("uop-ir", "codegen", "runtime-cpu", "executor", "graph", "llm"), ("kiln.llm",),
        ("kiln.distributed", "ray", "kiln.runtime.cuda", "pycuda", "onnx", "onnxruntime", "torch", "transformers"), check=CHECK_LLM),
]

# Runs inside the layer's venv with `python -I`; argv[1] is the Layer as JSON. Prints a JSON report.
PROBE = r"""
import importlib, importlib.metadata as md, json, re, sys
layer = json.loads(sys.argv[1])
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
report = {"imported": [], "present": [], "dists": sorted(norm(d.metadata["Name"]) for d in md.distributions())}
import kiln
report["kiln_is_namespace"] = getattr(kiln, "__file__", None) is None
for mod in layer["imports"]:
  importlib.import_module(mod); report["imported"].append(mod)
for mod in layer["absent"]:
  try:
    importlib.import_module(mod)
  except ModuleNotFoundError:
    continue
  report["present"].append(mod)
# every installed distribution must be needed by an installed kiln layer (transitive closure of Requires-Dist)
from pip._vendor.packaging.requirements import Requirement  # the venv's own pip: no third-party import
def reqs(name):
  out = []
  for r in md.requires(name) or []:
    req = Requirement(r)
    if "extra ==" in r or (req.marker is not None and not req.marker.evaluate({"extra": ""})): continue  # tqdm's colorama: Windows only
    out.append(norm(req.name))
  return out
kiln_dists = [d for d in report["dists"] if d.startswith("kiln-")]
report["direct"] = sorted({r for d in kiln_dists for r in reqs(d)} - set(kiln_dists))
seen, todo = set(kiln_dists), list(kiln_dists)
while todo:
  for r in reqs(todo.pop()):
    if r not in seen: seen.add(r); todo.append(r)
report["needed"] = sorted(seen)
exec(layer["check"])
print(json.dumps(report))
"""


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "HATCH_ENV"))}
  return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, **kw)


def _wheels(where: Path) -> dict[str, Path]:
  """Every layer's wheel, built once by pip from its folder (non-editable): folder -> wheel file. Each venv installs the
  wheels of its own folders only, so a folder is built once, not once for every venv that needs it."""
  folders = sorted({f for layer in LAYERS for f in layer.folders})
  where.mkdir(parents=True, exist_ok=True)
  p = _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(where),
            *(str(ROOT / "packages" / f) for f in folders)], cwd=where)
  if p.returncode != 0: raise RuntimeError(f"pip wheel of {folders} failed:\n{p.stdout}\n{p.stderr}")
  out = {}
  for f in folders:
    found = list(where.glob(f"kiln_{f.replace('-', '_')}-*.whl"))
    if len(found) != 1: raise RuntimeError(f"pip wheel built {len(found)} wheels for packages/{f}: {sorted(x.name for x in where.iterdir())}")
    out[f] = found[0]
  return out


def _build(layer: Layer, where: Path, wheels: Future[dict[str, Path]]) -> Path:
  """A clean venv (no system site-packages) with only this layer's folders installed (their wheels, built by pip)."""
  # symlinks, not copies: a thread copying the interpreter while another forks lets the child hold the copy open for
  # writing, and running it then fails with ETXTBSY ("Text file busy"), as seen once in CI-like runs
  venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True, symlinks=True).create(where)
  py = where / "bin" / "python"
  built = wheels.result()
  p = _run([str(py), "-m", "pip", "install", "--quiet", *(str(built[f]) for f in layer.folders)], cwd=where)
  if p.returncode != 0: raise RuntimeError(f"pip install of {layer.folders} failed:\n{p.stdout}\n{p.stderr}")
  return py


@pytest.fixture(scope="session")
def layer_venvs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[Path]]:
  base = tmp_path_factory.mktemp("layer-venvs")
  pool = ThreadPoolExecutor(max_workers=len(LAYERS) + 1)
  wheels = pool.submit(_wheels, base / "wheels")
  futures = {layer.name: pool.submit(_build, layer, base / layer.name, wheels) for layer in LAYERS}
  pool.shutdown(wait=False)
  return futures


@pytest.mark.slow_install
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layer", LAYERS, ids=lambda la: la.name)
def test_layer_installs_alone(layer: Layer, layer_venvs: dict[str, Future[Path]]) -> None:
  py = layer_venvs[layer.name].result()
  spec = {"imports": layer.imports, "absent": layer.absent, "check": layer.check}
  p = _run([str(py), "-I", "-c", PROBE, json.dumps(spec)], cwd=py.parent)
  assert p.returncode == 0, f"{layer.name}: probe failed in its own venv:\n{p.stdout}\n{p.stderr}"
  report = json.loads(p.stdout.strip().splitlines()[-1])
  assert report["imported"] == list(layer.imports)
  assert report["present"] == [], f"{layer.name}: a layer above it or a heavy dependency is importable: {report['present']}"
  assert report["kiln_is_namespace"], "kiln/ must stay a PEP 420 namespace package (no __init__.py)"
  extra = set(report["dists"]) - set(report["needed"]) - TOOLING
  assert not extra, f"{layer.name}: installed distributions nothing declared needs: {sorted(extra)}"
  if layer.third_party:
    assert set(report["direct"]) == layer.third_party, f"{layer.name}: direct third-party deps {report['direct']}"


def test_layers_table_is_consistent() -> None:
  """Every folder named in LAYERS is a package folder with a pyproject.toml."""
  named = {f for layer in LAYERS for f in layer.folders}
  for folder in named:
    assert (ROOT / "packages" / folder / "pyproject.toml").is_file(), f"packages/{folder} has no pyproject.toml"
