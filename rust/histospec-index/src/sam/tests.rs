//! Unit tests of the automaton.

use super::*;

fn build(strings: &[&[u32]]) -> (Sam, Vec<u32>) {
    let mut sam = Sam::new();
    let mut lasts = vec![];
    for s in strings {
        let mut last = 0;
        for &t in *s {
            last = sam.extend(last, t, 1.0);
        }
        lasts.push(last);
    }
    (sam, lasts)
}

#[test]
fn counts_occurrences_of_substrings() {
    let (sam, _) = build(&[&[1, 2, 1, 2, 3], &[2, 1, 2]]);
    let st = |s: &[u32]| sam.states[sam.walk(s).unwrap() as usize];
    assert_eq!(st(&[1, 2]).cnt, 3.0);
    assert_eq!(st(&[2]).cnt, 4.0);
    assert_eq!(st(&[1, 2, 3]).cnt, 1.0);
    assert_eq!(st(&[2, 1, 2]).cnt, 2.0);
    assert!(sam.walk(&[3, 1]).is_none());
}

#[test]
fn interleaved_appends_match_sequential_counts() {
    let a = [5u32, 6, 5, 6, 7, 5];
    let b = [6u32, 5, 6, 6, 5];
    let (seq, _) = build(&[&a, &b]);
    let mut inter = Sam::new();
    let (mut la, mut lb) = (0, 0);
    for i in 0..a.len().max(b.len()) {
        if i < b.len() {
            lb = inter.extend(lb, b[i], 1.0);
        }
        if i < a.len() {
            la = inter.extend(la, a[i], 1.0);
        }
    }
    for s in [&[5u32, 6][..], &[6, 5], &[6], &[5, 6, 7], &[6, 6, 5]] {
        let x = seq.states[seq.walk(s).unwrap() as usize].cnt;
        let y = inter.states[inter.walk(s).unwrap() as usize].cnt;
        assert_eq!(x, y, "{s:?}");
    }
}

/// Checks every state's children against lookups and edge ids; returns how many are hubs.
/// The arena's first `compacted` edges were laid out by a recount's compaction.
fn check_children(sam: &Sam, alphabet: &[u32], compacted: u32) -> usize {
    let mut hubs = 0;
    for s in 0..sam.num_states() as u32 {
        let kids: Vec<(u32, u32)> = sam.children(s).collect();
        // Exactly the transitions that lookups find, each token once.
        let mut expect: Vec<(u32, u32)> = alphabet
            .iter()
            .filter_map(|&t| sam.next_state(s, t).map(|to| (t, to)))
            .collect();
        let mut got = kids.clone();
        got.sort_unstable();
        expect.sort_unstable();
        assert_eq!(got, expect, "state {s}");
        assert_eq!(kids.len() as u32, sam.degree(s));
        // Most recently created first, as the references say: the arena ids descending, then
        // the state's own (first) edge; edges a compaction laid out come after the newer ones,
        // on consecutive ids in enumeration order.
        let refs: Vec<u32> = sam.edge_refs(s).collect();
        let (inline, arena) = refs
            .split_last()
            .map_or((None, &refs[..]), |(l, a)| (Some(l), a));
        let newer = arena.iter().take_while(|&&r| r >= compacted).count();
        let (newer, laid) = arena.split_at(newer);
        assert!(newer.windows(2).all(|w| w[0] > w[1]), "state {s}");
        assert!(laid.windows(2).all(|w| w[1] == w[0] + 1), "state {s}");
        assert!(arena.iter().all(|&r| r & INLINE == 0), "state {s}");
        if let Some(&r) = inline {
            assert_eq!(r, INLINE | s, "state {s}");
        }
        let by_ref: Vec<(u32, u32)> = refs.iter().map(|&r| sam.edge(r)).collect();
        assert_eq!(kids, by_ref, "state {s}");
        hubs += usize::from(sam.states[s as usize].is_hub());
    }
    // The running byte count matches the lists.
    let held: usize = sam
        .hubs
        .iter()
        .map(|h| h.capacity() * 4 + std::mem::size_of::<Vec<u32>>())
        .sum();
    assert_eq!(sam.hub_bytes, held);
    hubs
}

#[test]
fn hub_lists_enumerate_like_the_edge_lists() {
    // In the first string 7 always follows 5, so [5, 7] and [7] share a state with 40
    // children; the second string's [3, 7] splits it, and the clone copies all 40 (a hub built
    // by cloning); [3, 7] then gets 20 children of its own.
    let first: Vec<u32> = (100..140).flat_map(|t| [5, 7, t]).collect();
    let second: Vec<u32> = (140..160).flat_map(|t| [3, 7, t]).collect();
    let alphabet: Vec<u32> = (3..8).chain(100..160).collect();
    let (sam, _) = build(&[&first, &second]);
    // Online appends make hubs as states reach the degree: the root, [7], [5, 7], [3, 7].
    assert_eq!(check_children(&sam, &alphabet, 0), 4);
    assert_eq!(sam.degree(sam.walk(&[5, 7]).unwrap()), 40);
    assert_eq!(sam.degree(sam.walk(&[7]).unwrap()), 60);
    assert_eq!(sam.degree(sam.walk(&[3, 7]).unwrap()), 20);
    // Bulk appends leave them linked until the recount, and give the same automaton.
    let mut bulk = Sam::new();
    for s in [&first, &second] {
        let mut last = 0;
        for &t in s.iter() {
            last = bulk.extend_deferred(last, t, 1.0);
        }
    }
    assert_eq!(check_children(&bulk, &alphabet, 0), 0);
    bulk.recount();
    let compacted = bulk.edges.len() as u32;
    assert_eq!(check_children(&bulk, &alphabet, compacted), 4);
    for s in 0..sam.num_states() {
        assert_eq!(sam.states[s].cnt, bulk.states[s].cnt, "state {s}");
    }
    // Online appends after the recount go into the hub lists.
    let mut last = bulk.walk(&[3, 7]).unwrap();
    for t in [200, 3, 7, 201] {
        last = bulk.extend(last, t, 1.0);
    }
    assert_eq!(bulk.degree(bulk.walk(&[3, 7]).unwrap()), 22);
    assert_eq!(
        check_children(
            &bulk,
            &[alphabet.clone(), vec![200, 201]].concat(),
            compacted
        ),
        4
    );
}

#[test]
fn many_children_survive_table_growth() {
    let mut sam = Sam::new();
    let mut last = 0;
    for t in 0..5000u32 {
        last = sam.extend(last, t % 1000, 1.0);
    }
    assert_eq!(sam.children(0).count(), 1000);
    for t in 0..1000u32 {
        assert!(sam.next_state(0, t).is_some());
    }
}
