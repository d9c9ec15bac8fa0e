"""Prometheus metrics of the HISTORY worker.

SGLang already exports the speculative-decoding figures it measures itself: the gauges
``sglang:spec_accept_length`` and ``sglang:spec_accept_rate``, and per request ``spec_verify_ct``,
``spec_accept_length`` and ``spec_accepted_drafts`` in each response's ``meta_info``. The metrics below
add what only the drafter knows. They exist when the server runs with ``--enable-metrics`` (SGLang
then puts ``prometheus_client`` in multiprocess mode and serves every process's metrics at
``/metrics``), on the drafting rank (TP rank 0), with SGLang's ``model_name`` and ``tp_rank`` labels
plus ``--extra-metric-labels``.

Counters (use ``rate()``; e.g. draft coverage is ``rate(histospec:covered_request_steps_total)`` over
``rate(histospec:request_steps_total)``, host time per step is ``rate(histospec:host_seconds_total)``
over ``rate(histospec:decode_steps_total)``):

=========================================  =====================================================
``histospec:decode_steps_total``           decode (verify) steps the worker prepared drafts for
``histospec:drafted_steps_total``          of those, steps that drafted (the rest were switched off)
``histospec:request_steps_total``          requests summed over steps (not those that had ended)
``histospec:covered_request_steps_total``  request-steps with a non-empty draft
``histospec:draft_tokens_offered_total``   draft nodes offered (root and pads excluded)
``histospec:draft_tokens_accepted_total``  draft tokens accepted
``histospec:draft_seconds_total``          host time in the batch draft call
``histospec:host_seconds_total``           host time the worker adds per step (context updates,
                                           draft, broadcast)
``histospec:plain_steps_total``            decode steps decoded plainly, no draft verified
                                           (chosen by the cost model)
``histospec:waiting_steps_total``          decode steps run while requests waited for a slot
                                           (the step policy then counts every promised token
                                           whole, docs/control.md)
``histospec:draft_errors_total``           errors while drafting (that step is verified without
                                           drafts) or syncing with the draft server
``histospec:context_mismatches_total``     requests whose last accepted tokens, as SGLang relays
                                           them, did not add up with its ``seq_lens`` (0 unless an
                                           SGLang version changes what it relays; the worker then
                                           falls back to NGRAM's rule and logs the first three)
``histospec:finished_requests_total``      finished requests; ``kept="1"`` the ones kept as history
``histospec:width_steps_total``            decode steps at each verify width (label ``width``; 1 is
                                           plain decoding), the step policy's choices
``histospec:verified_expected_tokens``     under the default step policy, the draft tokens its
``_total``                                 verified steps were expected to bring (promises times
                                           the calibration), per width and batch-size bucket
                                           (labels ``width``, ``batch``)
``histospec:verified_accepted_tokens``     the draft tokens those steps brought: over the expected
``_total``                                 ones, whether the calibration holds at each batch size
=========================================  =====================================================

Gauges (refreshed every :data:`INDEX_EVERY` steps): ``histospec:drafting`` (1 if the last step
drafted, 0 if the cost model decoded it plainly), ``histospec:index_groups``,
``histospec:index_responses``, ``histospec:index_tokens``, ``histospec:index_bytes``,
``histospec:inflight_requests`` and, under the default step policy, ``histospec:step_seconds``: a
decode step's cost as the policy measured it (the median of its last timings), per verify width
(label ``width``; 1 is plain decoding) and batch-size bucket (label ``batch``: the bucket's largest
batch, 1, 2, 4, 8, ...), the costs it chooses the width by; ``histospec:step_seconds_mean``, the
means of the same timings (a few slow steps lift a mean, not a median: what a run of steps pays);
``histospec:prefill_seconds_fixed`` and ``histospec:prefill_seconds_per_token``, what a prefill
forward pass costs, a fixed part a pass and a part per prompt token it computes (a line through
the passes timed, :meth:`~histospec_sgl.engine.clock.StepClock.prefill`): time the engine spends
outside decode steps.
"""

from __future__ import annotations

import threading
from typing import Any

#: Steps between two refreshes of the index-size gauges (``stats()`` walks every group).
INDEX_EVERY = 32

