"""Make this folder's helper module (kiln_ir_testgen) importable: pytest runs with --import-mode=importlib, which adds no paths."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
