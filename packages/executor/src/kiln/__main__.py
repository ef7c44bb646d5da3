"""`python -m kiln`: the `kiln` command (kiln.executor.cli), for an environment whose scripts folder is not on PATH.

`kiln` is a PEP 420 namespace package that every kiln distribution shares, so no distribution may ship kiln/__init__.py;
a kiln/__main__.py is allowed in exactly one of them (two would overwrite each other's file on install). kiln-executor
ships it, as it owns the `kiln` console script; tests/test_dependencies.py checks that no other package has one."""
import sys

from kiln.executor.cli import main

if __name__ == "__main__": sys.exit(main())