_COUNTERS = {
    # metric name: (documentation, drafter total it follows)
    "histospec:decode_steps": ("Decode (verify) steps the HISTORY worker prepared drafts for.", "steps"),
    "histospec:drafted_steps": ("Decode steps that drafted (the others were switched off).", "drafted_steps"),
    "histospec:request_steps": ("Requests summed over decode steps.", "request_steps"),
    "histospec:covered_request_steps": ("Request-steps with a non-empty history draft.", "covered"),
    "histospec:draft_tokens_offered": ("Draft nodes offered (root and pads excluded).", "offered"),
    "histospec:draft_tokens_accepted": ("Draft tokens accepted by verification.", "accepted"),
    "histospec:draft_seconds": ("Host seconds in the batch draft call.", "draft_seconds"),
    "histospec:waiting_steps": ("Decode steps run while requests waited for a slot.", "waiting_steps"),
}
_WORKER_COUNTERS = {
    # metric name: (documentation, the keyword of HistoryMetrics.observe giving the worker's count)
    "histospec:plain_steps": ("Decode steps decoded plainly (no draft verified).", "plain_steps"),
    "histospec:draft_errors": ("Errors while drafting or syncing with the draft server.", "errors"),
    "histospec:context_mismatches": (
        "Requests whose relayed tokens did not add up with SGLang's seq_lens.", "context_mismatches"),
}
_GAUGES = {
    "histospec:drafting": "1 if the HISTORY worker's last step drafted, 0 if its cost model decoded it plainly.",
    "histospec:index_groups": "Groups (prompts) in the history index.",
    "histospec:index_responses": "Finished responses held as history.",
    "histospec:index_tokens": "Response tokens held (history and in flight).",
    "histospec:index_bytes": "Bytes used by the history index.",
    "histospec:inflight_requests": "Requests drafting from the index right now.",
    "histospec:prefill_seconds_per_token": "A prefill forward pass's measured time per prompt token computed "
                                           "(default policy).",
    "histospec:prefill_seconds_fixed": "A prefill forward pass's measured time whatever it computes (default policy).",
}

#: The default policy's verified steps per width and batch bucket: (expected, accepted) tokens.
_VERIFIED = {
    "histospec:verified_expected_tokens": "Draft tokens the default policy's verified steps were expected to bring.",
    "histospec:verified_accepted_tokens": "Draft tokens the default policy's verified steps brought.",
}

#: The prefill gauges, labelled once a policy has timed a prefill: (fixed part, part per token).
_PREFILL = ("histospec:prefill_seconds_fixed", "histospec:prefill_seconds_per_token")

_families: dict[int, dict[str, Any]] = {}
_families_lock = threading.Lock()


def _metric_families(registry: Any, labelnames: tuple[str, ...]) -> dict[str, Any]:
    """The metric objects of ``registry``, created once per process (prometheus_client refuses a
    second registration of the same name)."""
    from prometheus_client import Counter, Gauge

    with _families_lock:
        fam = _families.get(id(registry))
        if fam is None:
            fam = {}
            for name, (doc, _) in _COUNTERS.items():
                fam[name] = Counter(name, doc, labelnames, registry=registry)
            fam["histospec:host_seconds"] = Counter(
                "histospec:host_seconds", "Host seconds the HISTORY worker adds per decode step.",
                labelnames, registry=registry)
            for name, (doc, _) in _WORKER_COUNTERS.items():
                fam[name] = Counter(name, doc, labelnames, registry=registry)
            fam["histospec:finished_requests"] = Counter(
                "histospec:finished_requests", "Finished requests (kept=1: kept as history).",
                (*labelnames, "kept"), registry=registry)
            fam["histospec:width_steps"] = Counter(
                "histospec:width_steps", "Decode steps at each verify width (1: plain decoding).",
                (*labelnames, "width"), registry=registry)
            for name, doc in _VERIFIED.items():
                fam[name] = Counter(name, doc, (*labelnames, "width", "batch"), registry=registry)
            for name, doc in _GAUGES.items():
                fam[name] = Gauge(name, doc, labelnames, registry=registry, multiprocess_mode="mostrecent")
            fam["histospec:step_seconds"] = Gauge(
                "histospec:step_seconds", "A decode step's measured cost per verify width and batch-size bucket.",
                (*labelnames, "width", "batch"), registry=registry, multiprocess_mode="mostrecent")
            fam["histospec:step_seconds_mean"] = Gauge(
                "histospec:step_seconds_mean", "The mean of the timings histospec:step_seconds is the median of.",
                (*labelnames, "width", "batch"), registry=registry, multiprocess_mode="mostrecent")
            _families[id(registry)] = fam
        return fam


