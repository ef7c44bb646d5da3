"""Where a worker runs: Ray resources (CPUs, GPUs, a host's custom resource) or a named node; and whether the cluster
can hold a fleet's workers at all, checked before any is started."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


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

  def demand(self) -> dict[str, float]:
    """What Ray reserves on the worker's node while it lives (Ray's resource names), zero amounts left out."""
    d = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
    return {k: float(v) for k, v in d.items() if v > 0}


def placements(p: Placement | dict[str, Any] | list[Any] | None, n: int, what: str) -> list[Placement]:
  """One Placement per worker: None (1 CPU each), one for all, or a list of n."""
  from kiln.distributed.errors import DistributedError
  def one(x: Any) -> Placement:
    if isinstance(x, Placement): return x
    try: return Placement(**x)
    except (TypeError, ValidationError) as e: raise DistributedError(f"bad placement {x!r}: {e}") from None
  if p is None: return [Placement()] * n
  if isinstance(p, list):
    if len(p) != n: raise DistributedError(f"{len(p)} placements for {n} {what}")
    return [one(x) for x in p]
  return [one(p)] * n


_EPS = 1e-6  # Ray keeps resources in fixed point (1e-4): a sum of fractions may land a hair above what a node has


def check_fits(places: Sequence[Placement], labels: Sequence[str], what: str, nodes: Sequence[Mapping[str, Any]]) -> None:
  """A PlacementError at once for a fleet the cluster (`nodes`: ray.nodes()) can never hold: a worker no alive node can
  take (or not its pinned node), or workers whose demands together pass the cluster's totals (or a pinned node's). Ray
  would keep such workers pending for ever. Only what cannot fit is refused: a fleet that passes may still wait for
  resources other work holds now, or not pack onto the nodes (Fleet.wait_ready's timeout says so). The cluster is the one
  there now: an autoscaler's future nodes do not count (serve/pipeline with check_fit=False)."""
  from kiln.distributed.errors import PlacementError
  alive = {str(n["NodeID"]): {k: float(v) for k, v in dict(n.get("Resources") or {}).items()} for n in nodes if n.get("Alive")}
  has = f"the cluster has {resources_text(_sum(alive.values()))} ({_nodes(alive)})"
  for p, label in zip(places, labels):
    want = p.demand()
    if p.node_id is not None:
      if p.node_id not in alive: raise PlacementError(f"{label} is pinned to node {p.node_id}, which is not an alive node; {has}")
      if not _holds(alive[p.node_id], want):
        raise PlacementError(f"{label} asks for {resources_text(want)} on node {p.node_id[:8]}, which has {resources_text(alive[p.node_id])}; {has}")
    elif not any(_holds(n, want) for n in alive.values()):
      raise PlacementError(f"{label} asks for {resources_text(want)}, and no node has that; {has}")
  groups: dict[str | None, list[int]] = {None: list(range(len(places)))}  # the whole cluster, and each pinned node
  for i, p in enumerate(places):
    if p.node_id is not None: groups.setdefault(p.node_id, []).append(i)
  for node, idx in groups.items():
    asked = _sum(places[i].demand() for i in idx)
    room = _sum(alive.values()) if node is None else alive[node]
    if not _holds(room, asked):
      where = has if node is None else f"node {node[:8]} has {resources_text(room)}"
      each = "; ".join(f"{labels[i]}: {resources_text(places[i].demand())}" for i in idx[:4]) + ("; ..." if len(idx) > 4 else "")
      raise PlacementError(f"{len(idx)} {what} ask for {resources_text(asked)} in all ({each}), and {where}: ask for less per worker "
                           f"(placement=, e.g. num_cpus=0.5) or for fewer {what}")


def _holds(room: Mapping[str, float], want: Mapping[str, float]) -> bool:
  return all(room.get(k, 0.0) + _EPS >= v for k, v in want.items())


def _sum(ds: Any) -> dict[str, float]:
  out: dict[str, float] = {}
  for d in ds:
    for k, v in d.items(): out[k] = out.get(k, 0.0) + v
  return out


def _shown(k: str) -> bool: return not k.startswith(("node:", "accelerator_type:")) and k not in ("memory", "object_store_memory")
def resources_text(d: Mapping[str, float]) -> str: return ", ".join(f"{k} {v:g}" for k, v in sorted(d.items()) if _shown(k)) or "nothing"


def _nodes(alive: Mapping[str, Mapping[str, float]]) -> str:
  if not alive: return "no alive node"
  return f"{len(alive)} node{'s' * (len(alive) != 1)}: " + "; ".join(f"{n[:8]} {resources_text(r)}" for n, r in list(alive.items())[:8])
