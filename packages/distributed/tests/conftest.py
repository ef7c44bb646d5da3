from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# every node and the driver on 127.0.0.1: Ray reads this when it is imported (the loopback mode it uses on one-machine
# platforms); without it the nodes pick an interface address each, which differed between them in a pytest run
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from ray_driver import connect  # noqa: E402  (a module of its own: tests import it, and "conftest" names another package's too)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
  """A real local Ray cluster on loopback (ray.cluster_utils.Cluster): a head node and a second node, each a simulated host with 1 CPU and a custom
  resource naming it (host0, host1). The workers inherit this environment and a private kiln cache through the job's runtime
  env; KILN_THREADS is left as the driver has it, since the thread count is part of the target key). The nodes start with
  the private cache in their own environment too, so a job another driver starts (the README's example, run as a script)
  uses it as well; this process keeps its own."""
  ray = pytest.importorskip("ray")
  from ray.cluster_utils import Cluster
  env = {"KILN_CACHE_DIR": str(tmp_path_factory.mktemp("kiln-cache"))}
  store = 96 * 1024 * 1024
  mp = pytest.MonkeyPatch()
  mp.setenv("KILN_CACHE_DIR", env["KILN_CACHE_DIR"])
  try:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"host0": 1}, "object_store_memory": store,
                                                      "include_dashboard": False, "node_ip_address": "127.0.0.1"})
    c.add_node(num_cpus=1, resources={"host1": 1}, object_store_memory=store)
  finally: mp.undo()
  c.kiln_env = env
  connect(c)
  yield c
  ray.shutdown()
  c.shutdown()


@pytest.fixture
def reconnect(cluster):
  """For a test that shuts Ray down: connects this process to the cluster again afterwards."""
  import ray
  yield cluster
  if not ray.is_initialized(): connect(cluster)


@pytest.fixture(scope="session")
def bert():
  """The 6-layer encoder compiled here, its spec and weights, and its single-host outputs at batch 3."""
  from encoder import encoder, feeds
  c = encoder()
  spec, weights = c.export(["pooled", "hidden"])
  f = feeds(3)
  want = dict(zip(["pooled", "hidden"], c.run(f)))
  return spec, weights, f, want
