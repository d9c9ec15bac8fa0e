"""HISTORY's acceptance in verl's metrics.

verl turns three per-request fields of a rollout (``spec_num_draft_tokens``,
``spec_num_accepted_tokens``, ``spec_num_verify_steps``) into ``rollout/spec_accept_rate`` and
``rollout/spec_accept_length`` (``compute_spec_decode_metrics`` in its trainer), but its SGLang server
(``SGLangHttpServer.generate``) fills them only when its own MTP drafting is on. With this installed
(the ``verl.plugins`` entry point does it in every verl process, when verl's SGLang server module is
first imported), the server fills them from SGLang's answer whenever SGLang speculated and MTP did
not: SGLang 0.5.17 reports ``spec_num_proposed_drafts`` / ``spec_num_correct_drafts`` /
``spec_verify_ct``, newer releases ``spec_draft_token_num`` / ``spec_accept_token_num``. A server
running a speculative algorithm fills all three for every request (zeros when nothing was drafted),
because verl refuses a batch where only some requests carry them.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger("histospec_sgl.integrations")

SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"
KEYS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_verify_steps")
_META: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar("histospec_meta", default=None)


def spec_fields(meta: dict[str, Any], speculating: bool) -> dict[str, int] | None:
    """verl's three fields from one SGLang ``meta_info``; None when SGLang did not speculate."""
    verify = meta.get("spec_verify_ct")
    if verify is None and not speculating:
        return None
    drafts = meta.get("spec_draft_token_num", meta.get("spec_num_proposed_drafts", 0))
    accepted = meta.get("spec_accept_token_num", meta.get("spec_num_correct_drafts", 0))
    return {"spec_num_draft_tokens": int(drafts or 0), "spec_num_accepted_tokens": int(accepted or 0),
            "spec_num_verify_steps": int(verify or 0)}


def _capture(generate_request: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a TokenizerManager's ``generate_request`` (an async generator) so that the request's
    ``meta_info`` reaches the ``generate`` call that awaits it."""

    @functools.wraps(generate_request)
    async def wrapped(obj: Any, request: Any = None) -> Any:
        async for out in generate_request(obj, request):
            holder = _META.get()
            if holder is not None and isinstance(out, dict):
                holder.append(out.get("meta_info") or {})
            yield out

    wrapped.__histospec__ = True  # type: ignore[attr-defined]
    return wrapped


def _speculating(server: Any) -> bool:
    try:
        return bool((server.config.engine_kwargs or {}).get("sglang", {}).get("speculative_algorithm"))
    except AttributeError:
        return False


def patch(module: ModuleType) -> bool:
    """Patches ``module.SGLangHttpServer.generate`` (verl's server module); True once patched."""
    cls = getattr(module, "SGLangHttpServer", None)
    if cls is None:
        log.warning("histospec: verl's SGLang server module has no SGLangHttpServer; acceptance stays out of "
                    "verl's metrics")
        return False
    original = cls.generate
    if getattr(original, "__histospec__", False):
        return True

    @functools.wraps(original)
    async def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        tm = getattr(self, "tokenizer_manager", None)
        if tm is not None and not getattr(tm.generate_request, "__histospec__", False):
            tm.generate_request = _capture(tm.generate_request)
        holder: list[dict[str, Any]] = []
        token = _META.set(holder)
        try:
            out = await original(self, *args, **kwargs)
        finally:
            _META.reset(token)
        extra = getattr(out, "extra_fields", None)
        if holder and isinstance(extra, dict) and not all(k in extra for k in KEYS):
            fields = spec_fields(holder[-1], _speculating(self))
            if fields is not None:
                extra.update(fields)
        return out

    generate.__histospec__ = True  # type: ignore[attr-defined]
    cls.generate = generate
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches verl's server module right after it is first imported, so that a verl process that
    never serves does not pay for importing it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != SERVER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        inner = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return inner.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                inner.exec_module(module)  # type: ignore[union-attr]
                try:
                    patch(module)
                except Exception as e:  # never break verl's own import
                    log.warning("histospec: could not put HISTORY's acceptance into verl's metrics: %s", e)

        spec.loader = Loader()
        return spec


def install() -> bool:
    """Patches verl's SGLang server now if it is imported, else when it is; never raises."""
    try:
        module = sys.modules.get(SERVER_MODULE)
        if module is not None:
            return patch(module)
        if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())
        return True
    except Exception as e:
        log.warning("histospec: could not put HISTORY's acceptance into verl's metrics: %s", e)
        return False
