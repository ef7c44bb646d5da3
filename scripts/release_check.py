"""The release check's Python (scripts/release-check builds the artifacts, makes the work folder and runs this):
python scripts/release_check.py WORK. Inspects every artifact in dist/, then for each layer a fresh venv under WORK with only
that layer's wheel and the sibling wheels its metadata requires, and a smoke check of what that layer alone can do; prints
the table and returns non-zero on any failure."""
import email.message
import email.parser
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "dist"


def norm(s: str) -> str: return re.sub(r"[-_.]+", "-", s).lower()


def _first(pattern: str, text: str, group: int = 0) -> str:
  m = re.search(pattern, text)
  if m is None: raise ValueError(f"{pattern!r} not found in {text[:80]!r}")
  return m.group(group)


VERSION = _first(r"__version__\s*=\s*[\"']([^\"']+)", (ROOT / "version.py").read_text(), 1)
# distribution -> its import package (None: the meta-package, no code)
MODULES = {"kiln-uop-ir": "kiln.ir", "kiln-codegen": "kiln.codegen", "kiln-runtime-cpu": "kiln.runtime.cpu",
           "kiln-runtime-cuda": "kiln.runtime.cuda", "kiln-executor": "kiln.executor", "kiln-graph": "kiln.graph", "kiln": None}
UPPER = ["kiln.codegen", "kiln.runtime.cpu", "kiln.runtime.cuda", "kiln.executor", "llvmlite", "pycuda"]


def say(msg: str) -> None: print(f"[kiln] {msg}", file=sys.stderr, flush=True)


def wheel_of(dist: str) -> Path:
  return DIST / f"{dist.replace('-', '_')}-{VERSION}-py3-none-any.whl"


def metadata(whl: Path) -> email.message.Message:
  with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    return email.parser.Parser().parsestr(z.read(name).decode())


def requires(whl: Path) -> list[str]:
  """Requires-Dist of a wheel, without the ones behind an extra."""
  return [r for r in metadata(whl).get_all("Requires-Dist") or [] if "extra ==" not in r]


def closure(dist: str) -> tuple[list[str], list[str]]:
  """(the kiln distributions `dist` needs, itself included; the third-party requirements of all of them)"""
  kiln, third, todo = [], [], [dist]
  while todo:
    d = todo.pop()
    if d in kiln: continue
    kiln.append(d)
    for r in requires(wheel_of(d)):
      name = norm(_first(r"^[A-Za-z0-9_.\-]+", r))
      if name in MODULES: todo.append(name)
      elif r not in third: third.append(r)
  return kiln, third


# ---- the artifacts ---------------------------------------------------------------------------------------------------
def inspect_artifacts() -> list[str]:
  problems = []
  for dist, mod in MODULES.items():
    whl, sdist = wheel_of(dist), DIST / f"{dist.replace('-', '_')}-{VERSION}.tar.gz"
    if not whl.is_file() or not sdist.is_file():
      problems.append(f"{dist}: missing {whl.name if not whl.is_file() else sdist.name}"); continue
    with zipfile.ZipFile(whl) as z: names = z.namelist()
    md = metadata(whl)
    want = {"Name": dist, "Version": VERSION, "License-Expression": "MIT", "Requires-Python": ">=3.11", "Description-Content-Type": "text/markdown"}
    for k, v in want.items():
      if md.get(k) != v: problems.append(f"{whl.name}: {k} is {md.get(k)!r}, want {v!r}")
    if len(md.get_payload() or "") < 200: problems.append(f"{whl.name}: no README as the long description")
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names): problems.append(f"{whl.name}: no LICENSE")
    code = [n for n in names if ".dist-info/" not in n]
    if mod is None:
      if code: problems.append(f"{whl.name}: the meta-package must ship no code, has {code[:5]}")
    else:
      base = mod.replace(".", "/")
      if f"{base}/py.typed" not in names: problems.append(f"{whl.name}: no {base}/py.typed")
      if f"{base}/version.py" not in names: problems.append(f"{whl.name}: no {base}/version.py")
      stray = [n for n in code if not n.startswith(base + "/")]
      if stray: problems.append(f"{whl.name}: files outside {base}/: {stray[:5]}")
      if any(n in ("kiln/__init__.py", "kiln/runtime/__init__.py") for n in names): problems.append(f"{whl.name}: kiln/ must stay a namespace")
    with tarfile.open(sdist) as t: members = [m.split("/", 1)[1] for m in t.getnames() if "/" in m]
    for f in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "PKG-INFO"):
      if f not in members: problems.append(f"{sdist.name}: no {f}")
    if mod is None and any(m.startswith(("packages/", "tests/", "scripts/")) for m in members):
      problems.append(f"{sdist.name}: carries the layers' files")
  return problems


