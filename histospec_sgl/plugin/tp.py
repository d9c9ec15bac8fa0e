"""Identical drafts on every tensor-parallel rank: TP rank 0 drafts, the others receive.

The history index is host state that only rank 0 builds and queries (the other ranks keep none,
so they cannot drift from it). Each decode step rank 0 broadcasts the step's draft (its verify
width, whether any request has a draft, and the batch's draft tokens and tree masks at that width)
over the TP group's CPU (gloo) process group: ``2 + bs*d*(d+1)`` int64 values, about 100 KB at bs 48
and d 16, so every rank takes the same path. Every rank calls :meth:`DraftBroadcast.share` exactly once per verify step, and rank
0 always sends (an empty draft if drafting failed), so a TP group never waits on a rank that is not
coming.
"""

from __future__ import annotations

from typing import Any

from histospec_sgl.engine.drafter import StepDraft


class DraftBroadcast:
    """Broadcasts ``(tokens, mask)`` from the group's first rank.

    Args:
        cpu_group: a ``torch.distributed`` process group with a CPU backend (SGLang's
            ``get_tp_group().cpu_group``), or None for a single rank.
        src: the global rank of the group's first rank.
        rank_in_group: this process's rank within the group.
    """

    def __init__(self, cpu_group: Any = None, src: int = 0, rank_in_group: int = 0, world_size: int = 1):
        self.cpu_group = cpu_group
        self.src = src
        self.rank_in_group = rank_in_group
        self.world_size = world_size

    @classmethod
    def from_sglang(cls, tp_size: int) -> DraftBroadcast:
        """The TP group of the running SGLang scheduler process (none needed for ``tp_size`` 1)."""
        if tp_size == 1:
            return cls()
        from sglang.srt.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        if g.world_size == 1:
            return cls()
        return cls(g.cpu_group, g.ranks[0], g.rank_in_group, g.world_size)

    @property
    def is_source(self) -> bool:
        return self.rank_in_group == 0

    def share(self, step: StepDraft | None, bs: int, d: int) -> StepDraft:
        """On rank 0, sends the step's draft (its width w, at most ``d``: the cost model may verify
        fewer nodes, 1 being plain decoding; whether any request has a draft; ``tokens[bs*w]`` and
        ``mask[bs*w*w]``); elsewhere (pass None) returns what rank 0 sent. With one rank, returns
        ``step`` unchanged."""
        if self.world_size == 1:
            assert step is not None
            return step
        import torch
        import torch.distributed as dist

        buf = torch.zeros(2 + bs * d * (d + 1), dtype=torch.int64)
        if self.is_source:
            assert step is not None
            w = step.width
            buf[0], buf[1] = w, int(step.drafted)
            buf[2: 2 + bs * w] = torch.from_numpy(step.tokens)
            buf[2 + bs * d: 2 + bs * d + bs * w * w] = torch.from_numpy(step.mask)
        dist.broadcast(buf, src=self.src, group=self.cpu_group)
        out = buf.numpy()
        w = int(out[0])
        return StepDraft(out[2: 2 + bs * w], out[2 + bs * d: 2 + bs * d + bs * w * w], w, bool(out[1]))
