"""SPEC-RL mode: reuse a prompt's previous response, score it in one pass, cut at the first rejection.

:func:`cut_points` is the acceptance rule over a batch; :func:`plan` decides what is left to
generate; :class:`SpecRLRollout` runs it against a SGLang server or engine (:meth:`SpecRLRollout.reuse`: score
and cut only, for a trainer's own generate to continue); :func:`reuse_blocker` says when a trainer
must not reuse; :mod:`histospec_sgl.specrl.synthetic` holds the synthetic policy pair behind the tests
and ``histospec-sgl bench specrl``.
"""

from histospec_sgl.specrl.acceptance import (
    Plan,
    SpecRLError,
    acceptance_probs,
    check_lenience,
    cut_points,
    plan,
)
from histospec_sgl.specrl.client import (
    Previous,
    PreviousResponses,
    Reuse,
    RolloutCounters,
    RolloutRequest,
    RolloutResult,
    SpecRLRequestError,
    SpecRLRollout,
)
from histospec_sgl.specrl.guard import Options, reuse_blocker

__all__ = [
    "Plan", "SpecRLError", "acceptance_probs", "check_lenience", "cut_points", "plan",
    "SpecRLRollout", "RolloutRequest", "RolloutResult", "RolloutCounters", "Previous", "PreviousResponses",
    "SpecRLRequestError", "Reuse", "Options", "reuse_blocker",
]
