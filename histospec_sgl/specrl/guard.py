"""When a trainer's SPEC-RL may reuse a previous response, and its settings: one rule for slime,
verl and OpenRLHF.

SPEC-RL's acceptance test compares the current policy's log-prob of each previous token with the
one it was sampled under. The scoring pass that gives the current log-probs is a prefill: engines
return the model's plain distribution at prompt positions, without temperature, top-p/top-k/min-p
truncation, penalties or grammar masks. So the test is exact only for plain sampling at temperature
1, which is what RL rollouts use. Anything else (greedy evaluation, a lowered temperature, top-p
with slime's top-p replay, constrained decoding) is generated normally, by the trainer's own code,
and the reason is logged once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

from histospec_sgl import settings
from histospec_sgl.specrl.acceptance import check_lenience

log = logging.getLogger("histospec_sgl.specrl")

DEFAULT_TIMEOUT = 600.0

# (name, the value plain sampling has): SGLang's, verl's and vLLM's names are the same.
_PLAIN = (("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
          ("presence_penalty", 0.0), ("frequency_penalty", 0.0))
# Any of these set changes which tokens can be sampled.
_CONSTRAINTS = ("regex", "json_schema", "ebnf", "structural_tag", "logit_bias", "guided_decoding",
                "structured_outputs", "allowed_token_ids", "bad_words")
_MIN_TOKENS = ("min_new_tokens", "min_tokens")

_warned: set[str] = set()


def reuse_blocker(sampling_params: Mapping[str, Any] | Any, *, evaluation: bool = False) -> str | None:
    """Why SPEC-RL must not reuse a previous response under these sampling parameters, or None.

    ``sampling_params`` is a dict (SGLang's, slime's, verl's) or an object with the same attribute
    names (vLLM's ``SamplingParams``). ``evaluation``: the trainer's evaluation or validation
    requests, never reused (they must measure the policy, and must not become history).
    """
    if evaluation:
        return "evaluation"
    if isinstance(sampling_params, Mapping):
        get = sampling_params.get
    else:
        def get(name: str, default: Any = None) -> Any:
            return getattr(sampling_params, name, default)
    for name, plain in _PLAIN:
        v = get(name, None)
        if v is not None and not math.isclose(float(v), plain, abs_tol=1e-9):
            return f"{name}={v}"
    top_k = get("top_k", None)
    if top_k is not None and int(top_k) not in (0, -1) and int(top_k) < (1 << 30):
        return f"top_k={top_k}"
    for name in _MIN_TOKENS:
        v = get(name, None)
        if v is not None and int(v) > 1:  # OpenRLHF and vLLM pass min_tokens=1: EOS only after a token
            return f"{name}={v}"
    for name in _CONSTRAINTS:
        if get(name, None):
            return name
    custom = get("custom_params", None)
    if isinstance(custom, Mapping) and custom.get("return_top_p_token_ids"):
        return "return_top_p_token_ids"
    return None


def note_blocked(reason: str, trainer: str) -> None:
    """Logs once per (trainer, reason) that requests are generated normally."""
    key = f"{trainer}:{reason.split('=')[0]}"
    if key not in _warned:
        _warned.add(key)
        log.warning("histospec (%s): SPEC-RL reuses nothing for requests with %s (the scoring pass gives the "
                    "plain distribution's log-probs); they are generated normally", trainer, reason)


@dataclasses.dataclass(frozen=True)
class Options:
    """A trainer's SPEC-RL settings. Each trainer reads them from its own config (slime's YAML keys,
    verl's agent-loop arguments) and falls back to the environment: ``HISTOSPEC_LENIENCE``
    (ℓ >= 1, default 1: exact), ``HISTOSPEC_SPECRL_TIMEOUT`` (seconds per engine call, default 600),
    ``HISTOSPEC_DRAFT_SERVER``."""

    lenience: float = 1.0
    timeout: float = DEFAULT_TIMEOUT
    seed: int = 0
    draft_server: str | None = None

    @classmethod
    def resolve(cls, *, lenience: Any = None, timeout: Any = None, seed: Any = None,
                draft_server: str | None = None) -> Options:
        settings.resolve()  # e.g. the draft-server actor's address and token, inside a Ray job
        lenience = lenience if lenience not in (None, "") else settings.value("HISTOSPEC_LENIENCE")
        timeout = timeout if timeout not in (None, "") else settings.value("HISTOSPEC_SPECRL_TIMEOUT")
        try:
            timeout = float(timeout)
        except (TypeError, ValueError):
            raise ValueError(f"the SPEC-RL timeout must be a number of seconds, not {timeout!r}") from None
        if not timeout > 0 or math.isinf(timeout):
            raise ValueError(f"the SPEC-RL timeout must be a positive number of seconds, not {timeout}")
        return cls(lenience=check_lenience(float(lenience)), timeout=timeout, seed=int(seed or 0),
                   draft_server=draft_server or settings.value("HISTOSPEC_DRAFT_SERVER"))
