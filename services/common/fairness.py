"""Start-time fair queueing's clock, shared by the gateway's admission queues and the worker's `tenant-fair`
scheduling: each tenant's work gets a virtual start tag, and serving in tag order gives every tenant an equal share
of a contended resource whatever its backlog (Goyal, Vin and Cheng's SFQ)."""

from __future__ import annotations


class FairClock:
    """The virtual time of one queue and where each tenant's queued work ends on it.

    A new piece of work is tagged with the later of the virtual time and the end of its tenant's previous work, and
    moves that end on by its cost; the virtual time follows the tags of the work that starts. A tenant with a
    backlog has its newest work tagged far ahead, so a newcomer's work (tagged about now) goes before it; alone, a
    tenant's work keeps its arrival order."""

    def __init__(self) -> None:
        self.virtual_time = 0.0
        self._end: dict[str, float] = {}

    def tag(self, tenant: str, cost: float) -> float:
        """The start tag of `tenant`'s next work, which costs `cost` (in the queue's own unit)."""
        tag = max(self.virtual_time, self._end.get(tenant, 0.0))
        self._end[tenant] = tag + cost
        return tag

    def start(self, tag: float) -> None:
        """Work tagged `tag` starts: the virtual time moves up to it."""
        self.virtual_time = max(self.virtual_time, tag)
