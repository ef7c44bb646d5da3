from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# every node and the driver on 127.0.0.1: Ray reads this when it is imported (the loopback mode it uses on one-machine
# platforms); without it the nodes pick an interface address each, which differed between them in a pytest run
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
  """A real local Ray cluster on loopback (ray.cluster_utils.Cluster): a head node and a second node, each a simulated host with 1 CPU and a custom
  resource naming it (host0, host1). The workers inherit this environment and a private kiln cache through the job's runtime
  env; KILN_THREADS is left as the driver has it, since the thread count is part of the target key)."""
  ray = pytest.importorskip("ray")
  from ray.cluster_utils import Cluster
  env = {"KILN_CACHE_DIR": str(tmp_path_factory.mktemp("kiln-cache"))}
  store = 96 * 1024 * 1024
  c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"host0": 1}, "object_store_memory": store,
                                                    "include_dashboard": False, "node_ip_address": "127.0.0.1"})
  c.add_node(num_cpus=1, resources={"host1": 1}, object_store_memory=store)
  ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": env})
  yield c
  ray.shutdown()
  c.shutdown()