class HistoryMetrics:
    """Follows a :class:`~histospec_sgl.engine.drafter.BatchDrafter`'s counters into Prometheus.

    Args:
        labels: label values (SGLang's ``model_name`` and ``tp_rank``, and any extra labels).
        registry: the ``prometheus_client`` registry; its default one when None (in multiprocess mode
            SGLang's ``/metrics`` collects from the files every process writes).
    """

    def __init__(self, labels: dict[str, Any], registry: Any = None):
        if registry is None:
            from prometheus_client import REGISTRY

            registry = REGISTRY
        self._labels = {k: str(v) for k, v in labels.items()}
        fam = _metric_families(registry, tuple(self._labels))
        self._m = {name: m.labels(**self._labels) for name, m in fam.items()
                   if name not in ("histospec:finished_requests", "histospec:width_steps", "histospec:step_seconds",
                                   "histospec:step_seconds_mean", *_PREFILL, *_VERIFIED)}
        self._verified_families = [fam[name] for name in _VERIFIED]
        fin = fam["histospec:finished_requests"]
        self._finished = {k: fin.labels(**self._labels, kept=k) for k in ("0", "1")}
        self._widths_family = fam["histospec:width_steps"]
        self._costs_family = fam["histospec:step_seconds"]
        self._means_family = fam["histospec:step_seconds_mean"]
        # Labelled once a policy has timed a prefill (none at a fixed width).
        self._prefill_families = [fam[name] for name in _PREFILL]
        self._widths: dict[int, Any] = {}
        self._seen: dict[str, float] = {}
        self._counts = dict.fromkeys(_WORKER_COUNTERS, 0)
        self._steps = 0

    @classmethod
    def from_sglang(cls, server_args: Any, tp_rank: int = 0) -> HistoryMetrics | None:
        """Metrics for a server started with ``--enable-metrics``, else None."""
        if not getattr(server_args, "enable_metrics", False):
            return None
        labels: dict[str, Any] = {"model_name": getattr(server_args, "served_model_name", None) or "",
                                  "tp_rank": tp_rank}
        extra = getattr(server_args, "extra_metric_labels", None)
        if isinstance(extra, dict):
            labels.update(extra)
        return cls(labels)

    def observe(self, drafter: Any, *, host_seconds: float, errors: int = 0, plain_steps: int = 0,
                context_mismatches: int = 0) -> None:
        """Records one decode step: ``drafter.totals`` since the last call, the worker's counts (errors,
        plainly decoded steps, requests whose context did not add up) and the host time it spent on
        the step."""
        totals = drafter.totals.as_dict()
        for name, (_, key) in _COUNTERS.items():
            value = totals[key]
            delta = value - self._seen.get(key, 0)
            if delta > 0:
                self._m[name].inc(delta)
            self._seen[key] = value
        kept = totals["kept"]
        for label, value in (("1", kept), ("0", totals["finished"] - kept)):
            delta = value - self._seen.get(f"finished{label}", 0)
            if delta > 0:
                self._finished[label].inc(delta)
            self._seen[f"finished{label}"] = value
        counts = {"errors": errors, "plain_steps": plain_steps, "context_mismatches": context_mismatches}
        for name, (_, key) in _WORKER_COUNTERS.items():
            if counts[key] > self._counts[name]:
                self._m[name].inc(counts[key] - self._counts[name])
            self._counts[name] = counts[key]
        for width, n in drafter.width_steps.items():
            counter = self._widths.get(width)
            if counter is None:
                counter = self._widths[width] = self._widths_family.labels(**self._labels, width=str(width))
            delta = n - self._seen.get(f"width{width}", 0)
            if delta > 0:
                counter.inc(delta)
            self._seen[f"width{width}"] = n
        for (width, bucket), tally in (getattr(drafter.policy, "verified_by", None) or {}).items():
            for family, value, tag in zip(self._verified_families, tally, ("expected", "accepted")):
                key = f"{tag}{width}/{bucket}"
                if value > self._seen.get(key, 0.0):
                    family.labels(**self._labels, width=str(width), batch=str(bucket)).inc(
                        value - self._seen.get(key, 0.0))
                self._seen[key] = value
        if host_seconds > 0:
            self._m["histospec:host_seconds"].inc(host_seconds)
        self._m["histospec:drafting"].set(float(drafter.drafting))
        if self._steps % INDEX_EVERY == 0:
            self.refresh_index(drafter)
        self._steps += 1

    def refresh_index(self, drafter: Any) -> None:
        """Sets the index-size gauges from ``drafter.index.stats()``."""
        st = drafter.index.stats()
        self._m["histospec:index_groups"].set(st["groups"])
        self._m["histospec:index_responses"].set(st["responses"])
        self._m["histospec:index_tokens"].set(st["tokens"])
        self._m["histospec:index_bytes"].set(st["bytes"])
        self._m["histospec:inflight_requests"].set(st["requests"])
        prefill = drafter.policy.prefill_cost()
        if prefill is not None:
            for family, seconds in zip(self._prefill_families, (prefill.fixed_s, prefill.per_token_s)):
                family.labels(**self._labels).set(seconds)
        for family, mean in ((self._costs_family, False), (self._means_family, True)):
            for (width, bucket), seconds in drafter.policy.step_costs(mean).items():
                family.labels(**self._labels, width=str(width), batch=str(bucket)).set(seconds)
