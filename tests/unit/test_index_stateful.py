"""Random call sequences against HistoryIndex, checked against a plain Python model.

Hypothesis drives the whole Python surface in random order (requests begun, extended, finished
and dropped; responses added; drafts one at a time and in batches; groups removed; snapshots
saved, loaded and corrupted; the index cleared), with bad input mixed in. After every call the
index must agree with the model: which requests are in flight and in which group, which
responses each group keeps (retention: the last ``KEEP``), and every draft must be well formed
(root = last context token, parents first, no duplicate siblings, probabilities that only fall
along a path, every edge below the root a bigram of the group's text). Errors must be the
documented Python exceptions; a Rust panic would surface as ``pyo3_runtime.PanicException``,
which is not an ``Exception`` and fails the run. A second machine runs the same calls under a
memory budget, where idle groups may be evicted but never one with a request in flight.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import ClassVar

import numpy as np
import pytest
from _contract import check_contract
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import histospec_sgl as hs
from histospec_sgl import HistoryIndex

V = 10  # a small vocabulary, so that texts repeat and drafts branch
KEEP = 3  # max_responses
RIDS = st.integers(0, 5)
GROUPS = st.sampled_from([None, 1, 2, 2**64 - 1])
TOKEN = st.integers(0, V - 1)
BAD_TOKEN = st.sampled_from([-1, V, 2**31 - 1])
MASK_DTYPES = [np.int64, np.int32, np.uint8, np.bool_]


def check_draft(
    tokens: list[int],
    parents: list[int],
    probs: list[float],
    context: list[int],
    bigrams: set[tuple[int, int]],
    vocab: set[int],
    budget: int,
) -> None:
    assert 1 <= len(tokens) <= budget
    assert tokens[0] == context[-1], "node 0 is the last context token"
    assert parents[0] == -1 and probs[0] == 1.0
    kids: dict[int, set[int]] = defaultdict(set)
    for i in range(1, len(tokens)):
        p = parents[i]
        assert 0 <= p < i, "parents come before children"
        assert tokens[i] not in kids[p], "two siblings with the same token"
        kids[p].add(tokens[i])
        assert 0.0 < probs[i] <= probs[p] + 1e-6
        if p == 0:
            # A root child may be a followed source's guess at where it resumes: any token the
            # group has seen.
            assert tokens[i] in vocab
        else:
            assert (tokens[p], tokens[i]) in bigrams, f"edge {tokens[p]}->{tokens[i]} is in no text"


class IndexMachine(RuleBasedStateMachine):
    PLAIN: ClassVar[dict[str, int]] = {"vocab_size": V, "max_responses": KEEP}
    OPTIONS: ClassVar[dict[str, int]] = PLAIN

    def __init__(self) -> None:
        super().__init__()
        self.ix = HistoryIndex(**self.OPTIONS)
        self.evictions = 0  # the index's eviction count the model has accounted for
        # rid: (group, prompt, generated tokens, version)
        self.inflight: dict[int, tuple[int, list[int], list[int], int]] = {}
        self.kept: dict[int, list[tuple[list[int], list[int], int]]] = defaultdict(list)
        self.texts: dict[int, list[list[int]]] = defaultdict(list)  # everything a group ever saw

    # --- the model ---------------------------------------------------------------------------
    def group_text(self, g: int) -> tuple[set[tuple[int, int]], set[int]]:
        seqs = list(self.texts[g])
        seqs += [p + o for (gg, p, o, _) in self.inflight.values() if gg == g]
        bigrams = {(s[i], s[i + 1]) for s in seqs for i in range(len(s) - 1)}
        return bigrams, {t for s in seqs for t in s}

    def context(self, rid: int) -> list[int]:
        _, prompt, out, _ = self.inflight[rid]
        return prompt + out

    def some_requests(self, data: st.DataObject, most: int) -> list[int]:
        return data.draw(
            st.lists(st.sampled_from(sorted(self.inflight)), min_size=1, max_size=most, unique=True)
        )

    def drop_group(self, g: int) -> None:
        self.kept.pop(g, None)
        self.inflight = {r: v for r, v in self.inflight.items() if v[0] != g}

    # --- requests ----------------------------------------------------------------------------
    @rule(rid=RIDS, group=GROUPS, prompt=st.lists(TOKEN, max_size=4), version=st.none() | st.integers(0, 3))
    def begin(self, rid, group, prompt, version):
        if rid in self.inflight:
            with pytest.raises(hs.DuplicateRequestError):
                self.ix.begin_request(rid, group, prompt, version)
            return
        if not prompt:
            with pytest.raises(ValueError, match="at least one token"):
                self.ix.begin_request(rid, group, prompt, version)
            return
        key = self.ix.begin_request(rid, group, prompt, version)
        assert key == (hs.prompt_key(prompt) if group is None else group)
        self.inflight[rid] = (key, prompt, [], self.ix.version if version is None else version)
        self.texts[key].append(prompt)

    @rule(rid=RIDS, prompt=st.lists(TOKEN, min_size=1, max_size=3), bad=BAD_TOKEN)
    def begin_with_a_bad_token(self, rid, prompt, bad):
        with pytest.raises((hs.InvalidTokenError, ValueError, hs.DuplicateRequestError)):
            self.ix.begin_request(rid, None, prompt + [bad])
        assert self.ix.has_request(rid) == (rid in self.inflight)

    @rule(rid=RIDS, tokens=st.lists(TOKEN, max_size=6))
    def extend(self, rid, tokens):
        if rid not in self.inflight:
            with pytest.raises(hs.UnknownRequestError):
                self.ix.extend_request(rid, tokens)
            return
        self.ix.extend_request(rid, tokens)
        self.inflight[rid][2].extend(tokens)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), bad=BAD_TOKEN)
    def extend_with_a_bad_token_changes_nothing(self, data, bad):
        rid = data.draw(st.sampled_from(sorted(self.inflight)))
        before = self.ix.stats()["tokens"]
        with pytest.raises((hs.InvalidTokenError, ValueError)):
            self.ix.extend_request(rid, [0, bad])
        with pytest.raises((hs.InvalidTokenError, ValueError)):
            self.ix.extend_batch([rid], [1, bad], [2])
        assert self.ix.stats()["tokens"] == before

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def extend_batch(self, data):
        rids = self.some_requests(data, 4)
        lens = data.draw(st.lists(st.integers(0, 4), min_size=len(rids), max_size=len(rids)))
        flat = data.draw(st.lists(TOKEN, min_size=sum(lens), max_size=sum(lens)))
        if data.draw(st.booleans()):
            # A wrong total or an unknown id: rejected before anything is applied.
            before = self.ix.stats()["tokens"]
            with pytest.raises((ValueError, hs.UnknownRequestError)):
                if sum(lens) and data.draw(st.booleans()):
                    self.ix.extend_batch(rids, flat[:-1], lens)
                else:
                    self.ix.extend_batch(rids + [99], flat + [1], lens + [1])
            assert self.ix.stats()["tokens"] == before
            return
        self.ix.extend_batch(np.array(rids, np.int64), np.array(flat, np.int32), np.array(lens, np.int64))
        at = 0
        for r, n in zip(rids, lens):
            self.inflight[r][2].extend(flat[at : at + n])
            at += n

    @rule(rid=RIDS, keep=st.booleans(), defer=st.booleans())
    def finish(self, rid, keep, defer):
        if rid not in self.inflight:
            with pytest.raises(hs.UnknownRequestError):
                self.ix.finish_request(rid, keep, defer_removal=defer)
            return
        self.ix.finish_request(rid, keep, defer_removal=defer)
        g, prompt, out, version = self.inflight.pop(rid)
        if keep:
            self.kept[g] = (self.kept[g] + [(prompt, out, version)])[-KEEP:]
        if keep or defer:
            # Deferred, it is no history, but in-flight siblings may draft from it until the
            # group's next rebuild.
            self.texts[g].append(prompt + out)

    @rule(
        group=GROUPS,
        prompt=st.lists(TOKEN, min_size=1, max_size=3),
        response=st.lists(TOKEN, max_size=8),
        version=st.integers(0, 3),
    )
    def add_response(self, group, prompt, response, version):
        key = self.ix.add_response(group, prompt, response, version)
        self.kept[key] = (self.kept[key] + [(prompt, response, version)])[-KEEP:]
        self.texts[key].append(prompt + response)

    # --- drafts ------------------------------------------------------------------------------
    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), d=st.integers(1, 12), chain=st.booleans())
    def draft(self, data, d, chain):
        rid = data.draw(st.sampled_from(sorted(self.inflight)))
        tokens, parents, probs = self.ix.draft(rid, d, chain)
        check_draft(
            tokens, parents, probs, self.context(rid), *self.group_text(self.inflight[rid][0]), budget=d
        )
        if chain:
            assert parents == list(range(-1, len(tokens) - 1))

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), d=st.integers(1, 10), dtype=st.sampled_from(MASK_DTYPES))
    def draft_batch_equals_one_by_one(self, data, d, dtype):
        rids = self.some_requests(data, 6)
        bs = len(rids)
        tok = np.full(bs * d, -7, np.int64)
        mask = np.zeros(bs * d * d, dtype)
        probs = np.zeros(bs * d, np.float32)
        counts = np.zeros(bs, np.int64)
        nonempty, nodes = self.ix.draft_batch(
            rids, d, tok, mask, probs, counts, interleave=data.draw(st.booleans())
        )
        layout = check_contract(tok, mask, [self.context(r)[-1] for r in rids], d)
        total = 0
        for i, rid in enumerate(rids):
            t, p, pr = self.ix.draft(rid, d)
            n = len(t)
            row = slice(i * d, (i + 1) * d)
            assert tok[row][:n].tolist() == t
            assert np.allclose(probs[row][:n], pr) and (probs[row][n:] == 0).all()
            assert layout[i][:n] == p
            assert counts[i] == n - 1
            total += n - 1
        assert nodes == total and nonempty == int((counts > 0).sum())

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), k=st.integers(1, 8))
    def chain_batch_equals_one_by_one(self, data, k):
        rids = self.some_requests(data, 6)
        tok = np.full(len(rids) * k, -7, np.int64)
        lens = np.full(len(rids), -7, np.int64)
        self.ix.draft_chain_batch(rids, k, tok, lens)
        for i, rid in enumerate(rids):
            chain = self.ix.draft(rid, k + 1, True)[0][1:]
            assert lens[i] == len(chain)
            assert tok[i * k : i * k + len(chain)].tolist() == chain
            assert (tok[i * k + len(chain) : (i + 1) * k] == 0).all()

    @rule(rid=st.integers(6, 9), d=st.integers(0, 3))
    def draft_errors(self, rid, d):
        with pytest.raises(hs.UnknownRequestError):
            self.ix.draft(rid, max(d, 1))
        if self.inflight and d == 0:
            with pytest.raises(ValueError, match="at least 1"):
                self.ix.draft(next(iter(self.inflight)), 0)

    # --- groups and snapshots ----------------------------------------------------------------
    @rule(group=st.sampled_from([1, 2, 2**64 - 1, 12345]))
    def remove_group(self, group):
        known = group in self.ix.group_keys()
        assert self.ix.remove_group(group) == known
        self.drop_group(group)

    @rule()
    def clear(self):
        self.ix.clear()
        self.kept.clear()
        self.inflight.clear()
        self.evictions = self.ix.stats()["evictions"]

    @rule(load=st.booleans())
    def snapshot_round_trip(self, load):
        data = self.ix.to_bytes()
        other = HistoryIndex(**self.PLAIN)
        other.load_bytes(data)
        assert other.to_bytes() == data
        for g in self.ix.group_keys():
            assert other.responses(g) == self.ix.responses(g)
        if load:
            # Loading replaces the history; requests in flight do not survive it.
            self.ix.load_bytes(data)
            self.inflight.clear()
            self.evictions = 0  # a loaded index counts afresh

    @rule(data=st.data())
    def corrupt_snapshot_is_rejected_and_changes_nothing(self, data):
        blob = bytearray(self.ix.to_bytes())
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] ^= data.draw(st.integers(1, 255))
        before = (self.ix.stats(), sorted(self.inflight))
        with pytest.raises(hs.SnapshotError):
            self.ix.load_bytes(bytes(blob))
        with pytest.raises(hs.SnapshotError):
            self.ix.load_bytes(bytes(blob[: data.draw(st.integers(0, len(blob) - 1))]))
        assert (self.ix.stats(), sorted(self.inflight)) == before

    # --- invariants --------------------------------------------------------------------------
    @invariant()
    def agrees_with_the_model(self):
        s = self.ix.stats()
        # Groups the memory budget evicted: only idle ones, each counted.
        live = {g for g, r in self.kept.items() if r} | {v[0] for v in self.inflight.values()}
        gone = live - set(self.ix.group_keys())
        assert not gone & {v[0] for v in self.inflight.values()}, (
            "a group with requests in flight was evicted"
        )
        assert s["evictions"] - self.evictions == len(gone)
        self.evictions = s["evictions"]
        for g in gone:
            self.kept.pop(g)
        if gone:
            event("a group was evicted")
        assert s["requests"] == len(self.inflight)
        for rid in range(10):
            assert self.ix.has_request(rid) == (rid in self.inflight)
        for rid, (g, *_rest) in self.inflight.items():
            assert self.ix.request_group(rid) == g
        live = {g for g, r in self.kept.items() if r} | {v[0] for v in self.inflight.values()}
        assert set(self.ix.group_keys()) == live
        for g in live:
            assert [tuple(r) for r in self.ix.responses(g)] == [tuple(r) for r in self.kept[g]]
        assert s["responses"] == sum(len(self.kept[g]) for g in live)


TestIndexStateful = IndexMachine.TestCase
TestIndexStateful.settings = settings(
    # More for a longer hunt: HISTOSPEC_FUZZ_EXAMPLES=3000 pytest --timeout 0 tests/unit/test_index_stateful.py
    max_examples=int(os.environ.get("HISTOSPEC_FUZZ_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class BudgetMachine(IndexMachine):
    """The same calls under a memory budget of a few small groups: idle groups are evicted, least
    recently used first; a group with requests in flight never is."""

    OPTIONS: ClassVar[dict[str, int]] = {**IndexMachine.PLAIN, "max_bytes": 3000}


TestIndexStatefulBudget = BudgetMachine.TestCase
TestIndexStatefulBudget.settings = TestIndexStateful.settings
