"""kiln.llm against llama.cpp (llama-cpp-python) on the same GGUF files (bench environment; issue 38's comparison).

A random-weight Llama the shape of SmolLM-135M (hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536, vocab
49152, tied embeddings) is built by transformers from a config (no download; initializer_range 0.2 so that greedy picks
are decided by the model, not by rounding). Its weights are written as an F16 GGUF the way llama.cpp's convert_hf_to_gguf.py
writes them (through the tests' converter-style writer, packages/llm/tests/checkpoint_files.py: the converter itself
wants a tokenizer whose pre-tokenizer hash it knows), with the vocabulary type "no_vocab" (token ids are fed to both
directly). Q8_0 and Q4_0 are made from the F16 file by llama.cpp's own quantizer (llama_model_quantize, default
recipe: a Q4_0 file gives the tied embedding / output matrix Q6_K, as downloads have it, which llama.cpp replaces by
Q8_0 here since 576 columns are not a multiple of Q6_K's 256; the tensor types are printed with each row).

Correctness (16-token prompt, teacher-forced logits and 16 greedy tokens): kiln on the F16 file against a numpy
float64 reference model (packages/llm/tests/reference_model.py) on the same float16-rounded weights, and against
llama.cpp on an F32 file with a float32 KV cache, both to 1e-3 of the largest logit; then kiln against llama.cpp on the
F16 file as llama.cpp runs it by default (float16 KV cache, activations rounded to float16 before its F16 matrix
products): reported, not checked, since 30 random layers amplify that rounding.

Speed, per weight type, in interleaved rounds in this process (kiln, llama.cpp, kiln, ...): a 256-token prompt's prefill
and 64 greedy decode steps, each round a new random prompt (kiln would otherwise reuse its cached prefix). Both use the
same thread count; kiln's times are its own Timings (prefill, and the feed of each decode step), llama.cpp's are its
eval() calls (the argmax of the logits is outside the timer, as kiln's sampling is). llama.cpp is built with OpenMP,
whose threads spin at every barrier by default: on a machine busier than its cores that costs llama.cpp far more than
kiln, so --omp-wait-policy passive is offered to measure it both ways (the variable must be set before the OpenMP
runtime loads, hence a flag, not a second peer in the same process).
Decode bandwidth: the weight bytes a decode step reads (every matrix once, the tied embedding once as the output
matrix) x tokens/s, against a BLAS matrix-vector product's read rate on the same threads (a lower bound of the
machine's read bandwidth). kiln keeps the matrices of the types kiln.llm.qweight.PACKED names (Q8_0, the 4-, 5- and
6-bit ones, K-quants, F16, BF16) repacked (the 5- and 6-bit ones as int8 codes: more bytes than the file) and
dequantises any other type to float32 at load: its bytes are those of what load() keeps. Each rate is the median of
the rounds, their lowest and highest beside it.

--memory: time to first token and peak memory, each engine and type in a fresh process (--probe, this script run
again): import, load (kiln: and the compile of the two plans the run uses, "long" and "decode"), the 256-token prompt's
prefill with the first greedy token (TTFT), 63 more decode steps, and the process's peak RSS (VmHWM: mapped file
pages it touched count, for both engines) beside the file's size, with the peak so far after the import and after
the load. kiln runs twice on one new, empty KILN_CACHE_DIR:
cold (every kernel compiled, in worker processes whose peak is printed apart) and then warm (kernels from that cache).

--avx2: both engines held to AVX2 (x86-64-v3) on an AVX-512 host: KILN_CPU=x86-64-v3 is set for kiln before it compiles
anything, and llama-cpp-python built for AVX2 (build_llamacpp_avx2.sh, into .llamacpp-avx2/ at the repository root)
is put first on sys.path before llama_cpp is imported. The header prints what each engine is held to (kiln's target CPU,
llama.cpp's own system info line, which names the extensions built in: no AVX512 there). --keep FOLDER reuses the
quantized files found there (the F16 and F32 ones are written again, the same bytes: the model is seeded).

Run: `$BPY packages/llm/benchmarks/llamacpp_compare.py [--rounds 3] [--threads 2] [--types F16 Q8_0 Q4_0] [--skip-speed]
[--memory] [--avx2] [--keep DIR] [--omp-wait-policy passive]`. Exits 1 when a strict check fails."""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
N_CTX = 512
PROMPT, DECODE, CHECK = 256, 64, 16
AVX2_CPU = "x86-64-v3"  # AVX2, FMA, F16C, BMI2: the level both engines are held to by --avx2
AVX2_DIR = ROOT / ".llamacpp-avx2"  # build_llamacpp_avx2.sh's output (git-ignored)
STRICT_TOL = 1e-3  # float32 arithmetic in different orders, over 30 layers
SMOL: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                            num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                            tie_word_embeddings=True, initializer_range=0.2)
HF_CONFIG = {"model_type": "llama", **SMOL}