# ---- smoke checks: run inside the layer's venv (python -I, cwd outside the repo) --------------------------------------
COMMON = r'''
import importlib, importlib.metadata as md, importlib.util, sys
def absent(*mods):
  for m in mods:
    try: found = importlib.util.find_spec(m) is not None
    except ModuleNotFoundError: found = False
    assert not found, f"{m} is importable but must not be installed with this layer"
def check_version(dist, mod):
  v = md.version(dist)
  assert v == VERSION, f"{dist} is {v}, want {VERSION}"
  assert importlib.import_module(mod + ".version").__version__ == v, f"{mod}.version disagrees with the metadata"
  assert importlib.util.find_spec(mod).submodule_search_locations, mod
  import pathlib
  assert any((pathlib.Path(p) / "py.typed").is_file() for p in importlib.util.find_spec(mod).submodule_search_locations), f"{mod}: no py.typed"
notes = []
'''

KERNEL = r'''
import numpy as np
from kiln.ir import UOp, dtypes
N = 64
out, a, b = (UOp.define_global(s, dtypes.float32.ptr(N)) for s in range(3))
i = UOp.range(N, 0)
kernel = UOp.sink(out.index(i).store(a.index(i).load() * 2.0 + b.index(i).load()), name="axpy")
A, B = np.arange(N, dtype=np.float32), np.full(N, 0.5, np.float32)
'''

SMOKE_IR = COMMON + KERNEL + r'''
check_version("kiln-uop-ir", "kiln.ir")
absent(*UPPER)
from kiln.ir.verify import verify
from kiln.ir.reference import run
from kiln.ir.serialize import from_json, to_json
verify(kernel)
got = run(kernel, np.zeros(N, np.float32), A, B)[0]
assert np.array_equal(got, A * 2 + B), "reference evaluator"
assert from_json(to_json(kernel)) is kernel, "JSON round trip (hash-consed: the same object)"
n = UOp.variable("n", 1, 100)
e = (n * 4 + 8) // 4 - n   # == 2 for every n in bounds
if importlib.util.find_spec("kiln.ir.symbolic") is None: notes.append("kiln.ir.symbolic not present: simplify skipped")
else:
  from kiln.ir.symbolic import simplify
  s = simplify(e)
  assert s.op.name == "CONST" and s.arg == 2, f"simplify((n*4+8)//4-n) gave {s}"
  assert (s.vmin, s.vmax) == (2, 2)
  notes.append("simplify (n*4+8)//4-n -> 2")
print("ok: verify, reference, JSON" + "".join(f"; {x}" for x in notes))
'''

SMOKE_CODEGEN = COMMON + KERNEL + r'''
check_version("kiln-codegen", "kiln.codegen")
absent(*UPPER[1:])
from kiln.codegen.registry import available_devices
assert available_devices() == [], f"no runtime is installed, yet {available_devices()}"
from kiln.codegen.render.llvm import LLVMRenderer
spec = LLVMRenderer().render(kernel)
assert "define" in spec.src and spec.name, spec.src[:200]
from kiln.codegen.spec import ProgramSpec
assert ProgramSpec.model_validate_json(spec.model_dump_json()) == spec, "ProgramSpec JSON round trip"
res = f"LLVM IR {len(spec.src.splitlines())} lines"
if importlib.util.find_spec("kiln.codegen.render.cuda") is None: res += "; CUDA C: kiln.codegen.render.cuda not present"
else:
  from kiln.codegen.render.cuda import CUDARenderer
  cu = CUDARenderer().render(kernel)
  assert "__global__" in cu.src, cu.src[:200]
  res += f", CUDA C {len(cu.src.splitlines())} lines"
print("ok: " + res + " (no llvmlite, no pycuda)")
'''

SMOKE_CPU = COMMON + KERNEL + r'''
check_version("kiln-runtime-cpu", "kiln.runtime.cpu")
absent("kiln.runtime.cuda", "kiln.executor", "pycuda")
from kiln.codegen.registry import available_devices, get_runtime
assert {"CPU", "DISK"} <= set(available_devices()), available_devices()
cpu = get_runtime("CPU")
spec = cpu.renderer.render(kernel)
prog = cpu.load(cpu.compiler.compile(spec))
o = np.zeros(N, np.float32)
prog([o.ctypes.data, A.ctypes.data, B.ctypes.data])
assert np.array_equal(o, A * 2 + B), f"compiled kernel gave {o[:8]}"
print(f"ok: {spec.name} compiled with llvmlite and run on numpy buffers, equal to numpy")
'''

