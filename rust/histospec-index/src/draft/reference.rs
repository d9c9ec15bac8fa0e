//! The draft policy written as plainly as possible: every child of every state enumerated, a
//! standard priority queue, one request at a time, no prefetching, no fast paths, no interleaving.
//! The property tests below check that the drafter (one request, batches, threads, chains and
//! trees) drafts exactly what this does, probabilities included.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::{DraftConfig, Node};
use crate::follow::Log;
use crate::sam::{Sam, NONE};

/// What the reference reads for one request.
pub(crate) struct Input<'a> {
    pub sam: &'a Sam,
    /// The automaton state of the request's whole context.
    pub last: u32,
    /// The last context token.
    pub root_tok: u32,
    /// The source pointer: its log, the clock it predicts next (`NONE`: none), the weight of that
    /// prediction and of each later one along its path; `None` when following is off.
    pub pointer: Option<(&'a Log, u32, f32, f32)>,
    /// Weight of one occurrence of the group's newest version.
    pub w_new: f32,
}

struct Cand {
    score: f32,
    seq: u32,
    parent: usize,
    tok: u32,
    state: u32,
    clock: u32,
}

impl Ord for Cand {
    fn cmp(&self, o: &Self) -> Ordering {
        // Highest score first; among equal scores, the earliest pushed.
        self.score.total_cmp(&o.score).then(o.seq.cmp(&self.seq))
    }
}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Cand {}

/// A continuation: token, automaton state (`NONE`: the pointer's only), estimate, pointer clock.
struct Kid {
    tok: u32,
    to: u32,
    p: f32,
    clock: u32,
}

/// The first state on the suffix-link path of `s` (itself included) that has children and
/// represents a suffix of at least `min_len` tokens.
fn longest_with_children(sam: &Sam, mut s: u32, min_len: u32) -> u32 {
    while s != NONE {
        let st = &sam.states[s as usize];
        if st.len < min_len {
            return NONE;
        }
        if sam.children(s).next().is_some() {
            return s;
        }
        s = st.link;
    }
    NONE
}

/// The children of `s` with their estimates (module docs of [`crate::draft`], step 2).
fn estimates(sam: &Sam, s: u32, w_new: f32, cfg: &DraftConfig) -> Vec<Kid> {
    let children: Vec<(u32, u32)> = sam.children(s).collect();
    let mut total = 0.0f32;
    for &(_, to) in &children {
        total += sam.states[to as usize].cnt;
    }
    if children.is_empty() || total <= 0.0 {
        return vec![];
    }
    let len = sam.states[s as usize].len.max(1) as f32;
    let denom = total + (cfg.escape + cfg.escape_short / len) * w_new;
    let a = cfg.recency;
    let mut kids: Vec<(Kid, f32, u32)> = children
        .iter()
        .map(|&(tok, to)| {
            let st = &sam.states[to as usize];
            let p = (1.0 - a) * st.cnt / denom;
            (
                Kid {
                    tok,
                    to,
                    p,
                    clock: NONE,
                },
                st.cnt,
                st.recent,
            )
        })
        .collect();
    if a > 0.0 {
        // The r-th most recent continuation gets a·conf·(1-β)·β^r, while that is not negligible.
        kids.sort_by(|x, y| {
            y.2.cmp(&x.2)
                .then(y.1.total_cmp(&x.1))
                .then(x.0.tok.cmp(&y.0.tok))
        });
        let b = cfg.recency_decay;
        let mut r = a * (total / denom) * (1.0 - b);
        for (i, k) in kids.iter_mut().enumerate() {
            if i > 0 && r < super::estimate::RECENCY_NEGLIGIBLE {
                break;
            }
            k.0.p += r;
            r *= b;
        }
    }
    kids.into_iter().map(|k| k.0).collect()
}

