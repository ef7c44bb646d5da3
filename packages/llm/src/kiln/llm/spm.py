"""SentencePiece-style tokenizing (a GGUF vocabulary with tokenizer.ggml.model "llama": Llama 1/2, Mistral, TinyLlama, Gemma).

Encoding a piece of text between special tokens (llama.cpp's llm_tokenizer_spm_session): a space is put first when the file
says add_space_prefix and the piece starts the text or follows a special token; every space becomes "▁"; each character is a
symbol; then, repeatedly, of the adjacent pairs whose joined text is a token the one with the highest score merges (of equal
scores the leftmost). A final symbol that is not a token (a character outside the vocabulary) becomes its UTF-8 bytes'
byte tokens "<0xNN>" (byte fallback), the unknown token where a byte token is missing. Hugging Face's conversion of such a
model (a BPE with byte_fallback whose merges are every pair of tokens whose join is a token, ranked by the join's score)
gives the same ids.

Decoding: "▁" is a space again, a BYTE token is its byte, CONTROL, UNKNOWN and USER_DEFINED tokens are their text; the
space encoding put before a piece is taken off again (after the start and after each special token), so decode(encode(t))
is t for any text the vocabulary can write. (llama.cpp drops only the first one; Hugging Face likewise.)

The space prefix is llama.cpp's, SentencePiece's add_dummy_prefix and the legacy Llama tokenizer.json's (Prepend("▁") on
every piece between special tokens): put even before a text that starts with a space. transformers 5's own conversion of
a GGUF vocabulary (AutoTokenizer with gguf_file=) instead prefixes only the text's first piece and only when it does not
start with a space, so its ids differ from these (and from llama.cpp's) for such texts.
"""
from __future__ import annotations

import heapq
import re

from kiln.llm.gguf_vocab import BYTE, CONTROL, UNKNOWN, USER_DEFINED, Vocab, VocabTokenizer
from kiln.llm.tokenizer_base import TokenizerError, utf8_text

SPACE = "\u2581"  # "▁", SentencePiece's space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class SentencePiece(VocabTokenizer):
  def __init__(self, vocab: Vocab):
    super().__init__(vocab)
    self.add_space_prefix = vocab.add_space_prefix
    self.scores = vocab.scores
    ids = self.ids
    self._byte_ids: list[int | None] = [ids.get(f"<0x{b:02X}>", vocab.unk_id) for b in range(256)]
    self._special_types = (CONTROL, UNKNOWN, USER_DEFINED)

  def _encode_segment(self, text: str, after_special: bool, out: list[int]) -> None:
    if self.add_space_prefix and after_special: text = " " + text
    text = text.replace(" ", SPACE)
    get, scores = self.ids.get, self.scores
    push, pop = heapq.heappush, heapq.heappop
    n = len(text)
    # symbol i spans text[i:i + size[i]] (symbols are contiguous: prv's ends where i starts); dead symbols have size 0.
    # A heap entry (-score, left, right, joined size) is stale once either side has changed size
    size = [1] * n
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    heap = [(-scores[t], i, i + 1, 2) for i in range(n - 1) if (t := get(text[i:i + 2])) is not None]
    heapq.heapify(heap)
    while heap:
      _, left, right, joined = pop(heap)
      a, b = size[left], size[right]
      if a == 0 or b == 0 or a + b != joined: continue
      size[left], size[right] = joined, 0
      k = nxt[left] = nxt[right]
      p = prv[left]
      if p >= 0 and (t := get(text[p:left + joined])) is not None: push(heap, (-scores[t], p, left, size[p] + joined))
      if k < n:
        prv[k] = left
        end = k + size[k]
        if (t := get(text[left:end])) is not None: push(heap, (-scores[t], left, k, end - left))
    i = 0
    while i < n:
      piece = text[i:i + size[i]]
      tid = get(piece)
      if tid is not None: out.append(tid)
      else:
        for b in piece.encode("utf-8", "surrogatepass"):
          byte_id = self._byte_ids[b]
          if byte_id is None: raise TokenizerError(f"{self.source}: the vocabulary has no token for byte 0x{b:02X} of {piece!r} and no unknown token")
          out.append(byte_id)
      i = nxt[i]

  def _decode(self, ids: list[int], skip_special: bool) -> str:
    vocab = self.vocab
    types, tokens = vocab.types, vocab.tokens
    out = bytearray()
    at_start = True
    for i in ids:
      kind = types[i]
      if kind in self._special_types:
        if not (skip_special and kind != USER_DEFINED): out += tokens[i].encode("utf-8", "surrogatepass")
        at_start = True
        continue
      if kind == BYTE and (m := _BYTE_TOKEN.fullmatch(tokens[i])): piece = bytes((int(m.group(1), 16),))
      else: piece = tokens[i].replace(SPACE, " ").encode("utf-8", "surrogatepass")
      if at_start and self.add_space_prefix and piece.startswith(b" "): piece = piece[1:]
      at_start = False
      out += piece
    return utf8_text(bytes(out))