def build(folder: Path) -> dict[str, Any]:
  """The SmolLM-135M-shaped random Llama as F32 and F16 GGUF files in folder; returns {"F32": the HF weights as the F32
  file holds them, "F16": as the F16 file holds them (float16-rounded)}."""
  import torch
  from checkpoint_files import write_gguf  # the tests' converter-style writer (convert_hf_to_gguf.py's names and Q/K permutation)
  from transformers import AutoModelForCausalLM, LlamaConfig
  torch.manual_seed(0)
  cfg = LlamaConfig(**SMOL, bos_token_id=None, eos_token_id=None, pad_token_id=None)
  model = AutoModelForCausalLM.from_config(cfg).float().eval()
  weights = {k: v.detach().numpy() for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
  print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
  out = {}
  for ft, code in (("F32", 0), ("F16", 1)):
    meta = {"tokenizer.ggml.model": "no_vocab", "llama.vocab_size": SMOL["vocab_size"], "general.file_type": code}
    dst = gguf_path(folder, ft)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")  # renamed into place: a process reading the old file keeps it
    out[ft] = write_gguf(tmp, HF_CONFIG, weights, fmt=lambda n, ft=ft: ft, meta=meta)
    os.replace(tmp, dst)
  return out


def gguf_path(folder: Path, ftype: str) -> Path: return folder / f"smol135m-random-{ftype}.gguf"


def quantize(src: Path, dst: Path, ftype: str, threads: int) -> None:
  """dst made from src by llama.cpp's quantizer, unless it is there already (the F16 file is the same every run: seeded)."""
  import llama_cpp
  if dst.exists(): return
  tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
  params = llama_cpp.llama_model_quantize_default_params()
  params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
  params.nthread = threads
  with _quiet_stderr(): rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
  if rc != 0: raise RuntimeError(f"llama_model_quantize {src} -> {ftype} failed ({rc})")
  os.replace(tmp, dst)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
  """File descriptor 2 to /dev/null (llama.cpp's quantizer logs every tensor from C)."""
  sys.stderr.flush()
  saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 2)
  try: yield
  finally: os.dup2(saved, 2); os.close(saved); os.close(null)


def decode_bytes(path: Path) -> tuple[int, dict[str, int]]:
  """The bytes of the weights one decode step reads (2-d tensors; the embedding as the tied output matrix), and the
  bytes by tensor type."""
  import gguf
  r = gguf.GGUFReader(str(path))
  total, by_type = 0, dict[str, int]()
  for t in r.tensors:
    if len(t.shape) < 2: continue
    total += int(t.n_bytes)
    by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
  return total, by_type


def read_bandwidth(threads: int, mb: int = 512) -> float:
  """GB/s of a float32 matrix-vector product over an `mb` MB matrix on numpy's BLAS limited to `threads` threads (it
  reads the matrix once): a lower bound of the machine's read bandwidth, best of 5."""
  from threadpoolctl import threadpool_limits
  a = np.ones((mb * 2**20 // 4096, 1024), np.float32)
  x = np.ones(1024, np.float32)
  best = 0.0
  with threadpool_limits(threads):
    for _ in range(5):
      t = time.perf_counter(); a @ x
      best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
  return best


class LlamaCpp:
  """llama.cpp through llama-cpp-python: token ids in, the last position's logits out."""

  def __init__(self, path: Path, threads: int, n_ctx: int = N_CTX, logits_all: bool = False, f32_cache: bool = False) -> None:
    import llama_cpp
    kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_cache else {}  # default: a float16 KV cache
    self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=PROMPT, n_ubatch=PROMPT, n_threads=threads, n_threads_batch=threads,
                               logits_all=logits_all, verbose=False, **kv)
    self.n_vocab = self.llm.n_vocab()

  def last_logits(self) -> np.ndarray:
    import llama_cpp
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,)).copy()

  def logits(self, ids: list[int]) -> np.ndarray:
    self.llm.reset(); self.llm.eval(ids)
    return np.array(self.llm.scores[:len(ids)], np.float32)

  def greedy(self, ids: list[int], n: int) -> tuple[list[int], float, float]:
    """n greedy tokens after ids, with the prefill and decode seconds."""
    self.llm.reset()
    t = time.perf_counter(); self.llm.eval(ids); pre = time.perf_counter() - t
    out, dec = [int(np.argmax(self.last_logits()))], 0.0
    for _ in range(n - 1):
      t = time.perf_counter(); self.llm.eval([out[-1]]); dec += time.perf_counter() - t
      out.append(int(np.argmax(self.last_logits())))
    return out, pre, dec


