"""slime: HISTORY drafting and SPEC-RL rollouts through slime's own hooks.

Two functions for slime's command line (slime imports them by path)::

    --custom-generate-function-path histospec_sgl.integrations.slime.generate
    --rollout-all-samples-process-path histospec_sgl.integrations.slime.record
    --custom-config-path histospec.yaml

and, with a draft server, a data source that announces each next rollout's groups while this one
decodes, so that every engine has the history of the prompts routed back to it before their first
request (:class:`AnnouncingDataSource`)::

    --data-source-path histospec_sgl.integrations.slime.AnnouncingDataSource

:func:`generate` keeps a prompt's samples together: it sets the sample's routing key
(``session_id``, which slime sends as ``X-SMG-Routing-Key`` under ``--router-policy
consistent_hashing``) and ``custom_params.histospec_group`` to the prompt's group, so the n samples
of a group and its later epochs land on the same engine and draft from each other. sglang-router
0.3.2's command line has no ``consistent_hashing``; its ``manual`` policy routes by the same key,
and under it the inner generate is handed ``args`` that name ``consistent_hashing``, so that it
sends the key. Then:

- ``histospec_mode: history`` (default): hands the request to the inner generate (slime's own
  ``slime.rollout.sglang_rollout.generate`` unless ``histospec_inner_generate_path`` names another),
  which decodes with ``--sglang-speculative-algorithm HISTORY`` on the engines;
- ``histospec_mode: specrl``: wraps the inner generate with SPEC-RL. It scores the group's
  previous response for this sample slot under the current policy (through slime's HTTP client to
  its router) and cuts it at the first rejected token
  (:meth:`~histospec_sgl.specrl.client.SpecRLRollout.reuse`), appends the kept prefix to the sample
  with the current policy's log-probs, and hands the sample to the inner generate, which continues
  it as slime's generate continues a partial rollout. ``metadata["histospec"]`` holds the
  reused/generated counts. Requests SPEC-RL cannot score exactly go to the inner generate untouched
  (:func:`~histospec_sgl.specrl.guard.reuse_blocker`, the rule every trainer adapter shares:
  evaluation, temperature other than 1, top-p/top-k/min-p, penalties, constrained decoding), and so
  do samples without a previous response and partial rollouts slime resumes (which keep the
  counts of their first try).

:func:`record` runs after every rollout with all of its samples: finished ones (not aborted) become
the previous responses of the next epoch, with their log-probs, sample slot and the policy version
that sampled them (slime's ``weight_versions``), published to the draft server when one is set
(the one store every engine and trainer shares; in the background, so a draft server that is down
never fails or stalls a rollout) or kept in this process otherwise.

Settings: keys of the ``--custom-config-path`` YAML (slime sets each as an ``args`` attribute):

=================================  ==============================================================
``histospec_mode``                 ``history`` (default) or ``specrl``
``histospec_lenience``             SPEC-RL's ℓ >= 1 (default ``HISTOSPEC_LENIENCE`` or 1: exact)
``histospec_draft_server``         host:port of the draft server (default ``HISTOSPEC_DRAFT_SERVER``)
``histospec_inner_generate_path``  the generate to hand requests to (default
                                   ``HISTOSPEC_SLIME_INNER_GENERATE`` or slime's own)
``histospec_seed``                 seed of SPEC-RL's acceptance draws (default 0)
``histospec_length_first``         ``true``: a rollout's requests go to the engines longest
                                   predicted first (history mode; default off, see below)
``histospec_length_first_window``  seconds a request waits for the rest of its rollout (default
                                   0.02)
``histospec_timeout``              SPEC-RL: seconds the scoring call may take (default
                                   ``HISTOSPEC_SPECRL_TIMEOUT`` or 600)
``histospec_publish_wait``         SPEC-RL: seconds ``record`` waits for the draft server to hold
                                   the rollout's responses before the next rollout (default 60;
                                   a server that is down delays a rollout by at most this, never
                                   fails it)
=================================  ==============================================================

Length-first scheduling (``histospec_length_first: true``): a GRPO step ends when its longest
response ends, so the requests predicted to run longest should start first. slime submits a
rollout's requests all at once; each waits until no new one has arrived for the window, then they
go to the inner generate (and so to the router and the engines, whose scheduler admits in arrival
order) in descending order of predicted length: the expected longest of the group's n samples,
from the lengths of its previous responses (:meth:`~histospec_sgl.length.LengthPredictor.longest`;
a group without any goes last, in submission order). It is off by default: on the GRPO log the
prediction across runs orders a step too weakly to pay (bench/RESULTS.md, ``simulate``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import random
import threading
import weakref
from typing import Any

from histospec_sgl.integrations.versions import require
from histospec_sgl.settings import value as settings_value
from histospec_sgl.specrl import flow
from histospec_sgl.specrl.flow import SlotCounter
from histospec_sgl.specrl.guard import Options, note_blocked, reuse_blocker
from histospec_sgl.specrl.store import shared

require("slime")

logger = logging.getLogger("histospec_sgl.integrations")

DEFAULT_INNER = "slime.rollout.sglang_rollout.generate"
MODES = ("history", "specrl")
#: Each (group, slot)'s reuses so far in this process: the round that seeds its acceptance draws.
_rounds = SlotCounter()


@dataclasses.dataclass(frozen=True)
class Settings(Options):
    """slime's ``histospec_*`` YAML keys: SPEC-RL's :class:`Options` (lenience, timeout, seed, draft
    server: resolved as every trainer resolves them), and what only the slime adapter has."""

    mode: str = "history"
    inner_generate_path: str = DEFAULT_INNER
    length_first: bool = False
    length_first_window: float = 0.02
    publish_wait: float = 60.0

    @classmethod
    def from_args(cls, args: Any) -> Settings:
        mode = str(getattr(args, "histospec_mode", None) or "history").strip().lower()
        if mode not in MODES:
            raise ValueError(f"histospec_mode must be one of {', '.join(MODES)}, not {mode!r}")
        opts = Options.resolve(lenience=getattr(args, "histospec_lenience", None),
                               timeout=getattr(args, "histospec_timeout", None),
                               seed=getattr(args, "histospec_seed", None),
                               draft_server=getattr(args, "histospec_draft_server", None))
        return cls(
            **dataclasses.asdict(opts), mode=mode,
            inner_generate_path=(getattr(args, "histospec_inner_generate_path", None)
                                 or settings_value("HISTOSPEC_SLIME_INNER_GENERATE") or DEFAULT_INNER),
            length_first=_flag(getattr(args, "histospec_length_first", None)),
            length_first_window=float(getattr(args, "histospec_length_first_window", None) or 0.02),
            publish_wait=float(getattr(args, "histospec_publish_wait", None) or 60.0),
        )


def __getattr__(name: str) -> Any:
    # The data source subclasses slime's, imported only when slime asks for it by path: the rest of
    # this module loads where slime's source is not importable yet.
    if name == "AnnouncingDataSource":
        cls = _announcing_data_source()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _announcing_data_source() -> type:
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    class AnnouncingDataSource(_Announcing, RolloutDataSourceWithBuffer):
        __doc__ = _Announcing.__doc__

    AnnouncingDataSource.__module__ = __name__
    AnnouncingDataSource.__qualname__ = "AnnouncingDataSource"
    return AnnouncingDataSource


class _Announcing:
    """slime's own data source (``RolloutDataSourceWithBuffer``, unchanged in what it hands out and
    in its checkpoints) that, each time it hands out a rollout's prompts, announces the groups of the
    next rollout's to the draft server (:meth:`~histospec_sgl.sync.client.HistoryPublisher.announce`,
    in the background: a server that is down delays nothing). The next prompts are read, not taken
    (:meth:`_upcoming`), across an epoch's end too. Without a draft server
    (``histospec_draft_server`` or ``HISTOSPEC_DRAFT_SERVER``) it announces nothing."""

    dataset: Any
    sample_offset: int
    epoch_id: int
    args: Any

    def __init__(self, args: Any):
        from histospec_sgl.sync.client import Announcer

        super().__init__(args)  # type: ignore[call-arg]
        address = Settings.from_args(args).draft_server
        self._announcer = Announcer(address) if address else None

    @property
    def announced(self) -> int:
        """Groups announced so far."""
        return self._announcer.announced if self._announcer is not None else 0

    def get_samples(self, num_samples: int) -> Any:
        samples = super().get_samples(num_samples)  # type: ignore[misc]
        if self._announcer is not None and self.dataset is not None:
            groups = sorted({sample_group(s) for s in self._upcoming(num_samples)})
            if groups:
                threading.Thread(target=self._announcer.announce, args=(groups,), name="histospec-announce",
                                 daemon=True).start()
        return samples

    def _upcoming(self, n: int) -> list[Any]:
        """The prompts the next ``get_samples(n)`` hands out, read without taking them: past the
        offset, then the next epoch's first, in the order slime's ``Dataset.shuffle`` will draw (its
        seeded permutation of ``origin_samples``; a dataset without those attributes: this epoch's only)."""
        ds = self.dataset
        head = list(ds.samples[self.sample_offset:self.sample_offset + n])
        rest = n - len(head)
        origin = getattr(ds, "origin_samples", None)
        if rest <= 0 or origin is None:
            return head
        if self.args.rollout_shuffle:
            order = list(range(len(origin)))
            random.Random(getattr(ds, "seed", 0) + self.epoch_id + 1).shuffle(order)
            return head + [origin[i] for i in order[:rest]]
        return head + list(origin[:rest])


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        if value.strip().lower() not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
            raise ValueError(f"histospec_length_first must be true or false, not {value!r}")
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def sample_group(sample: Any) -> int:
    """A sample's history group by the one rule (:func:`histospec_sgl.group_key`):
    ``metadata["histospec_group"]`` if set (an int is the key, a string names the group), else its
    prompt named as a group (the text, or the chat messages as canonical JSON): the same for its n
    siblings and in every epoch, without tokenizing."""
    from histospec_sgl import group_key

    meta = getattr(sample, "metadata", None) or {}
    if "histospec_group" in meta:
        return group_key(group=meta["histospec_group"])
    prompt = sample.prompt
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return group_key(group=text)


def sample_slot(args: Any, sample: Any) -> int:
    """The sample's position in its group: slime numbers samples consecutively, n per group."""
    n = int(getattr(args, "n_samples_per_prompt", 1) or 1)
    index = getattr(sample, "index", None)
    return int(index) % n if index is not None else 0


def sample_version(sample: Any) -> int:
    """The policy version that sampled it: slime's last weight version (an int when SGLang reports
    one), else the rollout id, else 0."""
    for v in reversed(getattr(sample, "weight_versions", None) or []):
        try:
            return int(v)
        except (TypeError, ValueError):
            continue
    rid = getattr(sample, "rollout_id", None)
    return int(rid) if rid is not None else 0


# -- generate ---------------------------------------------------------------------------------------


def _load_inner(path: str) -> Any:
    from slime.utils.misc import load_function

    fn = load_function(path)
    if fn is generate:
        raise ValueError("histospec_inner_generate_path points back at histospec_sgl.integrations.slime.generate")
    return fn


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """slime's ``--custom-generate-function-path``; see the module docstring."""
    settings = Settings.from_args(args)
    group = sample_group(sample)
    sample.session_id = f"{group:016x}"  # the routing key: one engine per prompt
    params = dict(sampling_params)
    params["custom_params"] = {**(params.get("custom_params") or {}), "histospec_group": group}
    inner = _load_inner(settings.inner_generate_path)
    if settings.mode == "specrl":
        blocker = reuse_blocker(sampling_params, evaluation=evaluation)
        if blocker is None:
            return await _specrl_generate(args, sample, params, settings, group, inner)
        note_blocked(blocker, "slime")
    elif settings.length_first and not evaluation:
        await _gate(settings.length_first_window).wait_turn(_predicted_length(args, settings, group))
    return await _call_inner(inner, args, sample, params, evaluation)


KEYED_POLICIES = ("consistent_hashing", "manual")
"""sglang-router policies that route by ``X-SMG-Routing-Key``: slime sends the key only under the
first, which sglang-router 0.3.2's command line does not offer; the second routes by the same key."""


class _KeyedArgs:
    """slime's ``args``, live, except that ``router_policy`` reads ``consistent_hashing``: slime's
    generate then sends the sample's routing key to a router whose policy is ``manual``."""

    def __init__(self, args: Any):
        object.__setattr__(self, "_args", args)

    def __getattr__(self, name: str) -> Any:
        if name == "router_policy":
            return "consistent_hashing"
        return getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)


