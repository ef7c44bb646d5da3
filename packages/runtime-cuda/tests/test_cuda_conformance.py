"""The conformance set (kiln.codegen.conformance) rendered by CUDARenderer and run under the CPU emulation harness, against the
reference evaluator: integers and bools exactly, floats bit for bit except transcendental ops (a few ulp, TRANSCENDENTAL_RTOL) and
float reductions the GPU folds in another order (group reductions, rtol 1e-4 and looser for 16-bit floats). What this cannot show:
CUDA's own exp2f/log2f/sinf (the host libm runs here) and anything about real GPU scheduling."""
from concurrent.futures import ThreadPoolExecutor

import pytest

from kiln.codegen.conformance import cases, for_spec, mismatches
from kiln.codegen.render import CUDARenderer

from .conftest import requires_cxx

emulate = pytest.importorskip("kiln.runtime.cuda.emulate")
CASES = cases()


@pytest.fixture(scope="module")
def built():
  r = CUDARenderer()
  specs = [r.render(c.ast, c.opts) for c in CASES]
  with ThreadPoolExecutor(2) as ex: progs = list(ex.map(emulate.EmulatedProgram, specs))  # g++ builds, two at a time
  return dict(zip((c.name for c in CASES), zip(specs, progs)))


@requires_cxx
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_reference(case, built):
  spec, prog = built[case.name]
  bufs = case.fresh()
  vals = [case.var_vals[n] for n in spec.var_names]
  prog(bufs, vals)
  assert not (errs := mismatches(for_spec(case, spec.applied_opts), bufs)), "\n".join(errs)