def agreement(folder: Path, weights: dict[str, Any], threads: int) -> bool:
  """kiln against a numpy float64 reference (packages/llm/tests/reference_model.py) on the F16 file's weights, and against
  llama.cpp on the F32 file with a float32 KV cache (both strict: float32 rounding only), then on the F16 file as
  llama.cpp runs it by default (reported, not checked: llama.cpp rounds the activations to float16 before its F16
  matrix products and keeps a float16 KV cache, and 30 random layers amplify that)."""
  from reference_model import logits as reference_logits

  from kiln.llm import load
  from kiln.llm.config import ModelConfig
  ids = [int(i) for i in np.random.default_rng(1).integers(0, SMOL["vocab_size"], CHECK)]
  ok = True

  def rel(a: np.ndarray, b: np.ndarray) -> float: return float(np.abs(a - b).max() / np.abs(b).max())
  k16 = load(gguf_path(folder, "F16"), context=64)
  ref = reference_logits(ModelConfig.from_hf(HF_CONFIG), weights["F16"], np.array(ids))
  err = rel(k16.logits(ids), ref)
  ok &= err <= STRICT_TOL
  print(f"kiln (F16 file) vs numpy reference: logits max|diff|/max|logit| {err:.1e}   {'OK' if err <= STRICT_TOL else 'WRONG'}")
  for ft, f32_cache in (("F32", True), ("F16", False)):
    k = load(gguf_path(folder, ft), context=64) if ft == "F32" else k16
    got = k.logits(ids)
    want = LlamaCpp(gguf_path(folder, ft), threads, n_ctx=64, logits_all=True, f32_cache=f32_cache).logits(ids)
    err = rel(got, want)
    top1 = int((got.argmax(-1) == want.argmax(-1)).sum())
    top5 = statistics.mean(len(set(np.argsort(-g)[:5]) & set(np.argsort(-w)[:5])) / 5 for g, w in zip(got, want))
    kg = list(k.generate(ids, max_new_tokens=CHECK, stop=[]))
    lg, _, _ = LlamaCpp(gguf_path(folder, ft), threads, n_ctx=64, f32_cache=f32_cache).greedy(ids, CHECK)
    same = next((i for i, (a, b) in enumerate(zip(kg, lg)) if a != b), min(len(kg), len(lg)))
    strict = ft == "F32"
    good = err <= STRICT_TOL and top1 == CHECK and kg == lg
    if strict: ok &= good
    verdict = ("OK" if good else "WRONG") if strict else "(float16 activations and cache in llama.cpp: not checked)"
    print(f"kiln vs llama.cpp, {ft} file, {'float32' if f32_cache else 'float16'} KV cache ({CHECK}-token prompt): logits max|diff|/max|logit| "
          f"{err:.1e}, top-1 equal {top1}/{CHECK}, top-5 overlap {top5:.0%}; greedy {same}/{CHECK} tokens equal   {verdict}")
  return ok