SMOKE_CUDA = COMMON + KERNEL + r'''
check_version("kiln-runtime-cuda", "kiln.runtime.cuda")
absent("pycuda", "llvmlite", "kiln.runtime.cpu", "kiln.executor")
import shutil
from kiln.codegen.registry import available_devices, get_runtime
from kiln.ir.errors import DeviceError
assert "CUDA" in available_devices(), available_devices()
res = []
if shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/bin:/usr/local/cuda/bin"):
  from kiln.runtime.cuda.compiler import CUDACompiler
  if importlib.util.find_spec("kiln.codegen.render.cuda") is not None:
    from kiln.codegen.render.cuda import CUDARenderer
    spec = CUDARenderer().render(kernel)
    src, name, how = spec.src, spec.name, "rendered"
  else:
    src = ('extern "C" __global__ void axpy(float* o, const float* a, const float* b) '
           '{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 64) o[i] = a[i] * 2.0f + b[i]; }')
    name, how = "axpy", "hand-written (kiln.codegen.render.cuda not present)"
  ptx, cubin = CUDACompiler().compile_src(src, name)
  assert ".entry" in ptx and len(cubin) > 0, ptx[:200]
  res.append(f"{how} CUDA C -> PTX ({len(ptx.splitlines())} lines) + cubin")
else: res.append("no nvcc: compile skipped")
try:
  get_runtime("CUDA")
  raise AssertionError("get_runtime('CUDA') succeeded without pycuda")
except DeviceError as e:
  assert "kiln-runtime-cuda[driver]" in str(e), f"the launch error does not say how to fix it: {e}"
  res.append("launch: DeviceError names [driver]")
print("ok: " + "; ".join(res))
'''

SMOKE_EXECUTOR_ALONE = COMMON + KERNEL + r'''
check_version("kiln-executor", "kiln.executor")
absent("kiln.runtime.cpu", "kiln.runtime.cuda", "llvmlite", "pycuda")
import subprocess, os
p = subprocess.run(["kiln", "info"], capture_output=True, text=True)
assert p.returncode == 0, f"kiln info failed: {p.stdout}{p.stderr}"
assert "none" in p.stdout.split("devices:")[1].splitlines()[0], p.stdout
from kiln.executor import Buffer, ExecutionPlanBuilder
from kiln.ir.errors import KilnError
err = None
try:
  bld = ExecutionPlanBuilder(device="CPU")
  ids = [bld.add_buffer(Buffer("CPU", N, "float32")) for _ in range(3)]
  bld.add_kernel(kernel, buffers=ids)
  bld.set_outputs([ids[0]])
  bld.build().execute()
except KilnError as e: err = e
assert err is not None, "a plan ran on CPU with no runtime installed"
assert "kiln-runtime-cpu" in str(err), f"the error does not say what to install: {type(err).__name__}: {err}"
print(f"ok: `kiln info` (no devices); a CPU plan fails with {type(err).__name__} naming kiln-runtime-cpu")
'''

SMOKE_DEMO = COMMON + r'''
check_version("kiln-executor", "kiln.executor")
absent(*EXTRA_ABSENT)
import subprocess
p = subprocess.run(DEMO_CMD, capture_output=True, text=True)
if p.returncode != 0 or "result: OK" not in p.stdout:
  raise AssertionError(f"{' '.join(DEMO_CMD)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
diff = next((l.split(":")[1].strip() for l in p.stdout.splitlines() if l.startswith("largest difference")), "?")
demo_res = f"`{' '.join(DEMO_CMD)}` result OK (max diff {diff})"
print("ok: " + demo_res)
'''

SMOKE_META = SMOKE_DEMO + r'''
for d in ["kiln-uop-ir", "kiln-codegen", "kiln-runtime-cpu", "kiln-runtime-cuda", "kiln-executor", "kiln-graph", "kiln"]:
  assert md.version(d) == VERSION, d
p = subprocess.run(["kiln", "info"], capture_output=True, text=True)
devs = p.stdout.split("devices:")[1].splitlines()[0]
assert p.returncode == 0 and all(d in devs for d in ("CPU", "CUDA", "DISK")), p.stdout + p.stderr
print(f"ok: {demo_res}; all seven at {VERSION}; `kiln info` lists {devs.strip()}")
'''

SMOKE_GRAPH = COMMON + r'''
check_version("kiln-graph", "kiln.graph")
absent("onnx", "onnxruntime", "torch", "kiln.runtime.cuda", "pycuda")
import numpy as np
from kiln.graph import Tensor, compile
x, w = np.random.rand(8, 16).astype(np.float32), np.random.rand(4, 16).astype(np.float32)
c = compile([Tensor(x).linear(Tensor(w)).softmax()])
y = x @ w.T
want = np.exp(y - y.max(-1, keepdims=True)); want /= want.sum(-1, keepdims=True)
assert np.allclose(c.run()[0], want, rtol=1e-4, atol=1e-6)
print(f"ok: a linear + softmax Tensor graph runs as {c.kernel_count} kernel(s) and matches numpy")
'''

