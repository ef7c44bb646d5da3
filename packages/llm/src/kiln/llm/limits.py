"""Limits on a checkpoint, an untrusted document: each is checked before the value it bounds is used, and a value over one is
a CheckpointError naming the file, the field and the limit.

GGUF (the header is parsed by kiln.llm.gguf_file from the mapped file, never read whole):
  MAX_GGUF_TENSORS        65,536      tensor infos in one file (a 70B-parameter model has under 1,000)
  MAX_GGUF_KV             65,536      metadata key/value pairs (real files have tens)
  MAX_GGUF_STRING_BYTES   16 MiB      one string (a key, a value, an array element, a tensor name): chat templates are KBs
  MAX_GGUF_NAME_BYTES     1,024       a key or a tensor name
  MAX_GGUF_ARRAY_ITEMS    2**21       elements of one metadata array (vocabularies are up to ~2.6 x 10**5 tokens, merge lists
                                      ~3 x 10**5; each string is parsed in Python, so this also bounds the time)
  MAX_GGUF_ARRAY_DEPTH    2           an array of arrays at most (the format allows nesting; no model uses more)
  MAX_GGUF_HEADER_BYTES   1 GiB       the header: metadata and tensor infos together, before the aligned data section
  MAX_GGUF_DIMS           4           dims of a tensor (ggml's GGML_MAX_DIMS)
  MAX_GGUF_ALIGNMENT      1 MiB       general.alignment (a power of two; 32 when absent)
A tensor's bytes are computed with Python ints (no wrap), must lie inside the file, start on the alignment and not overlap
another tensor's.

Hugging Face folders:
  MAX_CONFIG_BYTES        16 MiB      config.json, model.safetensors.index.json, generation_config.json
  MAX_SHARDS              4,096       safetensors files one index names
  (each safetensors file is checked by kiln.graph.weights, whose header limit is 100 MiB)

Model sizes (a config is checked against these before anything is sized from it):
  MAX_VOCAB               2**22       tokens
  MAX_HIDDEN              2**17       hidden size, intermediate size, head dim x heads
  MAX_LAYERS              2**12       decoder layers
  MAX_HEADS               2**12       attention heads
  MAX_POSITIONS           2**24       max_position_embeddings
"""
from __future__ import annotations

MAX_GGUF_TENSORS = 1 << 16
MAX_GGUF_KV = 1 << 16
MAX_GGUF_STRING_BYTES = 16 << 20
MAX_GGUF_NAME_BYTES = 1024
MAX_GGUF_ARRAY_ITEMS = 1 << 21
MAX_GGUF_ARRAY_DEPTH = 2
MAX_GGUF_HEADER_BYTES = 1 << 30
MAX_GGUF_DIMS = 4
MAX_GGUF_ALIGNMENT = 1 << 20

MAX_CONFIG_BYTES = 16 << 20
MAX_SHARDS = 4096

MAX_VOCAB = 1 << 22
MAX_HIDDEN = 1 << 17
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_POSITIONS = 1 << 24