def speed(path: Path, ftype: str, rounds: int, threads: int, bw: float) -> dict[str, Any]:
  from kiln.llm import load
  t = time.perf_counter()
  k = load(path, context=N_CTX)
  k.runner.plan("prefill"); k.runner.plan("long"); k.runner.plan("decode")
  k_load = time.perf_counter() - t
  t = time.perf_counter()
  lc = LlamaCpp(path, threads)
  l_load = time.perf_counter() - t
  rows: dict[str, list[tuple[float, float]]] = {"kiln": [], "llama.cpp": []}
  for r in range(rounds + 1):  # round 0 warms both up and is not counted
    prompt = [int(i) for i in np.random.default_rng(100 + r).integers(0, SMOL["vocab_size"], PROMPT)]
    list(k.generate(prompt, max_new_tokens=DECODE, stop=[]))
    tm = k.timings
    _, pre, dec = lc.greedy(prompt, DECODE)
    if r:
      rows["kiln"].append((tm.rate(tm.prefill_tokens, tm.prefill_s), tm.rate(tm.decode_tokens, tm.decode_s)))
      rows["llama.cpp"].append((PROMPT / pre, (DECODE - 1) / dec))
  wbytes, by_type = decode_bytes(path)
  med = {name: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v)) for name, v in rows.items()}
  load_avg = os.getloadavg()
  types = ", ".join(f"{n} {b / 1e6:.0f} MB" for n, b in sorted(by_type.items()))
  print(f"\n{ftype}: matrices {wbytes / 1e6:.0f} MB ({types}); load+compile kiln {k_load:.1f} s, llama.cpp {l_load:.1f} s; "
        f"load average {load_avg[0]:.1f}")
  kiln_bytes = kiln_decode_bytes(path)
  for name, (p, d) in med.items():
    b = kiln_bytes if name == "kiln" else wbytes
    ps, ds = [r[0] for r in rows[name]], [r[1] for r in rows[name]]  # the rounds' spread: how noisy the machine was
    print(f"  {name:<10} prefill {p:7.1f} tok/s ({min(ps):.0f}-{max(ps):.0f})   decode {d:6.1f} tok/s ({min(ds):.1f}-{max(ds):.1f})   "
          f"decode reads {b / 1e6:4.0f} MB/token = {b * d / 1e9:5.1f} GB/s ({b * d / 1e9 / bw:.0%} of {bw:.0f} GB/s)")
  rp, rd = med["kiln"][0] / med["llama.cpp"][0], med["kiln"][1] / med["llama.cpp"][1]
  # each round's ratio (the two engines ran one after the other in it): on a shared machine whose load changes between
  # rounds, the median of these pairs is steadier than the ratio of the medians
  pp = statistics.median(k[0] / lc[0] for k, lc in zip(rows["kiln"], rows["llama.cpp"]))
  pd = statistics.median(k[1] / lc[1] for k, lc in zip(rows["kiln"], rows["llama.cpp"]))
  print(f"  kiln / llama.cpp: prefill {rp:.2f}x, decode {rd:.2f}x (ratio of the medians); median of the rounds' ratios: "
        f"prefill {pp:.2f}x, decode {pd:.2f}x")
  return {"type": ftype, "kiln": med["kiln"], "llama.cpp": med["llama.cpp"], "ratio": (rp, rd), "load": load_avg[0]}


def isa_lines() -> list[str]:
  """The instructions each engine is held to: kiln's target CPU (KILN_CPU or the host) and llama.cpp's own system info
  (the features its ggml CPU code was built with), with the library it loaded."""
  import llama_cpp

  from kiln.runtime.cpu.compiler import target_cpu
  c = target_cpu()
  named = f"KILN_CPU={c.cpu}" if c.from_env else f"the host ({c.cpu})"
  return [f"kiln compiles for {named}: {8 * c.vector_bytes}-bit vectors, {c.vector_registers} registers, fma {int(c.fma)}",
          f"llama.cpp ({Path(llama_cpp.__file__).parent}): {llama_cpp.llama_print_system_info().decode().strip()}"]


