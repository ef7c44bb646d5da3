"""The test process as a Ray cluster's driver: conftest's cluster fixture connects with it, and a test that shut Ray down
connects again. Not in conftest.py: other packages' test folders have a conftest module too, and which one `import
conftest` finds depends on what ran before in the worker."""
from __future__ import annotations

from typing import Any


def connect(c: Any) -> None:
  """This process as the cluster's driver (again, after a test that shut Ray down)."""
  import ray
  ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": c.kiln_env})
