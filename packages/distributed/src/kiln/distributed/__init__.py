"""kiln.distributed: execution plans as portable specs, served on Ray by replicas (data parallel) and pipeline stages.

    spec, weights = kiln.executor.planspec.export(plan, inputs={"x": 0}, outputs={"y": 3})   # or kiln.graph's model.export()
    with serve(spec, replicas=2, weights=weights) as r: outs = r.map([{"x": a} for a in batches])
    with pipeline(spec, stages=2, weights=weights, placement=[{"resources": {"host0": 1}}, {"resources": {"host1": 1}}]) as p:
      y = p.run({"x": a})
"""
from kiln.distributed.errors import ClusterLost, DistributedError, NoWorkerLeft, PlacementError, RequestsFailed, WorkerError
from kiln.distributed.fleet import merged_trace, write_trace
from kiln.distributed.pipeline import Pipeline, pipeline
from kiln.distributed.placement import Placement
from kiln.distributed.serve import Replicas, serve
from kiln.distributed.version import __version__

__all__ = ["ClusterLost", "DistributedError", "NoWorkerLeft", "Pipeline", "Placement", "PlacementError", "Replicas", "RequestsFailed",
           "WorkerError", "merged_trace", "pipeline", "serve", "write_trace", "__version__"]
