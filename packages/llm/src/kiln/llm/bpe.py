"""Byte-level BPE (a GGUF vocabulary with tokenizer.ggml.model "gpt2": GPT-2, Llama 3, Qwen2, SmolLM, ...).

Encoding a piece of text between special tokens: the pre-tokenizer (pretokenize.py) cuts it into pieces; each piece's UTF-8
bytes are written in GPT-2's byte-to-unicode alphabet, one symbol per byte; then adjacent symbols merge, the pair whose
rule is earliest first and of equal rules the leftmost, each merge offering its new pairs to a priority queue (Hugging
Face tokenizers' BPE.merge_word and llama.cpp's llm_tokenizer_bpe_session). With ignore_merges (Llama 3) a piece that is
itself a token is that token. A byte whose symbol is not in the vocabulary becomes the unknown token if the file names one
and is dropped otherwise (Hugging Face's BPE without unk_token does the same).

Decoding writes NORMAL tokens' symbols back as bytes, CONTROL, UNKNOWN and USER_DEFINED tokens as their text (llama.cpp's
token_to_piece), and the bytes as UTF-8.
"""
from __future__ import annotations

import functools
import heapq

from kiln.llm.gguf_vocab import CONTROL, UNKNOWN, USER_DEFINED, Vocab, VocabTokenizer
from kiln.llm.pretokenize import PRE_TOKENIZERS, PreTokenizer
from kiln.llm.tokenizer_base import utf8_text

_CACHE_WORDS = 1 << 16   # pieces whose ids are remembered (text repeats words); the memo is emptied when full


@functools.cache
def byte_alphabet() -> tuple[str, ...]:
  """GPT-2's bytes_to_unicode: byte b -> a printable character (printable Latin-1 bytes are themselves, the rest from U+0100)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  out, extra = {}, 0
  for b in range(256):
    if b in keep: out[b] = chr(b)
    else: out[b], extra = chr(256 + extra), extra + 1
  return tuple(out[b] for b in range(256))


class ByteLevelBPE(VocabTokenizer):
  def __init__(self, vocab: Vocab):
    super().__init__(vocab)
    patterns, self.ignore_merges = PRE_TOKENIZERS[vocab.pre]
    self.pre = PreTokenizer(patterns)
    ids = self.ids
    # (left id, right id) -> (rank, merged id): rules whose parts or result are not tokens can never apply
    self.merges: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, (left, right) in enumerate(vocab.merges):
      a, b, ab = ids.get(left), ids.get(right), ids.get(left + right)
      if a is not None and b is not None and ab is not None: self.merges.setdefault((a, b), (rank, ab))
    alphabet = byte_alphabet()
    self._byte_symbol = alphabet
    self._symbol_byte = {ch: b for b, ch in enumerate(alphabet)}
    self._byte_ids = [ids.get(ch, vocab.unk_id) for ch in alphabet]
    self._words: dict[str, tuple[int, ...]] = {}
    self._pieces: dict[int, bytes] = {}

  def _encode_segment(self, text: str, after_special: bool, out: list[int]) -> None:
    words = self._words
    for piece in self.pre.split(text):
      got = words.get(piece)
      if got is None:
        got = self._encode_word(piece)
        if len(words) >= _CACHE_WORDS: words.clear()
        words[piece] = got
      out.extend(got)

  def _encode_word(self, piece: str) -> tuple[int, ...]:
    data = piece.encode("utf-8", "surrogatepass")
    if self.ignore_merges:
      whole = self.ids.get("".join(self._byte_symbol[b] for b in data))
      if whole is not None: return (whole,)
    syms = [i for i in (self._byte_ids[b] for b in data) if i is not None]
    return tuple(merge(syms, self.merges))

  def _decode(self, ids: list[int], skip_special: bool) -> str:
    pieces = self._pieces
    types = self.vocab.types
    out = bytearray()
    for i in ids:
      if skip_special and types[i] in (CONTROL, UNKNOWN): continue
      piece = pieces.get(i)
      if piece is None: piece = pieces[i] = self._piece(i)
      out += piece
    return utf8_text(bytes(out))

  def _piece(self, i: int) -> bytes:
    text = self.vocab.tokens[i]
    if self.vocab.types[i] in (CONTROL, UNKNOWN, USER_DEFINED): return text.encode("utf-8", "surrogatepass")
    to_byte = self._symbol_byte
    return b"".join(bytes((to_byte[ch],)) if ch in to_byte else ch.encode("utf-8", "surrogatepass") for ch in text)


def merge(syms: list[int], merges: dict[tuple[int, int], tuple[int, int]]) -> list[int]:
  """syms after the BPE merges: the lowest-ranked adjacent pair first, of equal ranks the leftmost (Hugging Face's order)."""
  n = len(syms)
  if n < 2: return syms
  nxt = list(range(1, n + 1))
  prv = list(range(-1, n - 1))
  alive = [True] * n
  heap = []
  for i in range(n - 1):
    m = merges.get((syms[i], syms[i + 1]))
    if m is not None: heap.append((m[0], i, m[1]))
  heapq.heapify(heap)
  while heap:
    rank, i, new = heapq.heappop(heap)
    if not alive[i]: continue
    j = nxt[i]
    if j >= n or merges.get((syms[i], syms[j])) != (rank, new): continue   # a stale entry: the pair has changed
    syms[i] = new
    alive[j] = False
    k = nxt[i] = nxt[j]
    if k < n: prv[k] = i
    p = prv[i]
    if p >= 0:
      m = merges.get((syms[p], new))
      if m is not None: heapq.heappush(heap, (m[0], p, m[1]))
    if k < n:
      m = merges.get((new, syms[k]))
      if m is not None: heapq.heappush(heap, (m[0], i, m[1]))
  return [s for s, a in zip(syms, alive) if a]
