"""kiln-executor's settings (KILN_* environment variables; kiln.ir.settings reads them, `kiln info --settings` lists them)."""
from __future__ import annotations

from kiln.ir.settings import flag, integer, number

TUNE = flag("KILN_TUNE", False, "plans built with tune=None choose their kernels' optimisations by timing candidates")
TUNE_BUDGET = number("KILN_TUNE_BUDGET", 1.5, "seconds of searching per kernel when tuning", "a positive number of seconds")
PLAN_CACHE = flag("KILN_PLAN_CACHE", True, "a loaded model's whole built plan is kept in the disk cache (plans/), so loading it again skips "
                  "building it; KILN_CACHE=0 turns it off too")
PLAN_CACHE_BYTES = integer("KILN_PLAN_CACHE_BYTES", 4 << 30, "bytes the plan cache may hold, weights included (the least recently used "
                           "plans go first)", 0, "a whole number of bytes >= 0")
