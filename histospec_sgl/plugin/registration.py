"""Registration of ``--speculative-algorithm HISTORY`` with SGLang: the algorithm class, its
server-argument checks and defaults, and the worker factory. SGLang-version differences come from
:mod:`histospec_sgl.plugin.compat`; nothing here is imported until :func:`histospec_sgl.plugin.register`
runs.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

from histospec_sgl import settings
from histospec_sgl.engine.config import NAME, SUPPORTED_SGLANG, HistoryConfig
from histospec_sgl.plugin import compat
from histospec_sgl.plugin.compat import ATTENTION_FIELDS, handle_ngram, has_resolution_hooks, resolved

logger = logging.getLogger("histospec_sgl.plugin")

FLASHINFER = "flashinfer"

#: Run before HISTORY's server arguments are checked, to complete the environment from what the
#: process runs in (the registry's resolvers: the Ray integration adds the draft-server actor's
#: lookup when its setup hook runs), so the engine plugin needs nothing from the trainer side.
ENV_RESOLVERS = settings.RESOLVERS


def _is_history(server_args: Any) -> bool:
    algo = getattr(server_args, "speculative_algorithm", None)
    return isinstance(algo, str) and algo.upper() == NAME


def validate_server_args(server_args: Any) -> None:
    """HISTORY's checks (SGLang calls this before the defaults are filled in).

    Raises:
        ValueError: an attention backend other than FlashInfer, or a bad ``HISTOSPEC_*`` value.
    """
    # E.g. in a trainer's engine actor (slime, verl), where ServerArgs are built and Ray is connected:
    # the draft server's address and token, which the SGLang processes started here inherit.
    settings.resolve()
    if (not ENV_RESOLVERS and settings.value("HISTOSPEC_DRAFT_SERVER_ACTOR")
            and not settings.value("HISTOSPEC_DRAFT_SERVER")):
        # (With the hook's resolver registered, a failed lookup was already logged by it.)
        logger.warning("histospec: HISTOSPEC_DRAFT_SERVER_ACTOR is set but unresolved here (the Ray setup hook "
                       "histospec_sgl.integrations.ray_setup.setup did not run in this process); no draft server")
    HistoryConfig.from_env()
    view = resolved(server_args)
    wrong = {}
    for field in ATTENTION_FIELDS:
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
    if _is_history(server_args) and all(getattr(server_args, f, None) is None for f in ATTENTION_FIELDS):
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
    ell = HistoryConfig.from_env().lenience
    if ell == 1.0:
        return
    current = getattr(resolved(server_args), "speculative_accept_threshold_acc", 1.0)
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
    if _is_history(resolved(server_args)):
        handle_ngram(server_args)
        _apply_lenience(server_args)
    return out


def _algo_class() -> type:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    ngram = SpeculativeAlgorithm.NGRAM
    hooked = has_resolution_hooks()

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
            if not hooked:
                handle_ngram(server_args)
                _apply_lenience(server_args)

        def __getattr__(self, name: str) -> Any:
            # A method a later SGLang asks every algorithm for: answer as NGRAM does.
            if name.startswith("__"):
                raise AttributeError(name)
            return getattr(ngram, name)

    return HistoryAlgo


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
        version = compat.sglang_version()
    except metadata.PackageNotFoundError:
        version = None
    if version is not None:
        found, span = ".".join(map(str, version)), f"{'.'.join(map(str, lo))} to {'.'.join(map(str, hi))}"
        if version[:3] < lo:
            # Untested below the floor (verl's own [sglang] extra pins 0.5.12): refuse rather than
            # decode with a verify path nobody ran.
            raise RuntimeError(f"histospec-sgl supports sglang {span}; found sglang {found}. Install a "
                               "supported SGLang in this environment (e.g. pip install sglang==0.5.17; beside "
                               "verl, after verl: docs/trainers.md)")
        if version[:3] > hi:
            logger.warning("histospec-sgl supports sglang %s; found %s (newer: continuing)", span, found)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.__post_init__", pick_flashinfer,
                          HookType.BEFORE)
    if has_resolution_hooks():
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        register_resolution_hook("handle_speculative_decoding")(_resolution_hook)
    SpeculativeAlgorithm.register(
        NAME,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=_algo_class(),
    )(_worker_factory)
