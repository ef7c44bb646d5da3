"""kiln's square matrix products against torch (cuBLAS) on one NVIDIA GPU (needs torch there; never in kiln's environments).

  python gpu_matmul.py [--sizes 1024,2048,4096,8192] [--dtypes float16,bfloat16,float32,tf32] [--budget SECONDS]

float16 and bfloat16 take the tensor-core kernel (float32 sums), float32 the SIMT kernel, tf32 float32 inputs on TF32
tensor cores (opt-in on both sides: KILN_CUDA_TF32=1, torch's allow_tf32). Every kernel is compiled first, side by side
(nvcc is a process a kernel). A row: kiln's and torch's TFLOP/s (median of interleaved rounds, gpu_bench.interleaved),
torch's time over kiln's, and the relative error of each against a float64 product of the same inputs (kiln's must be
within 3x torch's, or gpu_check's tolerance: 1e-5 float32, 2e-3 float16 and TF32, 1e-2 bfloat16). Rows past the time
budget are skipped and say so. Writes $OUT/gpu_matmul.json when OUT is set. Exit status 1 when a row is wrong or failed.
--emulate: a dry run without a GPU (kiln on the CPU emulation of CUDA, torch on the CPU; small --sizes)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench  # noqa: E402
from gpu_bench import KilnRun, interleaved  # noqa: E402

from kiln.executor import compile_kernel  # noqa: E402
from kiln.ir import kernels  # noqa: E402
from kiln.ir.dtype import dtypes  # noqa: E402

_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "tf32": torch.float32}
_FLOOR = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5, "tf32": 2e-3}  # relative error always accepted (tools/gpu_check.py's)


def _kiln_dtype(dt: str) -> Any: return getattr(dtypes, "float32" if dt == "tf32" else dt)


def _ast(dt: str, s: int) -> Any: return kernels.matmul(s, s, s, _kiln_dtype(dt), acc_dtype=dtypes.float32, name=f"mm_{dt}_{s}")


def _host(t: torch.Tensor) -> np.ndarray:
  """A CUDA tensor as kiln's host form: bfloat16 as its uint16 bits."""
  t = t.cpu()
  return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _from_kiln(a: np.ndarray, dt: str) -> torch.Tensor:
  if dt == "bfloat16": return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).double()
  return torch.from_numpy(a.copy()).double()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
  got, want = got.double().cpu(), want.double().cpu()
  if not torch.isfinite(got).all(): return float("inf")
  return float(torch.linalg.norm(got - want) / max(float(torch.linalg.norm(want)), 1e-30))


def _tf32(on: bool) -> None:
  os.environ["KILN_CUDA_TF32"] = "1" if on else "0"
  torch.backends.cuda.matmul.allow_tf32 = on
  torch.backends.cudnn.allow_tf32 = on


def precompile(jobs: list[tuple[str, int]]) -> float:
  """Compile every row's kernel (TF32 ones under KILN_CUDA_TF32=1, which the renderer reads); the seconds it took."""
  t0 = time.perf_counter()
  for tf32 in (False, True):
    _tf32(tf32)
    todo = [_ast(dt, s) for dt, s in jobs if (dt == "tf32") == tf32]
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as ex: list(ex.map(lambda a: compile_kernel(a, "CUDA"), todo))
  _tf32(False)
  return time.perf_counter() - t0


DEV = "cuda"


