"""Everything that depends on the SGLang version, in one place (0.5.15 to 0.5.23). A leaf module:
it imports only SGLang (inside its functions) and nothing of this package.

Differences handled here:

- Server-argument defaults. 0.5.15-0.5.17 pass the real ``ServerArgs`` to
  ``CustomSpecAlgo.handle_server_args``; 0.5.23 passes a write-recording stand-in there and offers
  ``register_resolution_hook("handle_speculative_decoding")`` instead. Either way HISTORY gets
  exactly NGRAM's defaults and checks (``speculative_hook._handle_ngram``).
- Methods the scheduler calls on the algorithm object that ``CustomSpecAlgo`` lacks in some versions
  (``create_future_map``, ``carries_draft_hidden_states``, ``need_topk``, and whatever a later
  version adds): :class:`HistoryAlgo` answers them as the NGRAM enum member does.
- Worker construction: ``NGRAMWorker.__init__`` takes ``(server_args, gpu_id, tp_rank, dp_rank, ...,
  nccl_port, target_worker)`` in 0.5.15, ``(server_args, gpu_id, ps, nccl_port, target_worker)`` in
  0.5.17 and ``(server_args, gpu_id, nccl_port, target_worker)`` in 0.5.23: :func:`bind_worker_args`
  reads the arguments by name.
- Where the worker's settings come from: ``server_args`` up to 0.5.17, SGLang's resolved runtime
  context in 0.5.23 (:func:`ngram_settings`).
"""

from __future__ import annotations

import inspect
from importlib import metadata
from typing import Any

#: The server-argument fields that name an attention backend.
ATTENTION_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def sglang_version() -> tuple[int, ...]:
    v = metadata.version("sglang")
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def resolved(server_args: Any) -> Any:
    """The resolving view of server args mid-resolution (0.5.17+), else the args themselves."""
    try:
        from sglang.srt.arg_groups.overrides import resolved_view
    except ImportError:
        return server_args
    try:
        return resolved_view(server_args)
    except Exception:
        return server_args


def handle_ngram(server_args: Any) -> None:
    """SGLang's own NGRAM defaults and checks, applied to ``server_args``."""
    from sglang.srt.arg_groups.speculative_hook import _handle_ngram as handle

    handle(server_args)


def has_resolution_hooks() -> bool:
    """0.5.23+: server-argument defaults come from resolution hooks, not ``handle_server_args``."""
    try:
        from sglang.srt.arg_groups import resolution_hooks  # noqa: F401
    except ImportError:
        return False
    return True


def bind_worker_args(init: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """NGRAMWorker's constructor arguments by name, whatever the version's signature."""
    bound = inspect.signature(init).bind(None, *args, **kwargs)
    named = dict(bound.arguments)
    named.pop("self", None)
    return named


def ngram_settings(server_args: Any) -> dict[str, Any]:
    """The resolved settings ``NGRAMWorker.__init__`` stores on itself, read where the installed
    version's NGRAM reads them: from ``server_args`` up to 0.5.17, from the runtime context
    (``get_schedule``/``get_spec``/``get_device``) in 0.5.23. There the raw server args can differ
    from what the scheduler runs with (``--device cpu`` turns overlap scheduling off only in the
    resolved schedule, and an unset draft width is filled in only in the resolved spec)."""
    from sglang.srt.speculative import ngram_worker

    getters: list[Any] = [getattr(ngram_worker, n, None) for n in ("get_schedule", "get_spec", "get_device")]
    if all(callable(g) for g in getters):
        schedule, spec, device = (g() for g in getters)
    else:
        schedule = spec = device = server_args
    return {
        "enable_overlap": not schedule.disable_overlap_schedule,
        "page_size": schedule.page_size,
        "draft_token_num": spec.speculative_num_draft_tokens,
        "max_trie_depth": spec.speculative_ngram_max_trie_depth,
        "speculative_num_draft_tokens": spec.speculative_num_draft_tokens,
        "topk": spec.speculative_eagle_topk,
        "speculative_num_steps": spec.speculative_num_steps,
        "device": device.device,
    }


def tp_rank_of(named: dict[str, Any]) -> int:
    if "ps" in named and named["ps"] is not None:
        return int(named["ps"].tp_rank)
    if "tp_rank" in named:
        return int(named["tp_rank"])
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:
        return 0


def grammar_needs_sync(batch: Any) -> bool:
    fn = getattr(batch, "grammar_needs_sync", None)
    return bool(fn()) if callable(fn) else False