/// Drafts at most `budget` nodes (root included) for `input`: a chain when `chain`, else a tree,
/// in BFS order.
pub(crate) fn draft(input: &Input, budget: usize, chain: bool, cfg: &DraftConfig) -> Vec<Node> {
    let sam = input.sam;
    let per_node = if chain { 1 } else { cfg.max_children as usize };
    let mut anchor = longest_with_children(sam, input.last, cfg.min_match);
    if let Some((_, pred, weight, _)) = input.pointer {
        let hub = anchor != NONE && sam.children(anchor).count() as u32 >= cfg.hub_follow_degree;
        if hub && cfg.hub_follow < 1.0 && pred != NONE && weight >= cfg.hub_follow {
            anchor = NONE;
        }
    }
    // Growth order, with each node's depth.
    let mut nodes = vec![(
        Node {
            tok: input.root_tok,
            parent: NONE,
            prob: 1.0,
        },
        0u32,
    )];
    let mut heap = BinaryHeap::new();
    let mut seq = 0;
    // Offers the children of node `parent` (probability `pprob`), from automaton state `state`
    // and the pointer's prediction `ptr` (clock, weight).
    let mut offer = |heap: &mut BinaryHeap<Cand>,
                     parent: usize,
                     pprob: f32,
                     state: u32,
                     ptr: Option<(u32, f32)>| {
        let mut kids = if state == NONE {
            vec![]
        } else {
            estimates(sam, state, input.w_new, cfg)
        };
        if let (Some((clock, lam)), Some((log, ..))) = (ptr, input.pointer) {
            if let Some(e) = log.get(clock) {
                for k in kids.iter_mut() {
                    k.p *= 1.0 - lam;
                }
                match kids.iter_mut().find(|k| k.tok == e.tok) {
                    Some(k) => {
                        k.p = (k.p + lam).min(1.0);
                        k.clock = clock;
                    }
                    None => kids.push(Kid {
                        tok: e.tok,
                        to: NONE,
                        p: lam,
                        clock,
                    }),
                }
            }
        }
        kids.sort_by(|x, y| y.p.total_cmp(&x.p).then(x.tok.cmp(&y.tok)));
        for k in kids.into_iter().take(per_node) {
            let score = pprob * k.p;
            if score < cfg.min_prob {
                break;
            }
            heap.push(Cand {
                score,
                seq,
                parent,
                tok: k.tok,
                state: k.to,
                clock: k.clock,
            });
            seq += 1;
        }
    };
    let root_ptr = match input.pointer {
        Some((_, pred, weight, _)) if pred != NONE => Some((pred, weight)),
        _ => None,
    };
    offer(&mut heap, 0, 1.0, anchor, root_ptr);
    while nodes.len() < budget {
        let Some(c) = heap.pop() else { break };
        if c.score < cfg.min_prob || c.score <= 0.0 {
            break;
        }
        let depth = nodes[c.parent].1 + 1;
        nodes.push((
            Node {
                tok: c.tok,
                parent: c.parent as u32,
                prob: c.score,
            },
            depth,
        ));
        // The node's state, or when it has no continuation the longest suffix that has one.
        let state = match c.state {
            NONE => NONE,
            s if sam.children(s).next().is_some() => s,
            s => longest_with_children(sam, sam.states[s as usize].link, cfg.min_match),
        };
        let ptr = match input.pointer {
            Some((log, _, _, then)) if c.clock != NONE => {
                let next = log.next(c.clock);
                (next != NONE).then_some((next, then))
            }
            _ => None,
        };
        offer(&mut heap, nodes.len() - 1, c.score, state, ptr);
    }
    // BFS order: a stable sort by depth, parents renumbered.
    let mut order: Vec<usize> = (0..nodes.len()).collect();
    order.sort_by_key(|&i| nodes[i].1);
    let mut new_pos = vec![0u32; nodes.len()];
    for (new, &old) in order.iter().enumerate() {
        new_pos[old] = new as u32;
    }
    order
        .iter()
        .map(|&old| {
            let mut n = nodes[old].0;
            if n.parent != NONE {
                n.parent = new_pos[n.parent as usize];
            }
            n
        })
        .collect()
}

