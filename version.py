"""The version of the `kiln` meta-package, which pins the six layers at the same version (read by hatch, never imported)."""
__version__ = "0.1.0"
