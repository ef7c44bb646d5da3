"""kiln-graph's settings (KILN_* environment variables; kiln.ir.settings reads them, `kiln info --settings` lists them)."""
from __future__ import annotations

from kiln.ir.settings import flag

WINOGRAD = flag("KILN_WINOGRAD", True, "3x3 float32 convolutions on the CPU may use Winograd F(4x4, 3x3); 0 keeps the direct product")