async def _call_inner(inner: Any, args: Any, sample: Any, params: dict[str, Any], evaluation: bool) -> Any:
    if getattr(args, "router_policy", None) == "manual":
        args = _KeyedArgs(args)
    if "evaluation" in inspect.signature(inner).parameters:
        return await inner(args, sample, params, evaluation=evaluation)
    return await inner(args, sample, params)


async def _specrl_generate(args: Any, sample: Any, params: dict[str, Any], settings: Settings, group: int,
                           inner: Any) -> Any:
    """Scores the slot's previous response and cuts it (:meth:`SpecRLRollout.reuse`), appends the kept
    prefix to the sample with the current policy's log-probs, and hands the sample to the inner
    generate, which continues it as slime's generate continues a partial rollout (from
    ``sample.tokens``, with ``max_new_tokens`` less the response so far)."""
    from slime.rollout.sglang_rollout import GenerateState, _prepare_prompt_ids
    from slime.utils.http_utils import post
    from slime.utils.types import Sample

    slot = sample_slot(args, sample)
    if sample.response_length:
        # A partial rollout slime resumes is continued as it is, keeping the counts of its first try.
        before = sample.metadata.get("histospec") or {}
        out = await _call_inner(inner, args, sample, params, False)
        _count(out, int(before.get("reused", 0)), int(before.get("previous_len", 0)))
        return out
    previous = shared().get(settings.draft_server, group, slot)
    if previous is None or not previous.response_ids or sample.multimodal_inputs:
        out = await _call_inner(inner, args, sample, params, False)
        _count(out, 0, len(previous.response_ids) if previous is not None else 0)
        return out
    assert sample.status in (Sample.Status.PENDING, Sample.Status.ABORTED), f"Sample status is {sample.status}"
    state = GenerateState(args)
    prompt_ids = list(_prepare_prompt_ids(sample, state.tokenizer, state.processor))
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    headers = ({"X-SMG-Routing-Key": sample.session_id}
               if getattr(args, "router_policy", None) in KEYED_POLICIES else None)

    async def backend(payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        return await asyncio.wait_for(post(url, payload, headers=headers), timeout)

    # slime's abort() sets state.aborted, then aborts every engine's requests: a scoring call SGLang
    # aborts, or one not yet sent, comes back as an aborted sample with nothing reused.
    reuse = await flow.reuse(backend, settings, group=group, slot=slot, round_=_rounds.count((group, slot)),
                             prompt_ids=prompt_ids, sampling_params={**params, "max_new_tokens": int(params["max_new_tokens"])},
                             previous=previous, aborted=lambda: bool(state.aborted), name=str(sample.index))
    if not sample.tokens:  # as slime's generate sets them before its request, aborted or not
        sample.tokens = prompt_ids
    if reuse.aborted:
        sample.status = Sample.Status.ABORTED
        _count(sample, 0, reuse.previous_len)
        return sample
    skip = bool(params.get("skip_special_tokens", True))
    text = state.tokenizer.decode(reuse.prefix, skip_special_tokens=skip) if reuse.prefix else ""
    meta = None
    if reuse.done:
        # The scoring call's meta_info (weight version, cache counters), with the finish reason of the
        # kept response; its speculative counters describe the scoring prefill, not this response.
        meta = {k: v for k, v in (reuse.meta_info or {}).items() if k not in _SCORING_COUNTERS}
        meta["finish_reason"] = {"type": reuse.finish_reason}
    sample.append_response_tokens(args, tokens=reuse.prefix, log_probs=reuse.logprobs, trainable=True, text=text,
                                  meta_info=meta)
    if not reuse.done and state.aborted:
        # Aborted after the scoring call: a partial rollout keeps the prefix and resumes from it.
        sample.status = Sample.Status.ABORTED
    elif not reuse.done:
        # The inner generate subtracts the response so far from max_new_tokens, as for a partial rollout.
        sample = await _call_inner(inner, args, sample, params, False)
        if sample.response_length and sample.loss_mask == [1] * sample.response_length:
            # One model-generated response: its text decoded whole, not in two pieces.
            sample.response = state.tokenizer.decode(sample.tokens[-sample.response_length:],
                                                     skip_special_tokens=skip)
    _count(sample, len(reuse.prefix), reuse.previous_len)
    return sample


_SCORING_COUNTERS = ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct", "completion_tokens")


def _count(sample: Any, reused: int, previous_len: int) -> None:
    sample.metadata["histospec"] = {"reused": reused, "generated": int(sample.response_length or 0) - reused,
                                    "previous_len": previous_len}


# -- length-first ----------------------------------------------------------------------------------


class LengthFirstGate:
    """Holds requests until none has arrived for ``window`` seconds, then lets them go longest
    predicted first (ties and unknown lengths: arrival order)."""

    def __init__(self, window: float):
        self.window = window
        self._pending: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None

    async def wait_turn(self, predicted: float | None) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        key = -predicted if predicted is not None else float("inf")
        self._pending.append((key, self._seq, fut))
        self._seq += 1
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_later(self.window, self._release)
        await fut

    def _release(self) -> None:
        batch, self._pending, self._timer = sorted(self._pending, key=lambda x: x[:2]), [], None
        for _, _, fut in batch:
            if not fut.done():  # a cancelled request is skipped
                fut.set_result(None)


_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LengthFirstGate] = weakref.WeakKeyDictionary()


