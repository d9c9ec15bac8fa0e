"""Sample slots for SPEC-RL when the trainer does not say which of a group's n samples a request is.

SPEC-RL reuses, for each sample, the previous response of the same slot, so that a group's n
samples start from n different earlier responses (two samples starting from one earlier response
would share most of their prefix and no longer be independent draws). verl and OpenRLHF run each
sample as its own call, in several processes, without its index in the group; a named Ray actor
hands out slots instead: the k-th call for a group gets ``k mod n``, so the n calls of one round get
n distinct slots whichever processes make them.
"""

from __future__ import annotations

from typing import Any

from histospec_sgl.specrl.flow import SlotCounter

NAME = "histospec-slots"
NAMESPACE = "histospec"


class Slots:
    """Client side: ``await slots.take(group, n)`` from any process of the Ray job. Without Ray (a
    single process) it counts locally."""

    def __init__(self, name: str = NAME, namespace: str = NAMESPACE):
        self._actor: Any = None
        self._local: SlotCounter | None = None
        self.name, self.namespace = name, namespace

    def _handle(self) -> Any:
        if self._actor is None and self._local is None:
            try:
                import ray

                if ray.is_initialized():
                    self._actor = ray.remote(SlotCounter).options(
                        name=self.name, namespace=self.namespace, get_if_exists=True, num_cpus=0,
                        lifetime="detached").remote()
            except ImportError:
                pass
            if self._actor is None:
                self._local = SlotCounter()
        return self._actor

    async def take(self, group: int, n: int) -> int:
        actor = self._handle()
        if actor is None:
            assert self._local is not None
            return self._local.take(group, n)
        return int(await actor.take.remote(group, n))

    async def slot_and_round(self, group: int, n: int) -> tuple[int, int]:
        """The next call of ``group``'s slot and round: the k-th call of the job for the group is
        slot ``k mod n`` of round ``k // n`` (the round seeds SPEC-RL's draws,
        :func:`histospec_sgl.specrl.flow.seed_sequence`)."""
        k = await self.take(group, 1 << 62)
        return k % max(1, n), k // max(1, n)
