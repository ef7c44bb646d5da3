"""Lowering: a kernel AST plus its options to a linear program a printer walks. One module per pass; kiln.codegen.pipeline
runs them in order (docs/architecture.md, "One kernel's way through")."""
