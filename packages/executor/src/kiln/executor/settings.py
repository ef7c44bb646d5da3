"""kiln-executor's settings (KILN_* environment variables; kiln.ir.settings reads them, `kiln info --settings` lists them)."""
from __future__ import annotations

from kiln.ir.settings import flag, number

TUNE = flag("KILN_TUNE", False, "plans built with tune=None choose their kernels' optimisations by timing candidates")
TUNE_BUDGET = number("KILN_TUNE_BUDGET", 1.5, "seconds of searching per kernel when tuning", "a positive number of seconds")
