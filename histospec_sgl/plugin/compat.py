"""Everything that depends on the SGLang version, in one place (0.5.15 to 0.5.23).

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
import logging
import os
from importlib import metadata
from typing import Any

from histospec_sgl.plugin import NAME, SUPPORTED_SGLANG

logger = logging.getLogger("histospec_sgl.plugin")

FLASHINFER = "flashinfer"
_ATTENTION_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def sglang_version() -> tuple[int, ...]:
    v = metadata.version("sglang")
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _is_history(server_args: Any) -> bool:
    algo = getattr(server_args, "speculative_algorithm", None)
    return isinstance(algo, str) and algo.upper() == NAME


def _resolved(server_args: Any) -> Any:
    """The resolving view of server args mid-resolution (0.5.17+), else the args themselves."""
    try:
        from sglang.srt.arg_groups.overrides import resolved_view
    except ImportError:
        return server_args
    try:
        return resolved_view(server_args)
    except Exception:
        return server_args


def _handle_ngram(server_args: Any) -> None:
    from sglang.srt.arg_groups.speculative_hook import _handle_ngram as handle

    handle(server_args)


def validate_server_args(server_args: Any) -> None:
    """HISTORY's checks (SGLang calls this before the defaults are filled in).

    Raises:
        ValueError: an attention backend other than FlashInfer, or a bad ``HISTOSPEC_*`` value.
    """
    from histospec_sgl.plugin.config import HistoryConfig

    if os.environ.get("HISTOSPEC_DRAFT_SERVER_ACTOR") and not os.environ.get("HISTOSPEC_DRAFT_SERVER"):
        # In a trainer's engine actor (slime, verl), where ServerArgs are built and Ray is connected:
        # the SGLang processes started from here inherit the address.
        from histospec_sgl.integrations.ray_draft_server import resolve_env

        resolve_env()
    HistoryConfig.from_env()
    view = _resolved(server_args)
    wrong = {}
    for field in _ATTENTION_FIELDS:
        value = getattr(view, field, None)
        if value is not None and value != FLASHINFER:
            wrong[field] = value
    if wrong:
        got = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in wrong.items())
        raise ValueError(
            f"--speculative-algorithm {NAME} verifies draft trees with FlashInfer's custom attention "
            f"masks, but the server was given {got}. Use --attention-backend flashinfer (or leave the "
            "attention backend unset and HISTORY picks it)."
        )


def pick_flashinfer(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """``ServerArgs.__post_init__`` BEFORE hook: HISTORY with no attention backend gets FlashInfer
    (SGLang's automatic choice, fa3 on Hopper, is made before speculative defaults are known)."""
    if _is_history(server_args) and all(getattr(server_args, f, None) is None for f in _ATTENTION_FIELDS):
        server_args.attention_backend = FLASHINFER
        logger.info("histospec: --speculative-algorithm HISTORY: using --attention-backend flashinfer")


def _apply_lenience(server_args: Any) -> None:
    """``HISTOSPEC_LENIENCE`` = ℓ becomes ``speculative_accept_threshold_acc`` = 1/ℓ.

    SGLang's sampling verification walks the children of each accepted node with one coin u and
    accepts child k when u < (p_1 + ... + p_k) / threshold_acc (p: the target probability of each
    child's token). With threshold 1/ℓ a node with a single child -- every node of a chain -- is
    accepted with probability min(1, ℓ·p): the SPEC-RL rule for a draft of probability 1. With
    several children the level is accepted with probability min(1, ℓ·Σp), earlier children first.
    Greedy requests are unaffected (exact match)."""
    from histospec_sgl.plugin.config import HistoryConfig

    ell = HistoryConfig.from_env().lenience
    if ell == 1.0:
        return
    current = getattr(_resolved(server_args), "speculative_accept_threshold_acc", 1.0)
    if current not in (None, 1.0):
        raise ValueError(
            f"HISTOSPEC_LENIENCE={ell} sets --speculative-accept-threshold-acc to {1 / ell:.6g}, but it "
            f"was given as {current}; set one of them"
        )
    server_args.speculative_accept_threshold_acc = 1.0 / ell
    logger.warning("histospec: HISTOSPEC_LENIENCE=%s: sampled requests accept drafts leniently "
                   "(speculative_accept_threshold_acc=%.6g); outputs are no longer exactly the policy's",
                   ell, 1.0 / ell)


def _resolution_hook(server_args: Any, previous: Any) -> Any:
    out = previous(server_args)
    if _is_history(_resolved(server_args)):
        _handle_ngram(server_args)
        _apply_lenience(server_args)
    return out


def _algo_class() -> type:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    ngram = SpeculativeAlgorithm.NGRAM
    has_resolution_hooks = _has_resolution_hooks()

    class HistoryAlgo(CustomSpecAlgo):
        """HISTORY: NGRAM's verify path with drafts from the history index."""

        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def carries_draft_hidden_states(self) -> bool:
            return False

        def create_future_map(self, device: Any, req_to_token_pool: Any, *args: Any, **kwargs: Any) -> Any:
            # Same call as the enum's (the extra flags differ between versions).
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, *args, **kwargs)

        def handle_server_args(self, server_args: Any) -> None:
            if not has_resolution_hooks:
                _handle_ngram(server_args)
                _apply_lenience(server_args)

        def __getattr__(self, name: str) -> Any:
            # A method a later SGLang asks every algorithm for: answer as NGRAM does.
            if name.startswith("__"):
                raise AttributeError(name)
            return getattr(ngram, name)

    return HistoryAlgo


def _has_resolution_hooks() -> bool:
    try:
        from sglang.srt.arg_groups import resolution_hooks  # noqa: F401
    except ImportError:
        return False
    return True


def _worker_factory(server_args: Any) -> type:
    try:
        from histospec_sgl.plugin.worker import HistoryWorker
    except ImportError as e:
        raise RuntimeError(
            f"histospec-sgl: the HISTORY worker cannot be imported ({e}). It needs SGLang's NGRAM worker "
            "(sglang-kernel, a CUDA GPU) and histospec-sgl's native module in the same environment."
        ) from e
    return HistoryWorker


def register_history() -> None:
    """Registers HISTORY with SGLang (idempotent; imports only SGLang's registry)."""
    from sglang.srt.speculative import spec_registry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    if spec_registry.get_spec(NAME) is not None:
        return
    lo, hi = SUPPORTED_SGLANG
    try:
        version = sglang_version()
        if not lo <= version[:3] <= hi:
            logger.warning(
                "histospec-sgl supports sglang %s to %s; found %s (continuing)",
                ".".join(map(str, lo)), ".".join(map(str, hi)), ".".join(map(str, version)),
            )
    except metadata.PackageNotFoundError:
        pass
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.__post_init__", pick_flashinfer,
                          HookType.BEFORE)
    if _has_resolution_hooks():
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        register_resolution_hook("handle_speculative_decoding")(_resolution_hook)
    SpeculativeAlgorithm.register(
        NAME,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=_algo_class(),
    )(_worker_factory)


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

    getters = [getattr(ngram_worker, n, None) for n in ("get_schedule", "get_spec", "get_device")]
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