#[cfg(test)]
mod props {
    use proptest::prelude::*;

    use super::*;
    use crate::draft::{write_chain, write_tree, Drafter};
    use crate::store::{HistoryIndex, IndexConfig};

    fn i32s(v: &[u32]) -> Vec<i32> {
        v.iter().map(|&t| t as i32).collect()
    }

    prop_compose! {
        fn draft_configs()(
            min_match in 1u32..3,
            min_prob in prop::sample::select(vec![0.0f32, 0.05, 0.3]),
            escape in prop::sample::select(vec![0.0f32, 1.0, 3.0]),
            escape_short in prop::sample::select(vec![0.0f32, 2.0]),
            recency in prop::sample::select(vec![0.0f32, 0.3, 1.0]),
            recency_decay in prop::sample::select(vec![0.0f32, 0.5, 0.999]),
            max_children in 1u32..5,
            follow in prop::sample::select(vec![0.0f32, 0.5, 0.9]),
            follow_resync in prop::sample::select(vec![0.0f32, 0.1]),
            hub_follow in prop::sample::select(vec![0.0f32, 0.1, 1.0]),
            hub_follow_degree in 2u32..5,
        ) -> DraftConfig {
            DraftConfig {
                min_match, min_prob, escape, escape_short, recency, recency_decay, max_children,
                follow, follow_resync, hub_follow, hub_follow_degree,
            }
        }
    }

    /// One group: its prompt, earlier responses and in-flight requests' generated tokens.
    type Group = (Vec<u32>, Vec<Vec<u32>>, Vec<Vec<u32>>);

    /// An index over random histories of a few groups (several versions, decayed or not), with
    /// in-flight requests that generated random tokens (so their pointers learned something).
    fn build(cfg: &DraftConfig, decay: f32, groups: &[Group]) -> (HistoryIndex, Vec<u64>) {
        let icfg = IndexConfig {
            version_decay: decay,
            draft: cfg.clone(),
            ..Default::default()
        };
        let mut ix = HistoryIndex::new(icfg).unwrap();
        let mut rids = vec![];
        for (g, (prompt, history, gens)) in groups.iter().enumerate() {
            for (v, h) in history.iter().enumerate() {
                ix.add_response(g as u64, &i32s(prompt), &i32s(h), v as u64 / 2)
                    .unwrap();
            }
            for gen in gens {
                let rid = rids.len() as u64;
                ix.begin_request(rid, g as u64, &i32s(prompt), None)
                    .unwrap();
                // Sibling appends interleave token by token, as in a decode batch.
                rids.push(rid);
                for chunk in gen.chunks(3) {
                    ix.extend_request(rid, &i32s(chunk)).unwrap();
                }
            }
        }
        (ix, rids)
    }

    fn groups() -> impl Strategy<Value = Vec<Group>> {
        prop::collection::vec(
            (
                prop::collection::vec(0u32..5, 1..5),
                prop::collection::vec(prop::collection::vec(0u32..5, 0..40), 0..6),
                prop::collection::vec(prop::collection::vec(0u32..5, 0..25), 1..4),
            ),
            1..4,
        )
    }