# (row, distribution whose closure is installed, extra distributions installed beside it, smoke code, its extra globals)
ROWS = [
  ("uop-ir", "kiln-uop-ir", [], SMOKE_IR, {}),
  ("codegen", "kiln-codegen", [], SMOKE_CODEGEN, {}),
  ("runtime-cpu", "kiln-runtime-cpu", [], SMOKE_CPU, {}),
  ("runtime-cuda", "kiln-runtime-cuda", [], SMOKE_CUDA, {}),
  ("executor", "kiln-executor", [], SMOKE_EXECUTOR_ALONE, {}),
  ("executor+cpu", "kiln-executor", ["kiln-runtime-cpu"], SMOKE_DEMO,
   {"DEMO_CMD": ["python", "-m", "kiln.executor.demo", "--runs", "3"], "EXTRA_ABSENT": ["kiln.runtime.cuda", "pycuda"]}),
  ("graph+cpu", "kiln-graph", ["kiln-runtime-cpu"], SMOKE_GRAPH, {}),
  ("kiln (meta)", "kiln", [], SMOKE_META, {"DEMO_CMD": ["kiln", "demo", "--runs", "3"], "EXTRA_ABSENT": ["pycuda"]}),
]


def run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
  return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def check_row(work: Path, row: str, dist: str, extra: list[str], smoke: str, globs: dict) -> tuple[str, str, bool, str]:
  """(install time, result, ok, log), the venv made under `work`"""
  kiln: list[str] = []
  third: list[str] = []
  for d in [dist, *extra]:
    k, t = closure(d)
    kiln += [x for x in k if x not in kiln]
    third += [x for x in t if x not in third]
  venv = work / re.sub(r"[^a-z0-9]+", "-", row.lower()).strip("-")
  env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "HATCH", "KILN_"))}
  env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), KILN_CACHE_DIR=str(venv / "kiln-cache"))
  py = str(venv / "bin" / "python")
  t0 = time.perf_counter()
  steps = [
    [sys.executable, "-m", "venv", "--clear", str(venv)],
    *([[py, "-m", "pip", "install", "--quiet", *third]] if third else []),
    [py, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", *(str(wheel_of(k)) for k in kiln)],
    [py, "-m", "pip", "check"],
  ]
  for cmd in steps:
    p = run(cmd, env, work)
    if p.returncode != 0:
      return f"{time.perf_counter() - t0:.1f} s", f"FAIL: {' '.join(cmd[2:5])} ... exited {p.returncode}", False, p.stdout + p.stderr
  t_install = f"{time.perf_counter() - t0:.1f} s"
  prelude = f"VERSION = {VERSION!r}\nUPPER = {UPPER!r}\n" + "".join(f"{k} = {v!r}\n" for k, v in globs.items())
  p = run([py, "-I", "-c", prelude + smoke], env, venv)
  lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ok:")]
  if p.returncode == 0 and lines: return t_install, "OK: " + lines[-1][4:], True, ""
  err = (p.stderr.strip().splitlines() or ["no output"])[-1]
  return t_install, f"FAIL: {err[:160]}", False, p.stdout[-4000:] + p.stderr[-4000:]


def main(argv: list[str]) -> int:
  if len(argv) != 1: raise SystemExit("usage: release_check.py WORK  (the folder for the venvs; scripts/release-check makes it)")
  work = Path(argv[0])
  say(f"inspecting dist/ (version {VERSION})")
  problems = inspect_artifacts()
  for pr in problems: say(f"artifact problem: {pr}")
  table = [("artifacts", f"{len(list(DIST.glob('*.whl')))} whl", "-", "OK: 6 sdists, 6 wheels: metadata, README, LICENSE, py.typed, no meta code"
            if not problems else f"FAIL: {len(problems)} problem(s), see above", not problems)]
  for row, dist, extra, smoke, globs in ROWS:
    if not wheel_of(dist).is_file():
      table.append((row, "-", "-", f"FAIL: {wheel_of(dist).name} missing", False)); continue
    say(f"{row}: fresh venv, install, smoke check")
    t, res, ok, log = check_row(work, row, dist, extra, smoke, globs)
    if not ok: say(f"{row} failed:\n{log}")
    table.append((row, f"{wheel_of(dist).stat().st_size / 1024:.1f} KiB", t, res, ok))
  widths = [max(len(str(r[i])) for r in table + [("layer", "wheel", "install", "result", True)]) for i in range(3)]
  print()
  print(f"{'layer':<{widths[0]}}  {'wheel':>{widths[1]}}  {'install':>{widths[2]}}  result")
  for name, size, t, res, _ in table: print(f"{name:<{widths[0]}}  {size:>{widths[1]}}  {t:>{widths[2]}}  {res}")
  failed = [r[0] for r in table if not r[4]]
  print(f"\nrelease-check {VERSION}: " + (f"FAILED ({', '.join(failed)})" if failed else "all layers OK"))
  return 1 if failed else 0


if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
