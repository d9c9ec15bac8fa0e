"""What the HISTORY worker adds to SGLang's ``Scheduler`` (installed once per scheduler process,
by the worker's constructor, which the scheduler runs while it starts):

- the RPCs ``Engine.collective_rpc("histospec_save" | "histospec_load" | "histospec_version", ...)``
  runs on every rank (between steps; SGLang ends each RPC with a TP barrier);
- before each batch runs, the worker is told how many requests wait in the scheduler's queue for a
  slot (``worker.waiting``): the step policy prices a promised token differently when a request
  that ends early lets another in (:func:`~histospec_sgl.engine.plan.plan_step`). The scheduler's
  ``run_batch`` is wrapped for this, once; it reads ``len(waiting_queue)``, which every supported
  SGLang version (0.5.15-0.5.23) keeps.
"""

from __future__ import annotations

import functools
from typing import Any

_MARK = "_histospec_counts_waiting"


def install(worker_type: type[Any]) -> None:
    """Adds the RPCs and the waiting count to SGLang's ``Scheduler`` (idempotent); the count is
    set on a draft worker that is a ``worker_type``."""
    from sglang.srt.managers.scheduler import Scheduler

    def histospec_save(self: Any, path: str | None = None) -> None:
        self.draft_worker.history_save(path)

    def histospec_load(self: Any, path: str) -> None:
        self.draft_worker.history_load(path)

    def histospec_version(self: Any, version: int) -> None:
        worker = self.draft_worker
        if worker.drafter is not None:
            worker.drafter.index.version = int(version)

    for fn in (histospec_save, histospec_load, histospec_version):
        if not hasattr(Scheduler, fn.__name__):
            setattr(Scheduler, fn.__name__, fn)

    run_batch = Scheduler.run_batch
    if getattr(run_batch, _MARK, False):
        return

    @functools.wraps(run_batch)
    def counting_waiting(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        worker = getattr(self, "draft_worker", None)
        if isinstance(worker, worker_type):
            worker.waiting = len(getattr(self, "waiting_queue", ()) or ())
        return run_batch(self, batch, *args, **kwargs)

    setattr(counting_waiting, _MARK, True)
    Scheduler.run_batch = counting_waiting