    fn reference(ix: &HistoryIndex, rid: u64, budget: usize, chain: bool) -> Vec<Node> {
        let input = ix.reference_input(rid).unwrap();
        draft(&input, budget, chain, &ix.config().draft)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// One request at a time: trees and chains equal the reference's, probabilities included.
        #[test]
        fn drafts_equal_the_reference(
            cfg in draft_configs(),
            decay in prop::sample::select(vec![1.0f32, 0.5]),
            groups in groups(),
            budget in 1usize..24,
        ) {
            let (ix, rids) = build(&cfg, decay, &groups);
            let mut dr = Drafter::default();
            for &rid in &rids {
                for chain in [false, true] {
                    let ours = ix.draft_nodes(rid, budget, chain, &mut dr).unwrap();
                    prop_assert_eq!(ours, reference(&ix, rid, budget, chain), "rid {} chain {}", rid, chain);
                }
            }
        }

        /// A node is never more probable than its parent (equal at most, rounding included), so
        /// that the nodes most probable first form a subtree: a narrower verify width keeps each
        /// node's parent.
        #[test]
        fn no_node_is_more_probable_than_its_parent(
            cfg in draft_configs(),
            decay in prop::sample::select(vec![1.0f32, 0.5]),
            groups in groups(),
            d in 2usize..24,
        ) {
            let (ix, rids) = build(&cfg, decay, &groups);
            let mut dr = Drafter::default();
            let bs = rids.len();
            let (mut toks, mut mask, mut probs) = (vec![0i64; bs * d], vec![0u8; bs * d * d], vec![0f32; bs * d]);
            ix.draft_tree_batch(&rids, d, &mut toks, &mut mask, Some(&mut probs), None, &mut dr).unwrap();
            for b in 0..bs {
                let m = &mask[b * d * d..(b + 1) * d * d];
                let p = &probs[b * d..(b + 1) * d];
                for i in 1..d {
                    // The parent: the deepest ancestor (most ancestors of its own) in row i.
                    let parent = (0..i).filter(|&j| m[i * d + j] == 1)
                        .max_by_key(|&j| (0..d).filter(|&k| m[j * d + k] == 1).count()).unwrap();
                    let bound = if parent == 0 { 1.0 } else { p[parent] };
                    prop_assert!(p[i] <= bound, "request {} node {} ({}) above its parent {} ({})", b, i, p[i], parent, bound);
                }
            }
        }

        /// Batch calls (interleaved, split across threads, a request listed several times) fill
        /// the buffers the reference's drafts give.
        #[test]
        fn batches_equal_the_reference(
            cfg in draft_configs(),
            groups in groups(),
            d in 1usize..12,
            threads in 1usize..4,
            repeat in prop::sample::select(vec![1usize, 12]),
        ) {
            let (mut ix, rids) = build(&cfg, 1.0, &groups);
            ix.set_threads(threads).unwrap();
            // Repeated, a batch of 12+ copies reaches the size at which batches are split.
            let batch: Vec<u64> = (0..repeat).flat_map(|_| rids.iter().copied()).collect();
            let bs = batch.len();
            let mut dr = Drafter::default();
            let (mut toks, mut mask, mut probs) = (vec![0i64; bs * d], vec![0u8; bs * d * d], vec![0f32; bs * d]);
            ix.draft_tree_batch(&batch, d, &mut toks, &mut mask, Some(&mut probs), None, &mut dr).unwrap();
            let (mut ctoks, mut lens, mut cprobs) = (vec![0i64; bs * d], vec![0i64; bs], vec![0f32; bs * d]);
            ix.draft_chain_batch(&batch, d, &mut ctoks, &mut lens, Some(&mut cprobs), &mut dr).unwrap();
            for (i, &rid) in batch.iter().enumerate() {
                let (mut t, mut m, mut p) = (vec![0i64; d], vec![0u8; d * d], vec![0f32; d]);
                write_tree(&reference(&ix, rid, d, false), d, &mut t, &mut m, Some(&mut p));
                prop_assert_eq!(&toks[i * d..(i + 1) * d], &t[..]);
                prop_assert_eq!(&mask[i * d * d..(i + 1) * d * d], &m[..]);
                prop_assert_eq!(&probs[i * d..(i + 1) * d], &p[..]);
                let (mut t, mut p) = (vec![0i64; d], vec![0f32; d]);
                let n = write_chain(&reference(&ix, rid, d + 1, true), &mut t, Some(&mut p));
                prop_assert_eq!(lens[i], n as i64);
                prop_assert_eq!(&ctoks[i * d..(i + 1) * d], &t[..]);
                prop_assert_eq!(&cprobs[i * d..(i + 1) * d], &p[..]);
            }
        }
    }
}
