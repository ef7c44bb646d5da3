"""kiln-codegen's settings (KILN_* environment variables; kiln.ir.settings reads them, `kiln info --settings` lists them).
KILN_DEBUG and KILN_THREADS live here, the lowest layer whose code reads them (the runtimes and the executor import it)."""
from __future__ import annotations

from kiln.ir.settings import flag, integer, text

CACHE = flag("KILN_CACHE", True, "the disk caches (kernels, tuning choices, emulator libraries): 0 compiles in every process")
CACHE_DIR = text("KILN_CACHE_DIR", None, "the disk caches' directory (unset: ~/.cache/kiln)", "a directory path")
CACHE_KEY = text("KILN_CACHE_KEY", None, "the disk cache's MAC key, for hosts that share a cache on purpose (unset: a key file "
                 "under $XDG_CONFIG_HOME/kiln, made on first use)", "64 hex digits", secret=True)
THREADS = integer("KILN_THREADS", None, "CPU threads a plan uses (unset: the physical cores this process may run on)", 1, "a positive integer")
DEBUG = integer("KILN_DEBUG", 0, "debug output on stderr: 1 a line per kernel run, 2 applied optimisations, 3 generated source, "
                "4 the AST", 0, "a whole number >= 0")
DUMP_AST = text("KILN_DUMP_AST", None, "print to stderr what these compile pipeline passes made (kiln.codegen.pipeline.PASSES: "
                "verify, prepare, linearize, ...; `all` for every one); unset: none", "pass names separated by commas")
