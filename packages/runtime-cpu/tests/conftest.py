import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # cpu_check.py: the codegen tests' shared kernel runner and AVX2 rerun
