"""The benchmark's weight-loading row (issue 15): "load of a model whose weights exceed the cache is not a copy".

A safetensors file of float32 weights many times the last-level cache (1 GiB on a full run, sized down to what the
temp directory's free disk and the free RAM allow) is loaded with kiln.graph.weights.load_safetensors, and a plan of a
model that uses one of its weights (x @ W.T) is built. Loading maps the file through the DISK device: the row reports
the time to load and build the plan, the bytes mapped, and what became resident: the map's faulted-in pages
(/proc/self/smaps) and the process's anonymous memory (RssAnon), where a copy would land. Beside it, numpy's column is
np.fromfile of the same file: the copy a loader that reads pays. The first run of the plan is where the weight's pages are
read; its time is in the note.

The page cache cannot be emptied without root: after writing, the file is fsync'ed and posix_fadvise(DONTNEED) asks the
kernel to drop its clean pages (advisory; on a busy machine some may stay). kiln.graph.weights is imported inside the row.
"""
from __future__ import annotations

import functools
import gc
import glob
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from kiln_bench.bench import Bench
from kiln_bench.harness import MB, WrongResult, check, medians
from kiln_bench.table import Row

WORK = "safetensors load, weights > cache (kiln.graph)"
TENSORS, BATCH = 4, 8
GIB = 1 << 30


def llc_bytes() -> tuple[int, str]:
  """The largest cache one core sees (sysfs: cpu0's highest level), else sysconf's L3 size; (0, why) when neither says."""
  best = (0, 0)
  for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
    try:
      level, size = int(open(f"{d}/level").read()), open(f"{d}/size").read().strip()
      n = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[size[-1]] if size[-1] in "KMG" else int(size)
      best = max(best, (level, n))
    except (OSError, ValueError, KeyError): continue
  if best[1]: return best[1], f"L{best[0]} of cpu0, sysfs"
  try:
    n = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    if n > 0: return n, "L3, sysconf"
  except (ValueError, OSError): pass
  return 0, "cache size unknown"


def _avail_ram() -> int:
  try:
    with open("/proc/meminfo") as f: return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
  except (OSError, StopIteration): return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _rss_anon() -> int | None:
  try:
    with open("/proc/self/status") as f: return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
  except (OSError, StopIteration): return None


