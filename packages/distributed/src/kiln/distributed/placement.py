"""Where a worker runs: Ray resources (CPUs, GPUs, a host's custom resource) or a named node."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Placement(BaseModel):
  """A worker's resource request. `resources` names custom resources (a simulated or real host: {"host1": 1}); `node_id`
  pins it to one Ray node (hard affinity); `num_gpus` > 0 asks for a GPU host."""
  model_config = ConfigDict(extra="forbid", frozen=True)
  num_cpus: float = Field(default=1, ge=0)
  num_gpus: float = Field(default=0, ge=0)
  resources: dict[str, float] = Field(default_factory=dict)
  node_id: str | None = None

  def actor_options(self) -> dict[str, Any]:
    opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
    if self.resources: opts["resources"] = dict(self.resources)
    if self.node_id is not None:
      from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
      opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=self.node_id, soft=False)
    return opts


def placements(p: Placement | dict[str, Any] | list[Any] | None, n: int, what: str) -> list[Placement]:
  """One Placement per worker: None (1 CPU each), one for all, or a list of n."""
  from kiln.distributed.errors import DistributedError
  if p is None: return [Placement()] * n
  if isinstance(p, list):
    if len(p) != n: raise DistributedError(f"{len(p)} placements for {n} {what}")
    return [x if isinstance(x, Placement) else Placement(**x) for x in p]
  return [p if isinstance(p, Placement) else Placement(**p)] * n
