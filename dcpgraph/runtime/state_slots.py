"""Recurrent-state slots of a hybrid model's engine: row ``s`` of every state pool is one running
request's state. A request takes a slot when it starts running and gives it back when it stops
(finish, abort, preemption: a later run restarts its state at 0). A request detached for a P/D
transfer keeps its slot (held) until the transfer is done, so nothing overwrites the state before
it is sent; a held slot is not free for admission. Without recurrent layers there are no slots
and a request never waits for one."""

from __future__ import annotations


class StateSlots:
    def __init__(self, count: int):
        self.count = count
        self._free = list(range(count - 1, -1, -1))  # popped from the end: slot 0 first
        self._held: dict[int, int] = {}  # detached request id -> the slot its state is in

    def available(self) -> bool:
        """Whether a request could start running now as far as slots go."""
        return not self.count or bool(self._free)

    def take(self) -> int | None:
        """A free slot for a request starting to run (``None`` without recurrent layers)."""
        return self._free.pop() if self.count else None

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def hold(self, request_id: int, slot: int) -> None:
        """Keep ``slot`` for detached request ``request_id`` until :meth:`release`."""
        self._held[request_id] = slot

    def held(self, request_id: int) -> int | None:
        """The slot a detached request keeps (``None``: none kept)."""
        return self._held.get(request_id)

    def release(self, request_id: int) -> bool:
        """Free the slot :meth:`hold` kept for ``request_id``; ``False`` if none."""
        slot = self._held.pop(request_id, None)
        if slot is None:
            return False
        self._free.append(slot)
        return True

    @property
    def held_count(self) -> int:
        return len(self._held)

    @property
    def free(self) -> list[int]:
        """The free slots, in the order they will be taken last-first (a copy)."""
        return list(self._free)