def row(dt: str, s: int) -> dict[str, Any]:
  _tf32(dt == "tf32")
  try:
    g = torch.Generator(device=DEV).manual_seed(s)
    ta = torch.randn(s, s, device=DEV, generator=g).to(_TORCH[dt])
    tb = torch.randn(s, s, device=DEV, generator=g).to(_TORCH[dt])
    k = KilnRun(_ast(dt, s), _kiln_dtype(dt), [(s, s)] * 3, [_host(ta), _host(tb)])
    want = ta.double() @ tb.double()
    got = _from_kiln(k.result(), dt)
    err, terr = _rel(got, want), _rel(ta @ tb, want)
    t = interleaved({"kiln": k, "torch": lambda: ta @ tb})
    del want, got
    flop = 2 * s ** 3
    r = {"dtype": dt, "size": s, "kiln_tflops": flop / t["kiln"] / 1e12, "torch_tflops": flop / t["torch"] / 1e12,
         "torch_over_kiln": t["torch"] / t["kiln"], "kiln_rel_err": err, "torch_rel_err": terr, "ok": err <= max(3 * terr, _FLOOR[dt]),
         "opts": k.plan.prepared_ops[0].kernel.applied_opts}
    print(f"matmul {dt:8s} {s:5d}  kiln {r['kiln_tflops']:7.1f} TFLOP/s  torch {r['torch_tflops']:7.1f} TFLOP/s  kiln/torch speed "
          f"{r['torch_over_kiln']:5.2f}  err kiln {err:.1e} torch {terr:.1e}{'' if r['ok'] else '  WRONG'}  {r['opts'][0]}", flush=True)
    return r
  finally: _tf32(False)


def _emulate() -> None:
  global DEV
  import pytest  # the stand-in driver's module needs it: a dev environment's, never the GPU machine's
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
  from cuda_emu import driver_tests, emulating

  from kiln.codegen import registry
  mp = pytest.MonkeyPatch()
  drv = (mod := driver_tests()).make_fake_driver([], cc=(9, 0))
  emulating(drv, mp)
  mod.install_standin(mp, __import__("pathlib").Path(os.environ.get("TMPDIR", "/tmp")), drv)
  registry.unregister_runtime("CUDA")
  DEV, gpu_bench.sync = "cpu", lambda: None  # type: ignore[assignment]


def main(argv: list[str]) -> int:
  ap = argparse.ArgumentParser(prog="gpu_matmul.py")
  ap.add_argument("--sizes", default="1024,2048,4096,8192")
  ap.add_argument("--dtypes", default="float16,bfloat16,float32,tf32")
  ap.add_argument("--budget", type=float, default=70.0, help="seconds: rows that would start after this are skipped")
  ap.add_argument("--emulate", action="store_true", help="a dry run without a GPU: kiln on the CPU emulation of CUDA "
                  "(the checkout's tests/cuda_emu.py), torch on the CPU")
  a = ap.parse_args(argv)
  if a.emulate: _emulate()
  t0 = time.perf_counter()
  jobs = [(dt, int(s)) for s in a.sizes.split(",") for dt in a.dtypes.split(",")]  # every dtype at a size before the next size
  where = torch.cuda.get_device_name() if DEV == "cuda" else "the CPU (kiln: CUDA emulated)"
  print(f"== matmul on {where} (torch {torch.__version__}); compiling {len(jobs)} kernels", flush=True)
  try: print(f"   compiled in {precompile(jobs):.1f} s", flush=True)
  except Exception:  # the rows compile what is missing (and report the failure each)
    print(f"FAIL  precompile: {traceback.format_exc(limit=3)}", flush=True)
  rows, bad = [], 0
  for dt, s in jobs:
    if time.perf_counter() - t0 > a.budget:
      print(f"skip  matmul {dt} {s}: past the {a.budget:.0f} s budget", flush=True)
      continue
    try: rows.append(r := row(dt, s))
    except Exception:
      print(f"FAIL  matmul {dt} {s}: {traceback.format_exc(limit=4)}", flush=True)
      rows.append(r := {"dtype": dt, "size": s, "ok": False, "error": traceback.format_exc(limit=4)})
    bad += not r["ok"]
    torch.cuda.empty_cache()
  if (out := os.environ.get("OUT")):
    with open(os.path.join(out, "gpu_matmul.json"), "w") as f: json.dump(rows, f, indent=1)
  return 1 if bad else 0


if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