def file_size(scale: float, llc: int, where: str) -> tuple[int, str]:
  """Bytes of weights to write: max(1 GiB, 8 x LLC) scaled, at most an eighth of the free disk and a quarter of the free
  RAM (the file is generated in memory before it is written), and at least 4 MB."""
  want = int(max(GIB, 8 * llc) * min(scale, 1.0))
  cap = min(shutil.disk_usage(where).free // 8, _avail_ram() // 4)
  size = max(min(want, cap), 4 << 20)
  return size, ("" if size >= want else f"sized down from {want / MB:.0f} MB to fit the free disk/RAM")


def _drop_cache(path: str) -> str:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return "page cache: fsync + posix_fadvise(DONTNEED) asked (advisory, no root to force it cold)"
  except (OSError, AttributeError) as e: return f"page cache: could not ask to drop it ({e}); pages are likely warm"
  finally: os.close(fd)


def load(b: Bench, r: Row) -> None:
  from kiln.graph import Tensor, compile
  from kiln.graph.weights import file_maps, load_safetensors, save_safetensors
  llc, llc_how = llc_bytes()
  with tempfile.TemporaryDirectory(prefix="kiln-bench-load-") as d:
    total, sized = file_size(b.scale, llc, d)
    cols = 4096 if total >= 64 << 20 else 512
    rows = max(BATCH, total // (TENSORS * cols * 4))
    path = os.path.join(d, "model.safetensors")
    rng = np.random.default_rng(15)
    save_safetensors(path, {f"layer{i}.weight": rng.random((rows, cols), dtype=np.float32) - 0.5 for i in range(TENSORS)})
    gc.collect()  # the generated arrays are gone before anything is measured
    fbytes, cache_how = os.path.getsize(path), _drop_cache(path)
    x = rng.standard_normal((BATCH, cols)).astype(np.float32)

    anon0 = _rss_anon()
    st = time.perf_counter()
    w = load_safetensors(path)
    t_load = time.perf_counter() - st
    c = compile([Tensor.input("x", (BATCH, cols)).linear(w["layer1.weight"])])
    t_first = time.perf_counter() - st
    maps = file_maps(path) or []
    mapped, res_built = sum(m.end - m.start for m in maps), sum(m.rss for m in maps)
    anon_built = None if anon0 is None or (a := _rss_anon()) is None else a - anon0
    st = time.perf_counter()
    got = c.run({"x": x})[0]
    t_run1 = time.perf_counter() - st
    res_run = sum(m.rss for m in file_maps(path) or [])
    check("x @ W.T over the mapped weight", got, x @ np.asarray(w["layer1.weight"].node.arg.data).T, rtol=1e-4, atol=1e-3)
    (t_run,) = medians([functools.partial(c.run, {"x": x})], b.t)
    wbytes = rows * cols * 4
    if maps and wbytes >= 64 << 20:  # smaller weights cannot be told apart from the compiler's own memory
      if res_built > wbytes // 8: raise WrongResult(f"building the plan faulted in {res_built / MB:.0f} MB of the map: the weights were read")
      if anon_built is not None and anon_built > wbytes // 2:
        raise WrongResult(f"anonymous memory grew {anon_built / MB:.0f} MB loading + building: a weight was copied")
    del w, c, got
    gc.collect()

    def kiln_load() -> Any:  # map the file again and build the plan (the kernel from the memory cache)
      wt = load_safetensors(path)
      return compile([Tensor.input("x", (BATCH, cols)).linear(wt["layer1.weight"])])
    t_map = b.time_row(r, {"kiln": kiln_load, "map": lambda: load_safetensors(path), "numpy": lambda: np.fromfile(path, np.uint8)})["map"]
  r.ratio = r.paired("numpy")
  r.work = f"safetensors load {fbytes / MB:.0f} MB ({TENSORS} x {rows}x{cols} f32) + plan"
  r.achieved = f"{mapped / MB:.0f} MB mapped, {res_built / MB:.2f} MB resident" if maps else "maps not readable here"
  r.limit = f"LLC {llc / MB:.0f} MB ({llc_how})" if llc else llc_how
  r.target, r.status = "(report): not a copy", "-"
  anon = f"{anon_built / MB:+.1f} MB" if anon_built is not None else "not measured"
  r.note = (f"kiln: load_safetensors (one read-only map of the file) + compile of x[{BATCH},{cols}] @ W.T with one {wbytes / MB:.0f} MB "
            f"weight, median of repeats (kernel from the memory cache), of which load_safetensors alone {t_map * 1e3:.2f} ms; "
            f"first time {t_load * 1e3:.2f} ms load + "
            f"{(t_first - t_load) * 1e3:.0f} ms plan (kernel cache as configured); resident after load + plan: map {res_built / MB:.2f} MB, "
            f"anonymous {anon}; first run {t_run1 * 1e3:.0f} ms faults the weight in (map resident {res_run / MB:.0f} MB after it), "
            f"warm runs {t_run * 1e3:.1f} ms; "
            f"numpy: np.fromfile of the whole file (a copy, page cache warm after the first); {cache_how}" + (f"; {sized}" if sized else ""))


def run(b: Bench) -> None:
  """The weight-loading row, after the kiln-graph model rows."""
  if not b.wanted(WORK): return
  try:
    import kiln.graph.weights  # noqa: F401
  except ImportError as e:
    b.rows.append(Row(WORK, "ms", status="-", note=f"skipped: {e} (pip install kiln-graph)"))
    return
  b.row(WORK, lambda r: load(b, r), "ms")
