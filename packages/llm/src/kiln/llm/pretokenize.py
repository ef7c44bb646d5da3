"""Pre-tokenizers of byte-level BPE vocabularies: the text is cut into pieces by a sequence of regular expressions before
BPE merges inside each piece. A GGUF file names its pre-tokenizer (`tokenizer.ggml.pre`); PRE_TOKENIZERS maps each name
this module knows to the expressions llama.cpp applies (llama-vocab.cpp), which are those of the model's tokenizer.json.

The expressions use Unicode classes (\\p{L}, \\p{N}, \\p{P}) that Python's `re` lacks (the `regex` module is not a
dependency). They are written out here as explicit code-point ranges made from `unicodedata` at first use, so each class
is exactly its general category in Python's Unicode database (14.0 for Python 3.11; Hugging Face tokenizers' Oniguruma and
llama.cpp may use a later version: characters assigned after it can be classed differently). `\\s` is Unicode White_Space
spelled out, since `re`'s \\s also takes U+001C..U+001F. The case-insensitive contractions `(?i:'s|...)` are written with
explicit [sS] classes as llama.cpp does: `re`'s IGNORECASE would also fold U+017F (long s) and U+212A (Kelvin sign).

Each expression splits every piece made by the one before it; the text between two matches is a piece too (llama.cpp's
unicode_regex_split, Hugging Face's Split with behaviour "isolated"), so no character is ever dropped.
"""
from __future__ import annotations

import functools
import re
import unicodedata

# Unicode White_Space (what Oniguruma's and the `regex` module's \s match)
_WHITE_SPACE = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"


@functools.cache
def _category_classes() -> dict[str, str]:
  """Class bodies (the text between [ and ]) for the general categories L, N and P, as ranges of code points."""
  majors = "".join(unicodedata.category(chr(cp))[0] for cp in range(0x110000))
  out = {}
  for key in "LNP":
    spans = (m.span() for m in re.finditer(f"{key}+", majors))
    out[key] = "".join(f"\\U{a:08x}" if b == a + 1 else f"\\U{a:08x}-\\U{b - 1:08x}" for a, b in spans)
  return out


def _expand(pattern: str) -> str:
  """pattern with \\p{L}, \\p{N}, \\p{P}, \\s and \\S written out for Python's `re` (inside a class or alone)."""
  cls = _category_classes()
  body = {"\\p{L}": cls["L"], "\\p{N}": cls["N"], "\\p{P}": cls["P"], "\\s": _WHITE_SPACE}
  out: list[str] = []
  i, in_class = 0, False
  while i < len(pattern):
    two = pattern[i:i + 2]
    five = pattern[i:i + 5]
    if five in body: token, i = five, i + 5
    elif two in ("\\s", "\\S"): token, i = two, i + 2
    elif pattern[i] == "\\": out.append(two); i += 2; continue
    else:
      ch = pattern[i]
      if ch == "[" and not in_class: in_class = True
      elif ch == "]" and in_class: in_class = False
      out.append(ch); i += 1; continue
    if token == "\\S": out.append(f"[^{_WHITE_SPACE}]")  # never inside a class in these expressions
    else: out.append(body[token] if in_class else f"[{body[token]}]")
  return "".join(out)


_CONTRACTIONS = "'s|'t|'re|'ve|'m|'ll|'d"
_CONTRACTIONS_ANY_CASE = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = f"{_CONTRACTIONS}| ?\\p{{L}}+| ?\\p{{N}}+| ?[^\\s\\p{{L}}\\p{{N}}]+|\\s+(?!\\S)|\\s+"
LLAMA3 = (f"{_CONTRACTIONS_ANY_CASE}|[^\\r\\n\\p{{L}}\\p{{N}}]?\\p{{L}}+|\\p{{N}}{{1,3}}| ?[^\\s\\p{{L}}\\p{{N}}]+[\\r\\n]*"
          "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
QWEN2 = (f"{_CONTRACTIONS_ANY_CASE}|[^\\r\\n\\p{{L}}\\p{{N}}]?\\p{{L}}+|\\p{{N}}| ?[^\\s\\p{{L}}\\p{{N}}]+[\\r\\n]*"
         "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

# name -> (expressions applied in turn, ignore_merges: a piece that is itself a token is that token, as Llama 3's
# tokenizer.json says and llama.cpp does for its pre-type LLAMA3)
_DEFAULT = (("[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2, "\\p{N}+", "[0-9][0-9][0-9]"), False)
_GPT2 = ((GPT2,), False)
_LLAMA3 = ((LLAMA3,), True)
_QWEN2 = ((QWEN2,), False)
_SMOLLM = (("\\p{N}", GPT2), False)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
  "default": _DEFAULT,
  "gpt2": _GPT2, "gpt-2": _GPT2, "phi-2": _GPT2, "olmo": _GPT2, "mpt": _GPT2, "jais": _GPT2,
  "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
  "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "stablelm2": _QWEN2,
  "smollm": _SMOLLM, "starcoder": _SMOLLM, "refact": _SMOLLM, "codeshell": _SMOLLM, "command-r": _SMOLLM,
}


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
  return re.compile(_expand(pattern))


class PreTokenizer:
  """Cuts text into the pieces BPE merges within, by the named expressions in turn."""

  def __init__(self, patterns: tuple[str, ...]):
    self.patterns = patterns
    self._compiled = [_compiled(p) for p in patterns]

  def split(self, text: str) -> list[str]:
    pieces = [text] if text else []
    for rx in self._compiled:
      out: list[str] = []
      for piece in pieces:
        pos = 0
        for m in rx.finditer(piece):
          start, end = m.span()
          if start == end: continue
          if start > pos: out.append(piece[pos:start])
          out.append(piece[start:end])
          pos = end
        if pos < len(piece): out.append(piece[pos:])
      pieces = out
    return pieces
