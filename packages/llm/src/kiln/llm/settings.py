"""kiln-llm's settings (KILN_* environment variables; kiln.ir.settings reads them, `kiln info --settings` lists them)."""
from __future__ import annotations

from kiln.ir.settings import choice

INT8 = choice("KILN_LLM_INT8", "auto", ("auto", "1", "0"),
              "one-row products over block-quantized weights in int8 (the row quantized per block, as llama.cpp does): auto for the "
              "4-bit formats where the CPU has a byte dot product (VNNI) or AVX2, 1 for every block format on every CPU, 0 never "
              "(float products of the dequantized codes)")
