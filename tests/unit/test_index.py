"""The Python surface of HistoryIndex: literal drafts, buffer shapes, errors, snapshots, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash
from _contract import check_contract

import histospec_sgl as hs
from histospec_sgl import HistoryIndex, prompt_key
from histospec_sgl.engine.draft import tree_mask, tree_parents, tree_parents_batch, write_empty

FREQUENCY = {"recency": 0.0, "escape_short": 0.0, "follow": 0.0}


def make_index(**kw) -> HistoryIndex:
    # Frequency-only draft policy, so the expected drafts below can be computed by hand.
    ix = HistoryIndex(**{**FREQUENCY, **kw})
    ix.add_response(None, [1, 2, 3], [4, 5, 6, 7, 8], 0)
    ix.add_response(None, [1, 2, 3], [4, 5, 9, 7, 8], 0)
    ix.add_response(None, [1, 2, 3], [4, 5, 6, 7, 10], 0)
    return ix


def test_prompt_key_is_xxh3_of_int32_le_bytes():
    # The reference is the independent xxhash package; the key must not depend on the container.
    a = hs.prompt_key([1, 2, 3])
    assert a == hs.prompt_key(np.array([1, 2, 3], dtype=np.int32))
    assert a == hs.prompt_key(np.array([1, 2, 3], dtype=np.int64))
    assert a != hs.prompt_key([1, 2, 4])
    assert a == xxhash.xxh3_64_intdigest(np.array([1, 2, 3], dtype="<i4").tobytes())


def test_draft_follows_most_frequent_continuation():
    ix = make_index()
    g = ix.begin_request(1, None, [1, 2, 3])
    assert g == hs.prompt_key([1, 2, 3])
    ix.extend_request(1, [4, 5])
    d = hs.draft(ix, 1, num_nodes=4, chain=True)
    # After "4 5": 6 (twice) beats 9 (once); then 7 always follows 6.
    assert d.tokens.tolist() == [5, 6, 7, 8]
    assert d.parents.tolist() == [-1, 0, 1, 2]
    assert d.probs[0] == 1.0 and np.all(np.diff(d.probs) <= 0)


def test_tree_offers_alternatives_without_duplicate_siblings():
    ix = make_index()
    ix.begin_request(1, None, [1, 2, 3])
    ix.extend_request(1, [4, 5])
    d = hs.draft(ix, 1, num_nodes=8)
    assert [6, 7, 8] in d.paths() or [6, 7, 8] in [p[:3] for p in d.paths()]
    first = [int(t) for t, p in zip(d.tokens, d.parents) if p == 0]
    assert sorted(first) == [6, 9]
    for parent in set(d.parents.tolist()):
        kids = d.tokens[d.parents == parent]
        assert len(kids) == len(set(kids.tolist()))


@pytest.mark.parametrize("mask_dtype", [np.int64, np.int32, np.uint8, np.bool_])
def test_draft_batch_fills_sglang_layout(mask_dtype):
    ix = make_index()
    for rid in (10, 11):
        ix.begin_request(rid, None, [1, 2, 3])
    ix.extend_request(10, [4, 5])
    d = 6
    tokens = np.full(2 * d, -7, np.int64)
    mask = np.zeros(2 * d * d, mask_dtype)
    probs = np.zeros(2 * d, np.float32)
    nonempty, nodes = ix.draft_batch(np.array([10, 11]), d, tokens, mask, probs)
    assert nonempty == 2 and nodes > 0
    # Roots are the last context tokens; ancestor masks; no duplicate siblings.
    check_contract(tokens, mask, [5, 3], d)
    t = tokens.reshape(2, d)
    # The same request drafted alone gives the same tree as in the batch.
    single = hs.draft(ix, 10, num_nodes=d)
    assert t[0, : len(single)].tolist() == single.tokens.tolist()
    assert np.allclose(probs[: len(single)], single.probs)
    # The layout helpers (histospec_sgl.engine.draft) are the index's layout: the mask of the tree
    # from its parents, padding included, is the one written; the parents read back from the written
    # mask are the tree's; an empty draft is written as the index writes a request with nothing.
    m = mask.reshape(2, d, d).astype(bool)
    assert (m[0] == single.mask(d)).all() and (m[0] == tree_mask(single.parents, d)).all()
    assert tree_parents(mask[: d * d], d)[: len(single)].tolist() == single.parents.tolist()
    assert tree_parents(mask[: d * d], d)[len(single):].tolist() == list(range(len(single) - 1, d - 1))
    assert (tree_parents_batch(mask, d) == [tree_parents(mask[b * d * d:(b + 1) * d * d], d) for b in (0, 1)]).all()
    ix.begin_request(12, None, [77, 78])  # nothing to draft from
    alone_t, alone_m = np.zeros(d, np.int64), np.zeros(d * d, mask_dtype)
    assert ix.draft_batch([12], d, alone_t, alone_m)[0] == 0
    empty_t, empty_m = np.full(d, 5, np.int64), np.zeros(d * d, mask_dtype)
    write_empty(empty_t, empty_m, [78], d)
    assert empty_t.tolist() == alone_t.tolist() and (empty_m == alone_m).all()


def _add_siblings(ix: HistoryIndex, rng: np.random.Generator, groups: int, length: int, vocab: int) -> None:
    """Group g (prompt [g+1, 99]) gets three siblings of one random base response, each with about
    10% of its tokens replaced."""
    for g in range(groups):
        base = rng.integers(1, vocab, length).tolist()
        for _ in range(3):
            resp = [t if rng.random() > 0.1 else int(rng.integers(1, vocab)) for t in base]
            ix.add_response(g, [g + 1, 99], resp, 0)


def test_interleaved_batch_equals_one_by_one():
    # Batches grow several requests at once; interleave=False grows them one after the other.
    # Both must give identical buffers, whatever stale contents the buffers held.
    ix = HistoryIndex()
    rng = np.random.default_rng(5)
    _add_siblings(ix, rng, groups=4, length=40, vocab=50)
    rids = np.arange(100, 121)
    for r in rids:
        g = int(r) % 4
        ix.begin_request(int(r), g, [g + 1, 99])
        ix.extend_request(int(r), rng.integers(1, 50, int(r) % 7).tolist())
    d = 8
    out = []
    for interleave in (True, False):
        tokens = np.full(len(rids) * d, -1, np.int64)
        mask = np.full(len(rids) * d * d, 3, np.uint8)
        probs = np.full(len(rids) * d, -1, np.float32)
        res = ix.draft_batch(rids, d, tokens, mask, probs, interleave=interleave)
        out.append((res, tokens, mask, probs))
    assert out[0][0] == out[1][0] and out[0][0][1] > 0
    for a, b in zip(out[0][1:], out[1][1:]):
        assert np.array_equal(a, b)
    assert set(np.unique(out[0][2]).tolist()) <= {0, 1}


def test_draft_chain_batch():
    ix = make_index()
    ix.begin_request(1, None, [1, 2, 3])
    ix.extend_request(1, [4])
    tokens = np.zeros(4, np.int64)
    lens = np.zeros(1, np.int64)
    assert ix.draft_chain_batch([1], 4, tokens, lens) == (1, 4)
    assert tokens.tolist() == [5, 6, 7, 8] and lens.tolist() == [4]


def test_buffer_errors_are_clear():
    ix = make_index()
    ix.begin_request(1, None, [1, 2, 3])
    with pytest.raises(ValueError, match="tokens"):
        ix.draft_batch([1], 4, np.zeros(3, np.int64), np.zeros(16, np.int64))
    with pytest.raises(ValueError, match="mask"):
        ix.draft_batch([1], 4, np.zeros(4, np.int64), np.zeros(15, np.int64))
    with pytest.raises(TypeError, match="int64"):
        ix.draft_batch([1], 4, np.zeros(4, np.int32), np.zeros(16, np.int64))
    with pytest.raises(TypeError, match="mask"):
        ix.draft_batch([1], 4, np.zeros(4, np.int64), np.zeros(16, np.float64))
    with pytest.raises(ValueError, match="at least 1"):
        ix.draft_batch([1], 0, np.zeros(0, np.int64), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="contiguous"):
        ix.draft_batch([1], 4, np.zeros(8, np.int64)[::2], np.zeros(16, np.int64))
    ro = np.zeros(4, np.int64)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        ix.draft_batch([1], 4, ro, np.zeros(16, np.int64))
    tokens = np.full(4, 42, np.int64)
    with pytest.raises(hs.UnknownRequestError):
        ix.draft_batch([1, 99], 2, tokens, np.zeros(8, np.int64))
    assert tokens.tolist() == [42] * 4, "nothing is written when a request id is unknown"


def test_bad_tokens_and_ids():
    ix = HistoryIndex(vocab_size=100)
    with pytest.raises(hs.InvalidTokenError, match="out of range"):
        ix.begin_request(1, None, [1, 100])
    with pytest.raises(ValueError):
        ix.begin_request(1, None, [-3])
    with pytest.raises(hs.InvalidTokenError):
        ix.begin_request(1, None, [2**40])
    with pytest.raises(ValueError, match="at least one token"):
        ix.begin_request(1, None, [])
    with pytest.raises(ValueError, match=">= 0"):
        ix.begin_request(-1, None, [1])
    with pytest.raises(TypeError):
        ix.begin_request(1, None, ["a"])
    ix.begin_request(1, None, [1])
    with pytest.raises(hs.DuplicateRequestError):
        ix.begin_request(1, None, [1])
    with pytest.raises(KeyError):
        ix.extend_request(2, [1])
    with pytest.raises(hs.UnknownRequestError):
        ix.finish_request(2)
    with pytest.raises(ValueError, match="version_decay"):
        HistoryIndex(version_decay=1.5)
    with pytest.raises(ValueError, match="min_match"):
        HistoryIndex(min_match=0)
    assert isinstance(hs.UnknownRequestError("x"), hs.HistospecError)


def test_draft_knobs_cross_the_binding_by_name():
    knobs = HistoryIndex.draft_knobs()
    defaults = HistoryIndex().draft_config()
    assert list(defaults) == knobs
    assert {"min_match", "recency", "follow", "max_children"} <= set(knobs)
    # Every knob set at construction is read back; set_draft_config changes only what it names.
    changed = {k: (v + 1 if isinstance(v, int) else v / 2) for k, v in defaults.items()}
    ix = HistoryIndex(**changed)
    assert ix.draft_config() == pytest.approx(changed)
    assert all(isinstance(v, int) for k, v in ix.draft_config().items() if isinstance(defaults[k], int))
    ix.set_draft_config(recency=0.0)
    assert ix.draft_config() == pytest.approx({**changed, "recency": 0.0})
    assert ix.config()["recency"] == 0.0
    # A typo, a removed knob, a wrong type or a value out of range is a ValueError naming it,
    # and a failed change leaves the policy as it was.
    for bad, match in [({"recencyy": 0.1}, "unknown draft knob"), ({"blend": 1}, "unknown draft knob"),
                       ({"min_match": 1.5}, "min_match must be an integer"), ({"recency": "x"}, "recency"),
                       ({"follow": True}, "follow"), ({"recency": 2.0}, "recency")]:
        with pytest.raises(ValueError, match=match):
            HistoryIndex(**bad)
        with pytest.raises(ValueError, match=match):
            ix.set_draft_config(**bad)
    assert ix.draft_config()["recency"] == 0.0


def test_extend_batch_validates_before_applying():
    ix = make_index()
    ix.begin_request(1, None, [1, 2, 3])
    ix.begin_request(2, None, [1, 2, 3])
    with pytest.raises(hs.UnknownRequestError):
        ix.extend_batch([1, 7], [4, 5, 6], [2, 1])
    with pytest.raises(ValueError):
        ix.extend_batch([1, 2], [4, 5, 6], [2, 2])
    assert ix.stats()["tokens"] == 15  # untouched
    ix.extend_batch(np.array([1, 2]), np.array([4, 5, 4], np.int32), np.array([2, 1]))
    assert ix.stats()["tokens"] == 18


def test_siblings_in_flight_draft_from_each_other():
    ix = HistoryIndex()
    ix.begin_request(1, 77, [1, 2])
    ix.begin_request(2, 77, [1, 2])
    ix.extend_request(1, [30, 31, 32, 33])
    ix.extend_request(2, [30])
    assert hs.draft(ix, 2, 4, chain=True).tokens.tolist() == [30, 31, 32, 33]


def _hub_draft(continuations: int, **config) -> tuple[HistoryIndex, tuple]:
    """Token 5 has `continuations` continuations in the history (10, 11, ...). The request copies
    30..37 of the second response, then writes 5 where the source has 38: its longest match is
    just "5", and its source pointer predicts 39 (5 replaced 38). Returns the index and a 6-node
    draft."""
    ix = HistoryIndex(**config)
    ix.add_response(9, [1], [x for t in range(10, 10 + continuations) for x in (5, t)], 0)
    ix.add_response(9, [1], list(range(30, 50)), 0)
    ix.begin_request(1, 9, [1])
    ix.extend_request(1, [*range(30, 38), 5])
    return ix, ix.draft(1, 6)


def _root_kids(draft: tuple) -> set[int]:
    tokens, parents, _ = draft
    return {t for t, p in zip(tokens, parents) if p == 0}


SOURCE_PATH = ([5, 39, 40, 41, 42, 43], [-1, 0, 1, 2, 3, 4])


def test_hub_root_defers_to_a_trusted_source():
    # 16 continuations make "5" a hub. With hub_follow at its default, the root drafts only the
    # source's path; with hub_follow=1 it also offers the hub's continuations.
    _, deferred = _hub_draft(16, hub_follow=0.1)
    _, spread = _hub_draft(16, hub_follow=1.0)
    assert deferred[:2] == SOURCE_PATH
    assert 39 in _root_kids(spread) and len(_root_kids(spread) & set(range(10, 26))) >= 3
    assert HistoryIndex().draft_config()["hub_follow"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="hub_follow"):
        HistoryIndex(hub_follow=1.5)


def test_hub_follow_degree_sets_which_roots_defer():
    # 4 continuations: not a hub by default, one with hub_follow_degree=4.
    ix16, spread = _hub_draft(4)
    ix4, deferred = _hub_draft(4, hub_follow_degree=4)
    assert deferred[:2] == SOURCE_PATH
    assert 39 in _root_kids(spread) and len(_root_kids(spread) & set(range(10, 14))) >= 2
    assert ix16.draft_config()["hub_follow_degree"] == 16
    assert ix4.draft_config()["hub_follow_degree"] == 4
    ix4.set_draft_config(hub_follow_degree=16)
    assert ix4.draft_config()["hub_follow_degree"] == 16
    with pytest.raises(ValueError, match="hub_follow_degree"):
        HistoryIndex(hub_follow_degree=1)


def test_self_repetition_counts():
    ix = HistoryIndex()
    ix.begin_request(1, None, [1])
    ix.extend_request(1, [50, 51, 52, 53, 50, 51])
    assert hs.draft(ix, 1, 3, chain=True).tokens.tolist() == [51, 52, 53]


def test_finish_keep_and_drop():
    ix = HistoryIndex()
    ix.begin_request(1, 5, [1])
    ix.extend_request(1, [2, 3])
    ix.finish_request(1, keep=True)
    ix.begin_request(2, 5, [1])
    ix.extend_request(2, [7, 8])
    ix.finish_request(2, keep=False)
    assert [r[1] for r in ix.responses(5)] == [[2, 3]]
    ix.begin_request(3, 5, [1])
    assert hs.draft(ix, 3, 3, chain=True).tokens.tolist() == [1, 2, 3]


def test_deferred_removal_waits_till_the_group_is_idle():
    # With a draft server every request finishes unkept; removing one from the automaton means
    # rebuilding its group, so engines defer that until no sibling is in flight.
    ix = HistoryIndex()
    ix.add_response(5, [1], list(range(10, 60)), 0)
    for rid in range(4):
        ix.begin_request(rid, 5, [1])
    ix.extend_request(0, [2, 3, 4, 5])
    ix.finish_request(0, keep=False, defer_removal=True)
    assert ix.stats()["rebuilds"] == 0 and ix.stats()["responses"] == 1
    # A sibling in flight still drafts from it...
    ix.extend_request(1, [2])
    assert hs.draft(ix, 1, 4, chain=True).tokens.tolist() == [2, 3, 4, 5]
    ix.finish_request(1, keep=True)
    ix.finish_request(2, keep=False, defer_removal=True)
    assert ix.stats()["rebuilds"] == 0
    # ... and once the last one is done, the group holds exactly its history.
    ix.finish_request(3, keep=False, defer_removal=True)
    assert ix.stats()["rebuilds"] == 1
    fresh = HistoryIndex()
    fresh.load_bytes(ix.to_bytes())
    assert {k: ix.stats()[k] for k in ("states", "edges", "tokens")} == {
        k: fresh.stats()[k] for k in ("states", "edges", "tokens")
    }
    ix.begin_request(9, 5, [1])
    ix.extend_request(9, [2, 3])
    assert hs.draft(ix, 9, 4, chain=True).tokens.tolist() == [3]
    # Deferred tokens that outweigh the rest are dropped at once, siblings in flight or not.
    ix.extend_request(9, list(range(100, 400)))
    ix.begin_request(10, 5, [1])
    ix.finish_request(9, keep=False, defer_removal=True)
    assert ix.stats()["rebuilds"] == 2
    # Without deferral an unkept request leaves at once (evaluation and replay rely on it).
    ix.begin_request(11, 5, [1])
    ix.extend_request(11, [2, 3, 4, 5])
    ix.finish_request(11, keep=False)
    assert ix.stats()["rebuilds"] == 3
    ix.extend_request(10, [2])
    assert hs.draft(ix, 10, 4, chain=True).tokens.tolist() == [2]


def test_retention_and_versions():
    ix = HistoryIndex(max_versions=2)
    for v in range(4):
        ix.add_response(9, [1], [v + 10, v + 20], v)
    assert [r[2] for r in ix.responses(9)] == [2, 3]
    ix = HistoryIndex(max_responses=1)
    ix.add_response(9, [1], [10], 0)
    ix.add_response(9, [1], [11], 1)
    assert [r[1] for r in ix.responses(9)] == [[11]]


def test_version_decay_prefers_newer_epochs():
    ix = HistoryIndex(version_decay=0.25)
    for _ in range(2):
        ix.add_response(1, [5], [6, 7], 0)  # old policy: 6 -> 7, twice
    ix.add_response(1, [5], [6, 8], 1)  # new policy: 6 -> 8, once
    ix.begin_request(1, 1, [5], version=1)
    ix.extend_request(1, [6])
    assert hs.draft(ix, 1, 2, chain=True).tokens.tolist() == [6, 8]
    flat = HistoryIndex()
    for _ in range(2):
        flat.add_response(1, [5], [6, 7], 0)
    flat.add_response(1, [5], [6, 8], 1)
    flat.begin_request(1, 1, [5])
    flat.extend_request(1, [6])
    assert hs.draft(flat, 1, 2, chain=True).tokens.tolist() == [6, 7]


def test_snapshot_roundtrip_bytes_and_file(tmp_path):
    ix = make_index(max_responses=8)
    ix.version = 3
    data = ix.to_bytes()
    other = HistoryIndex(threads=3)
    other.load_bytes(data)
    assert other.stats()["tokens"] == ix.stats()["tokens"] and other.version == 3
    assert other.threads == 3, "a load replaces the history, not the thread count"
    assert other.responses(hs.prompt_key([1, 2, 3])) == ix.responses(hs.prompt_key([1, 2, 3]))
    path = tmp_path / "h.snap"
    ix.save(path)
    third = HistoryIndex(threads=2)
    third.load(str(path))
    assert third.to_bytes() == data and third.threads == 2
    corrupt = bytearray(data)
    corrupt[30] ^= 0xFF
    with pytest.raises(hs.SnapshotError, match="checksum"):
        third.load_bytes(bytes(corrupt))
    with pytest.raises(hs.SnapshotError, match="magic"):
        third.load_bytes(b"PK\x03\x04 not a snapshot at all")
    with pytest.raises(hs.SnapshotError, match="truncated|expected"):
        third.load_bytes(data[:-3])
    foreign = bytearray(data)
    foreign[8] = 99
    with pytest.raises(hs.SnapshotError, match="format version 99"):
        third.load_bytes(bytes(foreign))
    with pytest.raises(hs.SnapshotError, match="I/O"):
        third.load(tmp_path / "missing.snap")
    assert third.to_bytes() == data, "a failed load leaves the index unchanged"


def test_stats_and_repr():
    ix = make_index()
    s = ix.stats()
    assert s["groups"] == 1 and s["responses"] == 3 and s["tokens"] == 15 and s["prompt_tokens"] == 3
    assert s["states"] > 1 and s["edges"] > 0 and s["bytes"] > 0
    assert "groups=1" in repr(ix)
    assert ix.config()["max_children"] == 8


def _sibling_index(threads: int) -> tuple[HistoryIndex, np.ndarray]:
    """80 requests begun in 6 groups of sibling history, on an index with ``threads`` threads."""
    ix = HistoryIndex(threads=threads)
    _add_siblings(ix, np.random.default_rng(9), groups=6, length=80, vocab=60)
    rids = np.arange(200, 280)
    for r in rids:
        ix.begin_request(int(r), int(r) % 6, [int(r) % 6 + 1, 99])
    return ix, rids


def test_threaded_batch_calls_equal_one_thread():
    # 80 requests in 6 groups: batch calls split them across threads (drafts by contiguous parts,
    # appends by group). Drafts, chains, stats and the final history must equal one thread's.
    one, rids = _sibling_index(1)
    many, _ = _sibling_index(3)
    assert (one.threads, many.threads) == (1, 3)
    rng = np.random.default_rng(1)
    d, k = 8, 6
    for _ in range(5):
        batch = np.concatenate([rids, rng.choice(rids, 10)])  # some requests get two appends
        lens = rng.integers(0, 5, len(batch))
        toks = rng.integers(1, 60, int(lens.sum()))
        outs = []
        for ix in (one, many):
            ix.extend_batch(batch, toks, lens)
            tok = np.full(len(rids) * d, -1, np.int64)
            mask = np.full(len(rids) * d * d, 3, np.uint8)
            probs = np.full(len(rids) * d, -1, np.float32)
            counts = np.full(len(rids), -1, np.int64)
            res = ix.draft_batch(rids, d, tok, mask, probs, counts)
            ctok = np.full(len(rids) * k, -1, np.int64)
            clen = np.full(len(rids), -1, np.int64)
            cres = ix.draft_chain_batch(rids, k, ctok, clen)
            outs.append((res, cres, ix.stats(), tok, mask, probs, counts, ctok, clen))
        a, b = outs
        assert a[:3] == b[:3] and a[0][1] > 0
        for x, y in zip(a[3:], b[3:]):
            assert np.array_equal(x, y)
    for r in rids:
        one.finish_request(int(r))
        many.finish_request(int(r))
    assert one.to_bytes() == many.to_bytes()


def test_threads_setting():
    ix = HistoryIndex()
    assert ix.threads == 1
    ix.threads = 4
    assert ix.threads == 4
    for bad in (0, 65):
        with pytest.raises(ValueError, match="threads"):
            ix.threads = bad
        with pytest.raises(ValueError, match="threads"):
            HistoryIndex(threads=bad)
    assert ix.threads == 4


def test_threaded_index_drafts_from_several_python_threads():
    # Several Python threads drafting at once, each call split across the index's own threads.
    ix, rids = _sibling_index(2)
    ix.extend_batch(rids, np.full(len(rids), 5), np.ones(len(rids), np.int64))
    d = 8
    want = np.zeros(len(rids) * d, np.int64)
    ix.draft_batch(rids, d, want, np.zeros(len(rids) * d * d, np.uint8))
    errors: list[BaseException] = []

    def drafter():
        try:
            tok = np.zeros(len(rids) * d, np.int64)
            mask = np.zeros(len(rids) * d * d, np.uint8)
            for _ in range(100):
                ix.draft_batch(rids, d, tok, mask)
                assert np.array_equal(tok, want)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=drafter) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def test_threaded_index_keeps_working_after_fork():
    # A fork keeps only the forking thread: the child must not wait on the parent's pool threads.
    import multiprocessing as mp

    ix, rids = _sibling_index(2)
    d = 8
    want = np.zeros(len(rids) * d, np.int64)
    ix.draft_batch(rids, d, want, np.zeros(len(rids) * d * d, np.uint8))  # the pool exists now
    q = mp.get_context("fork").Queue()

    def child():
        tok = np.zeros(len(rids) * d, np.int64)
        ix.draft_batch(rids, d, tok, np.zeros(len(rids) * d * d, np.uint8))
        ix.extend_batch(rids, np.full(len(rids), 5), np.ones(len(rids), np.int64))
        q.put(tok.tolist())

    p = mp.get_context("fork").Process(target=child)
    p.start()
    p.join(timeout=60)
    if p.is_alive():
        p.kill()
        pytest.fail("a forked child hung in a threaded batch call")
    assert p.exitcode == 0 and q.get(timeout=5) == want.tolist()


def test_concurrent_drafts_and_updates_from_threads():
    ix = make_index()
    rids = list(range(100, 132))
    for r in rids:
        ix.begin_request(r, None, [1, 2, 3])
        ix.extend_request(r, [4])
    expected = hs.draft(ix, 100, 8).tokens.tolist()
    errors: list[BaseException] = []

    def drafter():
        try:
            tok = np.zeros(len(rids) * 8, np.int64)
            mask = np.zeros(len(rids) * 64, np.uint8)
            for _ in range(300):
                ix.draft_batch(rids, 8, tok, mask)
                assert tok[: len(expected)].tolist() == expected
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def writer():
        try:
            for i in range(300):
                ix.add_response(999, [7, 7], [i % 50, 1, 2], 0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=drafter) for _ in range(3)] + [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert ix.stats()["groups"] == 2


def test_group_keys_take_the_whole_u64_range():
    """prompt_key returns values up to 2**64-1; they (and signed 64-bit keys) are valid explicit groups."""
    idx = HistoryIndex()
    big = next(prompt_key([i]) for i in range(100) if prompt_key([i]) >= 2**63)
    assert idx.add_response(big, [1], [2, 3]) == big
    assert idx.add_response(-1, [1], [2, 3]) == 2**64 - 1
    idx.begin_request(1, big, [5])
    assert idx.request_group(1) == big
    with pytest.raises(ValueError, match="a group is an int in"):
        idx.add_response(2**64, [1], [2])


def test_one_group_rule_across_the_components():
    """group_key is the rule the index binding, the SGLang worker's custom_params and the trainer
    adapters key history by (written once, in Rust): a prompt's token ids, a key, or a name."""
    from histospec_sgl import group_key
    from histospec_sgl.engine.drafter import group_of

    prompt = [5, 6, 7]
    idx = HistoryIndex()
    assert group_key(prompt) == prompt_key(prompt) == idx.begin_request(1, None, prompt)
    assert group_key(prompt, 9) == group_key(group=9) == idx.add_response(9, prompt, [1]) == 9
    assert group_key(group=-2) == idx.add_response(-2, prompt, [1]) == 2**64 - 2 == group_of({"histospec_group": -2})
    named = group_key(group="prompt-17")
    assert named == idx.add_response("prompt-17", prompt, [1]) == group_of({"histospec_group": "prompt-17"})
    assert named != group_key(group="prompt-18") and 0 <= named < 2**64
    # A name is never a prompt's key by accident: the name whose UTF-8 bytes are the token bytes of [97].
    assert group_key(group="a\x00\x00\x00") != prompt_key([97])
    for bad in (True, 1.5, b"x", 2**64, -(2**63) - 1, [1]):
        with pytest.raises(ValueError, match=r"a group is an int in \[-2\*\*63, 2\*\*64\), a str"):
            group_key(prompt, bad)
        with pytest.raises(ValueError, match="histospec_group: a group is an int"):
            group_of({"histospec_group": bad})
    with pytest.raises(ValueError, match="needs prompt_ids or a group"):
        group_key()