def _gate(window: float) -> LengthFirstGate:
    loop = asyncio.get_running_loop()
    gate = _GATES.get(loop)
    if gate is None:
        gate = _GATES[loop] = LengthFirstGate(window)
    return gate


def _predicted_length(args: Any, settings: Settings, group: int) -> float | None:
    """The expected longest of the group's n samples, from its previous responses' lengths
    (:meth:`~histospec_sgl.length.LengthPredictor.longest`; None: it has none)."""
    from histospec_sgl.length import LengthPredictor

    predictor = LengthPredictor()
    n = int(getattr(args, "n_samples_per_prompt", 1) or 1)
    for slot in range(n):
        prev = shared().get(settings.draft_server, group, slot)
        if prev is not None:
            predictor.record(group, len(prev.response_ids))
    return predictor.longest(group, n) if predictor.known(group) else None


# -- record -----------------------------------------------------------------------------------------


def _flatten(items: Any) -> list[Any]:
    out: list[Any] = []
    for x in items:
        if isinstance(x, (list, tuple)):
            out.extend(_flatten(x))
        else:
            out.append(x)
    return out


def record(args: Any, all_samples: Any, data_source: Any = None) -> None:
    """slime's ``--rollout-all-samples-process-path``: each sample translated for SPEC-RL's one rule
    (:func:`histospec_sgl.specrl.flow.record`: finished, not aborted, log-probs where there is one
    per token); see the module docstring."""
    settings = Settings.from_args(args)
    kept = 0
    for sample in _flatten(all_samples):
        done = finished(args, sample)
        if done is not None:
            kept += flow.record(settings.draft_server, done)
    if settings.draft_server and kept and settings.mode == "specrl":
        # The next rollout starts right after this returns: have its previous responses here, unless
        # the draft server is down (then it goes on without them; they follow once it is back).
        shared().settle(settings.draft_server, settings.publish_wait)
    logger.info("histospec: recorded %d finished samples%s", kept,
                f" on the draft server {settings.draft_server}" if settings.draft_server else "")


def finished(args: Any, sample: Any) -> flow.Finished | None:
    """A slime ``Sample`` as SPEC-RL records it (None: it has no response): its last
    ``response_length`` tokens are the response, its status the finish reason."""
    from slime.utils.types import Sample

    n = int(sample.response_length or 0)
    if n == 0 or len(sample.tokens) < n:
        return None
    logprobs = list(sample.rollout_log_probs or [])[-n:] if sample.rollout_log_probs else None
    finish = {Sample.Status.COMPLETED: "stop", Sample.Status.TRUNCATED: "length",
              Sample.Status.ABORTED: "abort"}.get(sample.status)
    return flow.Finished.of(sample.tokens[:-n], sample.tokens[-n:], logprobs, finish, group=sample_group(sample),
                            slot=sample_slot(args, sample), version=sample_version(sample),
                            reward=_reward(args, sample))


def _reward(args: Any, sample: Any) -> float | None:
    r = sample.reward
    if isinstance(r, dict):
        key = getattr(args, "reward_key", None)
        r = r.get(key) if key else None
    try:
        return float(r) if r is not None else None
    except (TypeError, ValueError):
        return None
