"""Subject counters: what this worker's clients publish, per subject, for the subject's owner (``/topicz``).

Every worker counts what its clients publish on the subject's route as it goes (``Hub.publish``), folds those
counts by subject at the end of the turn, and ships them once a second (``Hub.tick``) to the subject's owner
(``router.shardmap``), which keeps them (``workers.shardstate.SubjectTable``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from shardbroker.router import control
from shardbroker.workers.shardstate import SubjectTable

if TYPE_CHECKING:
    from shardbroker.router.fabric import Fabric
    from shardbroker.workers.delivery import Route


class Host(Protocol):
    """What the counters need of the worker's hub (``workers.hub.Hub``), so that this room does not import the
    hub's."""

    index: int
    fabric: Fabric | None

    def handle(self, kinds: tuple[str, ...], handler: Callable[[int, tuple], None]) -> None: ...


class SubjectCounters:
    def __init__(self, hub: Host, max_tracked: int) -> None:
        self.hub = hub
        # Routes published to in this turn: the hub appends to this very list (emptied in place) on every
        # publish to a route not counted yet in the turn.
        self.counted: list[Route] = []
        # owner -> {subject: (messages, bytes)} since the last shipment: what ship sends (or merges) as it is
        self._counts: dict[int, dict[str, tuple]] = {}
        self.owned = SubjectTable(max_tracked)   # the subjects this worker owns, as every worker counted them
        hub.handle((control.COUNTERS,), self._merge)

    def fold(self) -> None:
        """At the end of a turn: what its routes counted, by subject until the next shipment (``ship``), so that
        no route is kept alive for the counters' sake (an inbox's would be, a second for nothing)."""
        counted = self.counted
        by_owner = self._counts
        owner = -1
        counts: dict[str, tuple] = {}
        for route in counted:
            if route.owner != owner:
                owner = route.owner
                if owner not in by_owner:
                    by_owner[owner] = {}
                counts = by_owner[owner]
            subject = route.subject
            entry = counts.get(subject)
            counts[subject] = (route.msgs, route.bytes) if entry is None else \
                (entry[0] + route.msgs, entry[1] + route.bytes)
            route.msgs = route.bytes = 0
        counted.clear()

    def ship(self) -> None:
        """About once a second: ship subject counters to their owners."""
        self.fold()
        by_owner, self._counts = self._counts, {}
        hub = self.hub
        for owner, counts in by_owner.items():
            if owner == hub.index:
                self.owned.merge(counts)
            else:
                hub.fabric.control(owner, (control.COUNTERS, counts))

    def _merge(self, src: int, item: tuple) -> None:
        self.owned.merge(item[1])
