"""The argument blocks of CPU bound calls: int64 words cut from pages shared by every call of the process. A kernel's
task entry reads its arguments from its block (render.llvm_claim.task_entry); a plan writes a runtime variable's new
value into every block that holds it with one numpy assignment per page (`writer`), where a call at a time cost ~2.5 us
each (a language model's decode step changes its position in some 240 kernels a token). Blocks never move: native code
(a plan's sequence, the pool's workers) holds their addresses. A page lives as long as any block cut from it."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

PAGE_WORDS = 1 << 14  # 128 KiB: a few hundred kernels' blocks

_lock = threading.Lock()
_page: np.ndarray | None = None
_used = 0


def take(n: int) -> np.ndarray:
  """n int64 words of a page: a view, which keeps its page alive."""
  global _page, _used
  with _lock:
    if _page is None or _used + n > len(_page): _page, _used = np.zeros(max(PAGE_WORDS, n), np.int64), 0
    block = _page[_used:_used + n]
    _used += n
  return block


def writer(sites: Sequence[tuple[np.ndarray, int]]) -> Callable[[int], None]:
  """One callable that writes a value at word i of each (block, i) of `sites`: one numpy assignment per page."""
  by_page: dict[int, tuple[np.ndarray, list[int]]] = {}
  for block, i in sites:
    page = block.base if isinstance(block.base, np.ndarray) else block
    by_page.setdefault(id(page), (page, []))[1].append((block.ctypes.data - page.ctypes.data) // block.itemsize + i)
  targets = [(page, np.array(at, np.intp)) for page, at in by_page.values()]

  def write(value: int) -> None:
    for page, at in targets: page[at] = value
  return write
