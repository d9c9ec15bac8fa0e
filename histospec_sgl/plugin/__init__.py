"""SGLang plugin: ``--speculative-algorithm HISTORY``.

Installing the wheel declares the entry point ``histospec = histospec_sgl.plugin:register`` in the
group ``sglang.srt.plugins``. SGLang calls :func:`register` in every one of its processes (launcher,
engine, schedulers, detokenizer), so it only imports SGLang's speculative registry and registers;
the worker, torch and the native index are imported by the worker factory, in the scheduler.

What registration does:

- registers ``HISTORY`` (:class:`HistoryAlgo`, overlap scheduling supported). HISTORY poses as
  NGRAM where SGLang branches on ``is_ngram()`` (CUDA-graph capture of tree verification, the
  overlap relay of accepted tokens, no draft KV) and answers any other algorithm query the way
  NGRAM does;
- fills HISTORY's server-argument defaults with SGLang's own NGRAM code (``_handle_ngram``:
  ``speculative_num_draft_tokens`` 12 unless set, ``max_running_requests`` 48 unless set, no
  mixed chunking, no DP attention), through the resolution hook on versions that have one;
- picks ``--attention-backend flashinfer`` when none is given, and refuses any other backend (tree
  verification needs FlashInfer's custom masks);
- checks every ``HISTOSPEC_*`` variable, so a bad value stops the launcher with a clear message;
- with ``HISTOSPEC_HUGE_PAGES=1``, puts glibc's huge-page tunable in the environment the scheduler
  processes start with (:mod:`histospec_sgl.hugepages`).

SGLang logs (and then ignores) exceptions raised by plugins, which would surface much later as
"Unknown speculative algorithm name: HISTORY". When the command line asks for HISTORY, a failed
registration therefore exits the process with the reason and the fix.
"""

from __future__ import annotations

import logging
import sys

from histospec_sgl.engine.config import NAME, SUPPORTED_SGLANG, HistoryConfig, HistoryConfigError

__all__ = ["register", "flag_value", "NAME", "SUPPORTED_SGLANG", "HistoryConfig", "HistoryConfigError"]

logger = logging.getLogger("histospec_sgl.plugin")
_registered = False


def flag_value(args: list[str], flag: str) -> str | None:
    """The value given to ``flag`` on a command line (``--flag v`` or ``--flag=v``; ``""`` when it
    ends the line), or None when absent."""
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1] if i + 1 < len(args) else ""
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _history_requested(argv: list[str]) -> bool:
    return (flag_value(argv, "--speculative-algorithm") or "").upper() == NAME


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (idempotent)."""
    global _registered
    if _registered:
        return
    try:
        from histospec_sgl import hugepages
        from histospec_sgl.plugin import registration

        hugepages.prepare_children()
        registration.register_history()
        _registered = True
    except Exception as e:
        msg = (
            f"histospec-sgl could not register --speculative-algorithm {NAME}: "
            f"{type(e).__name__}: {e}\n"
            "  Check that sglang (0.5.15 to 0.5.23) and histospec-sgl are installed in the same "
            "environment (`pip show sglang histospec-sgl`), and reinstall histospec-sgl if its native "
            "module is missing. `histospec-sgl launch-server --check` prints what was found."
        )
        logger.error(msg)
        if _history_requested(sys.argv):
            raise SystemExit(msg) from e
        raise
