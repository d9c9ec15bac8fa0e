//! Unit tests of the drafter's parts.

use super::frontier::{Cand, Frontier};
use super::grow::Growth;
use super::*;
use crate::sam::{Sam, NONE};

/// Grows the draft of `anchor` (no pointer, newest weight 1).
pub(super) fn grow(
    sam: &Sam,
    root_tok: u32,
    anchor: u32,
    budget: usize,
    chain: bool,
    cfg: &DraftConfig,
) -> Vec<Node> {
    let job = Job {
        sam,
        root_tok,
        anchor,
        pointer: None,
        budget,
        chain,
        w_new: 1.0,
    };
    Drafter::default().grow_job(&job, cfg).to_vec()
}

fn sam_of(strings: &[&[u32]]) -> (Sam, Vec<u32>) {
    let mut sam = Sam::new();
    let mut lasts = vec![];
    for s in strings {
        let mut l = 0;
        for &t in *s {
            l = sam.extend(l, t, 1.0);
        }
        lasts.push(l);
    }
    (sam, lasts)
}

fn frequency_only() -> DraftConfig {
    DraftConfig {
        recency: 0.0,
        escape_short: 0.0,
        ..DraftConfig::default()
    }
}

#[test]
fn chain_follows_most_frequent_continuation() {
    let (sam, _) = sam_of(&[&[1, 2, 3, 4], &[1, 2, 3, 5], &[1, 2, 3, 4]]);
    let anchor = sam.walk(&[2, 3]);
    let nodes = grow(&sam, 3, anchor.unwrap(), 4, true, &frequency_only());
    assert_eq!(nodes.iter().map(|n| n.tok).collect::<Vec<_>>(), vec![3, 4]);
    assert!((nodes[1].prob - 2.0 / 4.0).abs() < 1e-6);
}

/// Rows are ancestor-or-self sets, pads included, on both sides of the 64-node bit-mask
/// path, for every mask element type.
#[test]
fn mask_rows_are_ancestor_sets_at_every_width() {
    fn check<M: MaskElem + PartialEq + std::fmt::Debug>(d: usize) {
        // A real tree of n nodes (node i's parent is i / 3, BFS order), the rest padding.
        let n = (d * 2 / 3).max(1);
        let nodes: Vec<Node> = (0..n)
            .map(|i| Node {
                tok: i as u32 + 1,
                parent: if i == 0 { NONE } else { (i / 3) as u32 },
                prob: 1.0,
            })
            .collect();
        let parent = |i: usize| match i {
            0 => None,
            i if i < n => Some(i / 3),
            i => Some(i - 1),
        };
        let mut toks = vec![-1i64; d];
        // Garbage first: every entry must be written.
        let mut mask = vec![M::ONE; d * d];
        assert_eq!(write_tree(&nodes, d, &mut toks, &mut mask, None), n);
        for i in 0..d {
            let mut want = vec![M::ZERO; d];
            let mut a = Some(i);
            while let Some(j) = a {
                want[j] = M::ONE;
                a = parent(j);
            }
            assert_eq!(&mask[i * d..(i + 1) * d], &want[..], "d={d} row {i}");
            assert_eq!(toks[i], if i < n { i as i64 + 1 } else { 0 });
        }
    }
    for d in [1, 2, 16, 63, 64, 65, 100] {
        check::<i64>(d);
        check::<i32>(d);
        check::<u8>(d);
        check::<bool>(d);
    }
}

/// A xorshift64 generator: each call gives a number below its argument (seeded, so the
/// tests are repeatable).
fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % m
    }
}

#[test]
fn frontier_pops_like_std_binary_heap() {
    let mut rnd = xorshift(0x9e37_79b9_7f4a_7c15);
    for _ in 0..200 {
        let mut ours = Frontier::default();
        let mut std_heap = std::collections::BinaryHeap::new();
        let mut seq = 0;
        for _ in 0..rnd(80) {
            if rnd(3) == 0 {
                let (a, b) = (ours.pop(), std_heap.pop());
                assert_eq!(
                    a.map(|c| (c.score, c.seq)),
                    b.map(|c: Cand| (c.score, c.seq))
                );
            } else {
                // Few distinct scores, so ties are ordered by sequence number.
                let c = Cand {
                    score: rnd(5) as f32 / 4.0,
                    seq,
                    parent: 0,
                    tok: seq,
                    state: NONE,
                    ptr: NONE,
                };
                seq += 1;
                ours.push(c);
                std_heap.push(c);
            }
            assert_eq!(ours.peek().map(|c| c.seq), std_heap.peek().map(|c| c.seq));
        }
        while let Some(b) = std_heap.pop() {
            assert_eq!(ours.pop().map(|c| c.seq), Some(b.seq));
        }
        assert!(ours.pop().is_none());
    }
}

#[test]
fn bfs_reorder_is_a_stable_sort_by_depth() {
    // Random trees in growth order (parents first), small (the stack path, sorted or not)
    // and large (the general path).
    let mut rnd = xorshift(0x2545_f491_4f6c_dd1d);
    for n in (1..=70).chain([100, 200]) {
        for _ in 0..20 {
            let mut g = Growth::default();
            g.nodes.push(Node {
                tok: 0,
                parent: NONE,
                prob: 1.0,
            });
            g.depth.push(0);
            for i in 1..n {
                // Mostly chains, sometimes a branch off an earlier node.
                let parent = if rnd(4) == 0 {
                    rnd(i as u64) as u32
                } else {
                    i as u32 - 1
                };
                g.nodes.push(Node {
                    tok: i as u32,
                    parent,
                    prob: 0.5,
                });
                g.depth.push(g.depth[parent as usize] + 1);
            }
            g.reorder_bfs();
            assert_eq!(g.out.len(), n);
            let depth_of = |tok: u32| g.depth[tok as usize];
            for (i, w) in g.out.windows(2).enumerate() {
                let (a, b) = (depth_of(w[0].tok), depth_of(w[1].tok));
                assert!(
                    a < b || (a == b && w[0].tok < w[1].tok),
                    "not stable by depth at {i}"
                );
            }
            for node in &g.out[1..] {
                let parent = &g.out[node.parent as usize];
                assert_eq!(parent.tok, g.nodes[node.tok as usize].parent);
            }
        }
    }
}

#[test]
fn tree_has_bfs_order_and_unique_siblings() {
    let (sam, _) = sam_of(&[&[1, 2, 3, 4], &[1, 2, 5, 6], &[1, 2, 7, 8]]);
    let anchor = sam.walk(&[1, 2]);
    let nodes = grow(&sam, 2, anchor.unwrap(), 8, false, &DraftConfig::default());
    assert_eq!(nodes.len(), 7);
    for (i, n) in nodes.iter().enumerate().skip(1) {
        assert!(n.parent < i as u32);
    }
    let mut toks = [0i64; 8];
    let mut mask = [0u8; 64];
    write_tree(&nodes, 8, &mut toks, &mut mask, None);
    // The pad (slot 7) hangs under slot 6 and inherits its ancestors.
    assert_eq!(toks[7], 0);
    assert_eq!(mask[7 * 8 + 6], 1);
    assert_eq!(mask[7 * 8], 1);
}