def probe(engine: str, path: Path, threads: int) -> dict[str, Any]:
  """In a fresh process: import the engine, load the file (kiln: and compile the plans a 256-token prompt and its
  decode steps run), prefill a PROMPT-token prompt and pick the first token (the time to first token), decode DECODE - 1
  more; the seconds of each and the process's peak resident set (VmHWM: the file's pages it touched count, as both map
  it; kiln's compile workers are other processes, their largest ru_maxrss reported apart)."""
  import resource
  prompt = [int(i) for i in np.random.default_rng(7).integers(0, SMOL["vocab_size"], PROMPT)]
  out: dict[str, Any] = {"engine": engine, "rss_start_mb": _peak_rss_mb()}
  t = time.perf_counter()
  if engine == "kiln":
    from kiln.codegen import settings
    from kiln.llm import load
    settings.THREADS.set(threads)
    out["import_s"], out["rss_imported_mb"] = time.perf_counter() - t, _peak_rss_mb()
    t = time.perf_counter()
    k = load(path, context=N_CTX)
    k.runner.plan("long"); k.runner.plan("decode")  # the plans this run uses (runtime.py: 256 tokens are one long chunk)
    out["load_s"], out["rss_loaded_mb"] = time.perf_counter() - t, _peak_rss_mb()
    t = time.perf_counter()
    gen = k.generate(prompt, max_new_tokens=DECODE, stop=[])
    toks = [next(gen)]
    out["ttft_s"] = time.perf_counter() - t
    t = time.perf_counter()
    toks += list(gen)
  else:
    import llama_cpp  # noqa: F401 (its import is timed: the library loads here)
    out["import_s"], out["rss_imported_mb"] = time.perf_counter() - t, _peak_rss_mb()
    t = time.perf_counter()
    lc = LlamaCpp(path, threads)
    out["load_s"], out["rss_loaded_mb"] = time.perf_counter() - t, _peak_rss_mb()
    t = time.perf_counter()
    lc.llm.reset(); lc.llm.eval(prompt)
    toks = [int(np.argmax(lc.last_logits()))]
    out["ttft_s"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(DECODE - 1):
      lc.llm.eval([toks[-1]]); toks.append(int(np.argmax(lc.last_logits())))
  out["decode_s"] = time.perf_counter() - t
  if len(toks) != DECODE: raise RuntimeError(f"{engine} gave {len(toks)} tokens, not {DECODE}")
  out["first_tokens"] = toks[:4]
  out["rss_peak_mb"] = _peak_rss_mb()
  out["children_peak_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # kB on Linux
  return out


def _peak_rss_mb() -> float:
  """This process's peak resident set, MB: /proc's VmHWM, not ru_maxrss, which Linux carries over fork and exec (a child
  of this 3 GB benchmark process would start with its peak)."""
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmHWM:"): return int(line.split()[1]) / 1024
  raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def memory(path: Path, ftype: str, args: argparse.Namespace) -> list[dict[str, Any]]:
  """probe() of each engine in fresh processes: kiln with an empty kernel cache (KILN_CACHE_DIR a new folder: every
  kernel compiled) and again with that cache warm, then llama.cpp."""
  import json
  import subprocess
  rows = []
  with tempfile.TemporaryDirectory(prefix="kiln-cold-cache-") as cache:
    for engine, label in (("kiln", "kiln, cold cache"), ("kiln", "kiln, warm cache"), ("llama.cpp", "llama.cpp")):
      env = dict(os.environ, KILN_CACHE_DIR=cache) if engine == "kiln" else dict(os.environ)
      cmd = [sys.executable, __file__, "--probe", engine, str(path), "--threads", str(args.threads)] + (["--avx2"] if args.avx2 else [])
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
      line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
      if proc.returncode or line is None:
        raise RuntimeError(f"{label} probe of {path.name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
      rows.append(dict(json.loads(line[6:]), label=label))
  size = path.stat().st_size / 1e6
  print(f"\n{ftype} (file {size:.0f} MB), fresh processes; load average {os.getloadavg()[0]:.1f}")
  for r in rows:
    total = r["import_s"] + r["load_s"] + r["ttft_s"]
    print(f"  {r['label']:<17} import {r['import_s']:5.2f} s  load {r['load_s']:6.2f} s  TTFT (prefill {PROMPT} + 1st token) "
          f"{r['ttft_s'] * 1e3:6.0f} ms  import+load+TTFT {total:6.2f} s  decode {(DECODE - 1) / r['decode_s']:5.1f} tok/s  "
          f"peak RSS {r['rss_peak_mb']:5.0f} MB (imported {r['rss_imported_mb']:3.0f}, loaded {r['rss_loaded_mb']:4.0f}; "
          f"compile workers' ru_maxrss {r['children_peak_mb']:4.0f})"
          f"  first tokens {r['first_tokens']}")
  return rows


def kiln_decode_bytes(path: Path) -> int:
  """The bytes of the matrices kiln's decode step reads: each 2-d weight as kiln.llm.load keeps it (qweight.pack's planes,
  which for the 5- and 6-bit types hold int8 codes, more than the file's bytes; float32 for a type it does not pack)."""
  from kiln.llm.checkpoint_open import open_checkpoint
  from kiln.llm.qweight import pack
  ck = open_checkpoint(path)
  total = 0
  for name in ck.names():
    if len(shape := ck.shape(name)) < 2: continue
    w = pack(ck.quant(name))
    total += w.nbytes if w is not None else 4 * int(np.prod(shape))
  return total


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--types", nargs="*", default=["F16", "Q8_0", "Q4_0"])
  ap.add_argument("--skip-speed", action="store_true")
  ap.add_argument("--keep", help="a folder to write the GGUF files to (default: a temporary one)")
  ap.add_argument("--omp-wait-policy", choices=["active", "passive"],
                  help="OMP_WAIT_POLICY for llama.cpp's OpenMP threads (unset: libgomp's default, which spins at barriers)")
  ap.add_argument("--avx2", action="store_true",
                  help=f"hold both to AVX2: KILN_CPU={AVX2_CPU} for kiln, and llama-cpp-python built for AVX2 ({AVX2_DIR.name}/, "
                       "made by build_llamacpp_avx2.sh) in place of the installed one")
  ap.add_argument("--memory", action="store_true", help="also time load and first token, and the peak RSS, of each engine in fresh processes")
  ap.add_argument("--probe", nargs=2, metavar=("ENGINE", "GGUF"), help=argparse.SUPPRESS)  # --memory's child process
  args = ap.parse_args()
  if args.avx2:  # before kiln compiles anything and before llama_cpp is imported
    if not (AVX2_DIR / "llama_cpp").is_dir():
      print(f"--avx2: no AVX2 build of llama-cpp-python in {AVX2_DIR}; make it with "
            f"`packages/llm/benchmarks/build_llamacpp_avx2.sh {sys.executable}`", file=sys.stderr)
      return 2
    os.environ["KILN_CPU"] = AVX2_CPU
    sys.path.insert(0, str(AVX2_DIR))
  if args.omp_wait_policy: os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # before torch or llama.cpp loads an OpenMP runtime
  if args.omp_wait_policy == "passive":  # the rates it gives are not llama.cpp's as a user runs it
    print("note: OMP_WAIT_POLICY=passive: llama.cpp's threads sleep at every barrier; on a quiet machine its decode runs at a "
          "quarter of its default rate (SmolLM-135M Q4_0, 2026-11-29: 46 against 169 tokens/s). Compare without it there.")
  if args.probe:
    import json
    print("PROBE " + json.dumps(probe(args.probe[0], Path(args.probe[1]), args.threads)), flush=True)
    return 0
  sys.path.insert(0, str(ROOT / "packages/llm/tests"))  # the converter-style GGUF writer and the numpy reference model
  from kiln.codegen import settings
  settings.THREADS.set(args.threads)
  sys.path.insert(0, str(ROOT / "packages/graph/benchmarks"))
  from zoo.tvshim import import_torchvision
  import_torchvision()  # transformers imports torchvision where it is installed
  import torch
  torch.set_num_threads(args.threads)
  with tempfile.TemporaryDirectory() as tmp:
    d = Path(args.keep or tmp)
    d.mkdir(parents=True, exist_ok=True)
    print("\n".join(isa_lines()))
    weights = build(d)
    for ft in args.types:
      if ft not in ("F16", "F32"): quantize(gguf_path(d, "F16"), gguf_path(d, ft), ft, args.threads)
    ok = agreement(d, weights, args.threads)
    if not args.skip_speed:
      bw = read_bandwidth(args.threads)
      print(f"\n{os.cpu_count()} CPUs, {args.threads} threads each, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
            f"BLAS matrix-vector read bandwidth {bw:.1f} GB/s; {args.rounds} rounds, prompt {PROMPT} tokens, {DECODE} decoded")
      for ft in args.types: speed(gguf_path(d, ft), ft, args.rounds, args.threads, bw)
    if args.memory:
      print(f"\nTime to first token and peak memory: one fresh process per engine and type ({args.threads} threads, a {PROMPT}-token "
            f"prompt, {DECODE} tokens)")
      for ft in args.types: memory(gguf_path(d, ft), ft, args)
  return 0 if ok else 1


if __name__ == "__main__": sys.exit(main())
