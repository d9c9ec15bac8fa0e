//! Property tests: the index agrees with the brute-force oracle in `naive.rs` on small inputs.

mod naive;

use proptest::prelude::*;

use crate::draft::{write_tree, Drafter};
use crate::sam::Sam;
use crate::{DraftConfig, Finish, HistoryIndex, IndexConfig};

fn strings_strategy() -> impl Strategy<Value = Vec<Vec<u32>>> {
    // Small alphabets make repeats (and hence clones and long matches) frequent.
    prop::collection::vec(prop::collection::vec(0u32..4, 1..24), 1..6)
}

fn to_i32(v: &[u32]) -> Vec<i32> {
    v.iter().map(|&t| t as i32).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Occurrence counts are exact, whether strings are appended one by one, interleaved, or in
    /// bulk with a deferred recount.
    #[test]
    fn counts_match_oracle(strings in strings_strategy(), pats in prop::collection::vec(prop::collection::vec(0u32..4, 1..5), 1..12), bulk in any::<bool>()) {
        let mut sam = Sam::new();
        let mut lasts = vec![0u32; strings.len()];
        let longest = strings.iter().map(|s| s.len()).max().unwrap();
        for i in 0..longest {
            for (k, s) in strings.iter().enumerate() {
                if i < s.len() {
                    lasts[k] = if bulk { sam.extend_deferred(lasts[k], s[i], 1.0) } else { sam.extend(lasts[k], s[i], 1.0) };
                }
            }
        }
        if bulk { sam.recount(); }
        for p in &pats {
            let n = naive::occurrences(&strings, p);
            match sam.walk(p) {
                Some(st) => prop_assert_eq!(sam.states[st as usize].cnt as usize, n, "pattern {:?}", p),
                None => prop_assert_eq!(n, 0, "pattern {:?} missing", p),
            }
        }
        for (k, s) in strings.iter().enumerate() {
            prop_assert_eq!(sam.states[lasts[k] as usize].len as usize, s.len());
        }
    }

    /// Wide alphabets give states with many transitions (hub lists): counts stay exact and each
    /// state's children are exactly the tokens that follow its strings, whether the hubs were made
    /// by online appends or by a bulk load's recount, and after online appends into them.
    #[test]
    fn wide_alphabets_counts_and_children(strings in prop::collection::vec(prop::collection::vec(0u32..40, 1..80), 1..6),
                                          extra in prop::collection::vec(0u32..40, 1..40),
                                          pats in prop::collection::vec(prop::collection::vec(0u32..40, 0..3), 1..24),
                                          bulk in any::<bool>()) {
        let mut sam = Sam::new();
        for s in &strings {
            let mut last = 0;
            for &t in s {
                last = if bulk { sam.extend_deferred(last, t, 1.0) } else { sam.extend(last, t, 1.0) };
            }
        }
        if bulk { sam.recount(); }
        let mut last = 0;
        for &t in &extra {
            last = sam.extend(last, t, 1.0);
        }
        let mut all = strings.clone();
        all.push(extra.clone());
        for p in &pats {
            let n = naive::occurrences(&all, p);
            let Some(st) = sam.walk(p) else {
                prop_assert_eq!(n, 0, "pattern {:?} missing", p);
                continue;
            };
            if !p.is_empty() {
                prop_assert_eq!(sam.states[st as usize].cnt as usize, n, "pattern {:?}", p);
            }
            let mut kids: Vec<u32> = sam.children(st).map(|(t, _)| t).collect();
            kids.sort_unstable();
            let expect: Vec<u32> = (0..40).filter(|&t| {
                let mut q = p.clone();
                q.push(t);
                naive::contains(&all, &q)
            }).collect();
            prop_assert_eq!(kids, expect, "children of {:?}", p);
        }
    }

    /// The anchor is the longest suffix of the context that occurs with a continuation (in the
    /// history or earlier in the context itself), and every draft edge occurs in the strings.
    #[test]
    fn drafts_follow_history(history in strings_strategy(), prompt in prop::collection::vec(0u32..4, 1..6),
                             gen in prop::collection::vec(0u32..4, 0..16), d in 1usize..20, min_match in 1u32..3,
                             follow in any::<bool>()) {
        let follow = if follow { 0.5 } else { 0.0 };
        let cfg = IndexConfig { draft: DraftConfig { min_match, follow, ..Default::default() }, ..Default::default() };
        let mut ix = HistoryIndex::new(cfg).unwrap();
        for h in &history {
            ix.add_response(7, &to_i32(&prompt), &to_i32(h), 0).unwrap();
        }
        ix.begin_request(1, 7, &to_i32(&prompt), None).unwrap();
        ix.extend_request(1, &to_i32(&gen)).unwrap();
        let ctx: Vec<u32> = prompt.iter().chain(&gen).copied().collect();
        let mut all: Vec<Vec<u32>> = history.iter().map(|h| prompt.iter().chain(h).copied().collect()).collect();
        all.push(ctx.clone());
        let nodes = ix.draft_nodes(1, d, false, &mut Drafter::default()).unwrap();
        prop_assert_eq!(nodes[0].tok, *ctx.last().unwrap());
        prop_assert!(nodes.len() <= d);
        let m = naive::longest_match(&all, &ctx, min_match as usize);
        // Without source following, drafts come from the automaton alone: nothing without a match,
        // every edge a bigram of the strings, every root child behind some suffix of the context.
        // A followed source may resume after a token that broke it (a root child need not follow
        // the root), but every deeper edge is still two consecutive tokens of some string.
        let automaton_only = follow == 0.0;
        if m.is_none() && automaton_only { prop_assert_eq!(nodes.len(), 1); }
        for (i, n) in nodes.iter().enumerate().skip(1) {
            prop_assert!((n.parent as usize) < i, "parent after child");
            let ptok = nodes[n.parent as usize].tok;
            if n.parent != 0 || automaton_only {
                prop_assert!(naive::has_bigram(&all, ptok, n.tok), "edge {}->{} not in history", ptok, n.tok);
            }
            if n.parent == 0 && automaton_only {
                // A root child continues some suffix of the context at least min_match long
                // (the longest match).
                let l = m.unwrap();
                let follows = (min_match as usize..=l).any(|k| {
                    let mut pat = ctx[ctx.len() - k..].to_vec();
                    pat.push(n.tok);
                    naive::contains(&all, &pat)
                });
                prop_assert!(follows, "first token {} follows no suffix of the context", n.tok);
            }
            prop_assert!(n.prob > 0.0 && n.prob <= nodes[n.parent as usize].prob + 1e-6);
        }
        // No two siblings share a token, also after padding, and the mask is ancestor-or-self.
        let mut toks = vec![0i64; d];
        let mut mask = vec![0u8; d * d];
        write_tree(&nodes, d, &mut toks, &mut mask, None);
        let mut parent = vec![usize::MAX; d];
        for i in 1..d {
            let row = &mask[i * d..(i + 1) * d];
            prop_assert_eq!(row[i], 1);
            prop_assert!(row[i + 1..].iter().all(|&x| x == 0));
            parent[i] = (0..i).rev().find(|&j| row[j] == 1).unwrap();
            let pr = &mask[parent[i] * d..parent[i] * d + d];
            for j in 0..i { prop_assert_eq!(row[j], pr[j]); }
        }
        for i in 1..d {
            for j in i + 1..d {
                prop_assert!(!(parent[i] == parent[j] && toks[i] == toks[j]), "duplicate siblings {} {}", i, j);
            }
        }
    }

    /// The same calls give the same drafts, and a snapshot round trip keeps history and drafts.
    #[test]
    fn deterministic_and_snapshot_roundtrip(history in strings_strategy(), prompt in prop::collection::vec(0u32..4, 1..6), gen in prop::collection::vec(0u32..4, 0..8)) {
        let build = || {
            let mut ix = HistoryIndex::new(IndexConfig::default()).unwrap();
            for (v, h) in history.iter().enumerate() {
                ix.add_response(3, &to_i32(&prompt), &to_i32(h), v as u64).unwrap();
            }
            ix
        };
        let draft = |ix: &mut HistoryIndex| {
            ix.begin_request(9, 3, &to_i32(&prompt), None).unwrap();
            ix.extend_request(9, &to_i32(&gen)).unwrap();
            let n = ix.draft_nodes(9, 12, false, &mut Drafter::default()).unwrap();
            ix.finish_request(9, false).unwrap();
            n
        };
        let mut a = build();
        let mut b = build();
        prop_assert_eq!(a.to_bytes(), b.to_bytes());
        let da = draft(&mut a);
        prop_assert_eq!(&da, &draft(&mut b));
        let mut c = HistoryIndex::from_bytes(&a.to_bytes(), IndexConfig::default()).unwrap();
        prop_assert_eq!(c.stats().tokens, a.stats().tokens);
        prop_assert_eq!(&draft(&mut c), &da);
        // A loaded snapshot saves to the same bytes: requests in flight are not history (neither
        // a group known only from one, 4, nor a prompt seen only in one, [7, 7] in 3, is saved),
        // and prompts are saved in the order loading the responses stores them (5's response
        // with prompt [7, 7] finished after one with [1] was added).
        a.begin_request(12, 5, &[7, 7], None).unwrap();
        a.add_response(5, &[1], &to_i32(&gen), 0).unwrap();
        a.finish_request(12, true).unwrap();
        a.begin_request(10, 4, &to_i32(&prompt), None).unwrap();
        a.begin_request(11, 3, &[7, 7], None).unwrap();
        let saved = a.to_bytes();
        let loaded = HistoryIndex::from_bytes(&saved, IndexConfig::default()).unwrap();
        prop_assert_eq!(&loaded.to_bytes(), &saved);
    }

    /// A batch call grows its requests interleaved (several at once, steps alternating); every
    /// request's tree and chain must still be exactly the one it gets drafted alone, for batch
    /// sizes below, at and above the number of lanes, across groups, with and without following.
    #[test]
    fn interleaved_batch_equals_one_by_one(
        history in strings_strategy(),
        prompts in prop::collection::vec(prop::collection::vec(0u32..4, 1..6), 1..4),
        gens in prop::collection::vec(prop::collection::vec(0u32..4, 0..10), 1..(3 * crate::draft::LANES)),
        follow in prop::sample::select(vec![0.0f32, 0.5]),
        d in 1usize..10,
    ) {
        let cfg = IndexConfig { draft: DraftConfig { follow, ..DraftConfig::default() }, ..Default::default() };
        let mut ix = HistoryIndex::new(cfg).unwrap();
        for (v, h) in history.iter().enumerate() {
            let g = (v % prompts.len()) as u64;
            ix.add_response(g, &to_i32(&prompts[g as usize]), &to_i32(h), v as u64).unwrap();
        }
        let rids: Vec<u64> = (0..gens.len() as u64).map(|i| 100 + i).collect();
        for (i, g) in gens.iter().enumerate() {
            let grp = (i % prompts.len()) as u64;
            ix.begin_request(rids[i], grp, &to_i32(&prompts[grp as usize]), None).unwrap();
            ix.extend_request(rids[i], &to_i32(g)).unwrap();
        }
        let bs = rids.len();
        let mut dr = Drafter::default();
        // Stale contents (a reused buffer) must be overwritten everywhere.
        let mut tok = vec![-7i64; bs * d];
        let mut mask = vec![7u8; bs * d * d];
        let mut probs = vec![-1f32; bs * d];
        ix.draft_tree_batch(&rids, d, &mut tok, &mut mask, Some(&mut probs), None, &mut dr).unwrap();
        let mut ctok = vec![0i64; bs * d];
        let mut clen = vec![0i64; bs];
        ix.draft_chain_batch(&rids, d, &mut ctok, &mut clen, None, &mut dr).unwrap();
        for (i, &rid) in rids.iter().enumerate() {
            let nodes = ix.draft_nodes(rid, d, false, &mut Drafter::default()).unwrap();
            let mut t1 = vec![0i64; d];
            let mut m1 = vec![0u8; d * d];
            let mut p1 = vec![0f32; d];
            write_tree(&nodes, d, &mut t1, &mut m1, Some(&mut p1));
            prop_assert_eq!(&tok[i * d..(i + 1) * d], &t1[..]);
            prop_assert_eq!(&mask[i * d * d..(i + 1) * d * d], &m1[..]);
            prop_assert_eq!(&probs[i * d..(i + 1) * d], &p1[..]);
            let chain = ix.draft_nodes(rid, d + 1, true, &mut Drafter::default()).unwrap();
            let n = chain.len() - 1;
            prop_assert_eq!(clen[i] as usize, n);
            let want: Vec<i64> = chain[1..].iter().map(|x| x.tok as i64).collect();
            prop_assert_eq!(&ctok[i * d..i * d + n], &want[..]);
        }
    }

    /// A chain grows on its own path (no frontier heap, one child computed directly where a
    /// state has one transition); it must be exactly the tree grown with one child per node,
    /// probabilities included, under every part of the draft policy.
    #[test]
    fn chain_is_the_one_child_tree(
        history in strings_strategy(),
        prompt in prop::collection::vec(0u32..4, 1..6),
        gens in prop::collection::vec(prop::collection::vec(0u32..4, 0..12), 1..6),
        follow in prop::sample::select(vec![0.0f32, 0.5]),
        recency in prop::sample::select(vec![0.0f32, 0.3]),
        min_prob in prop::sample::select(vec![0.0f32, 0.2]),
        hub_follow in prop::sample::select(vec![0.0f32, 1.0]),
        hub_follow_degree in prop::sample::select(vec![2u32, 16]),
        budget in 1usize..13,
    ) {
        let draft = DraftConfig { follow, recency, min_prob, hub_follow, hub_follow_degree, ..DraftConfig::default() };
        let cfg = IndexConfig { draft: draft.clone(), ..Default::default() };
        let mut ix = HistoryIndex::new(cfg).unwrap();
        for (v, h) in history.iter().enumerate() {
            ix.add_response(0, &to_i32(&prompt), &to_i32(h), v as u64).unwrap();
        }
        for (i, g) in gens.iter().enumerate() {
            ix.begin_request(i as u64, 0, &to_i32(&prompt), None).unwrap();
            ix.extend_request(i as u64, &to_i32(g)).unwrap();
        }
        let mut dr = Drafter::default();
        let chains: Vec<_> = (0..gens.len() as u64)
            .map(|r| ix.draft_nodes(r, budget, true, &mut dr).unwrap())
            .collect();
        ix.set_draft_config(DraftConfig { max_children: 1, ..draft }).unwrap();
        for (r, chain) in chains.iter().enumerate() {
            let tree = ix.draft_nodes(r as u64, budget, false, &mut dr).unwrap();
            prop_assert!(chain.len() <= budget);
            prop_assert_eq!(chain, &tree);
        }
    }

    /// Batch calls split across threads give exactly what one thread gives: the same drafts, and
    /// after parallel appends (requests of one group and a request listed twice included) the
    /// same automata, pointers, LRU order and snapshot.
    #[test]
    fn threaded_batches_equal_one_thread(
        history in strings_strategy(),
        prompts in prop::collection::vec(prop::collection::vec(0u32..4, 1..6), 1..5),
        n in (2 * crate::par::MIN_PER_THREAD)..(5 * crate::par::MIN_PER_THREAD),
        rounds in prop::collection::vec(prop::collection::vec((0usize..1000, 0u32..4, 0i64..4), 40..120), 1..4),
        follow in prop::sample::select(vec![0.0f32, 0.5]),
        threads in 2usize..5,
    ) {
        let rids: Vec<u64> = (0..n as u64).map(|i| 100 + i).collect();
        // Built alike (a clone would differ in buffer capacities, hence in measured bytes).
        let build = |threads: usize| {
            let cfg = IndexConfig { draft: DraftConfig { follow, ..DraftConfig::default() }, ..Default::default() };
            let mut ix = HistoryIndex::new(cfg).unwrap();
            ix.set_threads(threads).unwrap();
            for (v, h) in history.iter().enumerate() {
                let g = (v % prompts.len()) as u64;
                ix.add_response(g, &to_i32(&prompts[g as usize]), &to_i32(h), v as u64).unwrap();
            }
            for (i, &r) in rids.iter().enumerate() {
                let grp = (i % prompts.len()) as u64;
                ix.begin_request(r, grp, &to_i32(&prompts[grp as usize]), None).unwrap();
            }
            ix
        };
        let mut one = build(1);
        let mut many = build(threads);
        // And one request at a time (`extend_request`), which batches must equal.
        let mut seq = build(1);
        prop_assert_eq!(many.threads(), threads);
        let d = 6;
        let mut drs = (Drafter::default(), Drafter::default(), Drafter::default());
        for round in &rounds {
            // A batch of (request, token, length) picks: requests may repeat.
            let batch: Vec<u64> = round.iter().map(|&(i, _, _)| rids[i % n]).collect();
            let lens: Vec<i64> = round.iter().map(|&(_, _, l)| l).collect();
            let toks: Vec<i32> = round
                .iter()
                .flat_map(|&(i, t, l)| (0..l).map(move |j| ((t as usize + i + j as usize) % 4) as i32))
                .collect();
            one.extend_batch(&batch, &toks, &lens).unwrap();
            many.extend_batch(&batch, &toks, &lens).unwrap();
            let mut off = 0;
            for (&r, &l) in batch.iter().zip(&lens) {
                seq.extend_request(r, &toks[off..off + l as usize]).unwrap();
                off += l as usize;
            }
            prop_assert_eq!(one.stats(), many.stats());
            prop_assert_eq!(one.stats(), seq.stats());
            let mut out = Vec::new();
            for (ix, dr) in [(&one, &mut drs.0), (&many, &mut drs.1), (&seq, &mut drs.2)] {
                let mut tok = vec![-7i64; n * d];
                let mut mask = vec![7u8; n * d * d];
                let mut probs = vec![-1f32; n * d];
                let mut counts = vec![-1i64; n];
                let st = ix
                    .draft_tree_batch(&rids, d, &mut tok, &mut mask, Some(&mut probs), Some(&mut counts), dr)
                    .unwrap();
                let mut ctok = vec![-7i64; n * d];
                let mut clen = vec![-1i64; n];
                let cst = ix.draft_chain_batch(&rids, d, &mut ctok, &mut clen, None, dr).unwrap();
                out.push((tok, mask, probs, counts, st, ctok, clen, cst));
            }
            let a = &out[0];
            for b in &out[1..] {
                prop_assert_eq!(&a.0, &b.0, "tree tokens");
                prop_assert_eq!(&a.1, &b.1, "tree masks");
                prop_assert_eq!(&a.2, &b.2, "tree probs");
                prop_assert_eq!(&a.3, &b.3, "tree counts");
                prop_assert_eq!(a.4, b.4, "tree stats");
                prop_assert_eq!(&a.5, &b.5, "chain tokens");
                prop_assert_eq!(&a.6, &b.6, "chain lengths");
                prop_assert_eq!(a.7, b.7, "chain stats");
            }
        }
        for &r in &rids {
            one.finish_request(r, true).unwrap();
            many.finish_request(r, true).unwrap();
            seq.finish_request(r, true).unwrap();
        }
        prop_assert_eq!(one.to_bytes(), many.to_bytes());
        prop_assert_eq!(one.to_bytes(), seq.to_bytes());
    }

    /// A rebuild while a request is in flight (retention dropping a response) recounts and lays
    /// out the group's automaton again; the request's drafts are then those of a fresh index
    /// holding the same history and context, also as the request goes on.
    #[test]
    fn rebuild_in_flight_drafts_like_a_fresh_index(history in prop::collection::vec(prop::collection::vec(0u32..3, 20..120), 2..5),
                                                   gen in prop::collection::vec(0u32..3, 1..60), d in 2usize..20) {
        let draft = DraftConfig { follow: 0.0, ..Default::default() };
        let keep = history.len() - 1;
        let cfg = IndexConfig { max_responses: keep, draft: draft.clone(), ..Default::default() };
        let prompt = vec![7i32, 8];
        let mut ix = HistoryIndex::new(cfg).unwrap();
        ix.add_response(3, &prompt, &to_i32(&history[0]), 0).unwrap();
        ix.begin_request(1, 3, &prompt, None).unwrap();
        ix.extend_request(1, &to_i32(&gen)).unwrap();
        for h in &history[1..] {
            ix.add_response(3, &prompt, &to_i32(h), 0).unwrap();
        }
        prop_assert_eq!(ix.stats().rebuilds, 1);
        let mut fresh = HistoryIndex::new(IndexConfig { draft, ..Default::default() }).unwrap();
        for h in &history[1..] {
            fresh.add_response(3, &prompt, &to_i32(h), 0).unwrap();
        }
        fresh.begin_request(1, 3, &prompt, None).unwrap();
        fresh.extend_request(1, &to_i32(&gen)).unwrap();
        let mut dr = Drafter::default();
        prop_assert_eq!(ix.draft_nodes(1, d, false, &mut dr).unwrap(), fresh.draft_nodes(1, d, false, &mut dr).unwrap());
        ix.extend_request(1, &[1, 2, 0]).unwrap();
        fresh.extend_request(1, &[1, 2, 0]).unwrap();
        prop_assert_eq!(ix.draft_nodes(1, d, false, &mut dr).unwrap(), fresh.draft_nodes(1, d, false, &mut dr).unwrap());
    }

    /// Requests finished with `Finish::DropLater` stay in their group's automaton only while
    /// siblings are in flight: once the last one finishes the group holds exactly its history (an automaton of
    /// the size a snapshot of it loaded into a fresh index has; with no request kept, also the same
    /// drafts; kept ones may have been inserted in another order, which changes recency). There
    /// are at most as many rebuilds as unkept requests.
    #[test]
    fn unkept_requests_leave_when_their_group_is_idle(history in prop::collection::vec(prop::collection::vec(0u32..4, 5..40), 1..4),
                                                      gens in prop::collection::vec(prop::collection::vec(0u32..4, 0..40), 2..7),
                                                      keep in prop::collection::vec(any::<bool>(), 7),
                                                      order_seed in any::<u64>(), probe in prop::collection::vec(0u32..4, 1..10)) {
        let cfg = IndexConfig { draft: DraftConfig { follow: 0.0, ..Default::default() }, ..Default::default() };
        let prompt = vec![5i32, 6];
        let mut ix = HistoryIndex::new(cfg.clone()).unwrap();
        for h in &history {
            ix.add_response(3, &prompt, &to_i32(h), 0).unwrap();
        }
        let n = gens.len();
        for i in 0..n {
            ix.begin_request(i as u64, 3, &prompt, None).unwrap();
        }
        // Interleaved growth, as siblings decode.
        for step in 0..40 {
            for (i, g) in gens.iter().enumerate() {
                if let Some(&t) = g.get(step) {
                    ix.extend_request(i as u64, &[t as i32]).unwrap();
                }
            }
        }
        let mut order: Vec<usize> = (0..n).collect();
        let mut x = order_seed;
        for i in (1..n).rev() {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            order.swap(i, (x >> 33) as usize % (i + 1));
        }
        let unkept = order.iter().filter(|&&i| !keep[i]).count() as u64;
        for &i in &order {
            let how = if keep[i] { Finish::Keep } else { Finish::DropLater };
            ix.finish_request_as(i as u64, how).unwrap();
        }
        let rebuilds = ix.stats().rebuilds;
        prop_assert!(rebuilds <= unkept.max(1), "{} rebuilds for {} unkept requests", rebuilds, unkept);
        if unkept == 0 {
            // Nothing to remove: no rebuild (the kept strings stay as they were inserted).
            prop_assert_eq!(rebuilds, 0);
            return Ok(());
        }
        prop_assert!(rebuilds >= 1, "the idle group still holds unkept requests");
        let mut fresh = HistoryIndex::from_bytes(&ix.to_bytes(), cfg).unwrap();
        let (a, b) = (ix.stats(), fresh.stats());
        prop_assert_eq!((a.states, a.edges, a.tokens), (b.states, b.edges, b.tokens));
        if keep[..n].iter().any(|&k| k) {
            return Ok(());
        }
        let mut dr = Drafter::default();
        for one in [&mut ix, &mut fresh] {
            one.begin_request(100, 3, &prompt, None).unwrap();
            one.extend_request(100, &to_i32(&probe)).unwrap();
        }
        prop_assert_eq!(ix.draft_nodes(100, 12, false, &mut dr).unwrap(), fresh.draft_nodes(100, 12, false, &mut dr).unwrap());
    }

    /// Retention keeps exactly the last N responses, and the automaton forgets the dropped ones.
    #[test]
    fn retention_limits_hold(history in prop::collection::vec(prop::collection::vec(0u32..6, 1..12), 1..10), n in 1usize..4) {
        let cfg = IndexConfig { max_responses: n, ..Default::default() };
        let mut ix = HistoryIndex::new(cfg).unwrap();
        let prompt = vec![9i32];
        for (i, h) in history.iter().enumerate() {
            ix.begin_request(i as u64, 5, &prompt, None).unwrap();
            ix.extend_request(i as u64, &to_i32(h)).unwrap();
            ix.finish_request(i as u64, true).unwrap();
        }
        let kept = ix.responses(5);
        let expect: Vec<&Vec<u32>> = history.iter().rev().take(n).rev().collect();
        prop_assert_eq!(kept.len(), expect.len());
        for (k, e) in kept.iter().zip(&expect) { prop_assert_eq!(&k.1.tokens, *e); }
        prop_assert_eq!(ix.stats().tokens, expect.iter().map(|e| e.len()).sum::<usize>());
    }
}

#[test]
fn memory_budget_evicts_least_recently_used_idle_groups() {
    let cfg = IndexConfig {
        max_bytes: 2_000_000,
        ..Default::default()
    };
    let mut ix = HistoryIndex::new(cfg).unwrap();
    let resp: Vec<i32> = (0..2000i32).map(|i| i * 7919 % 1000).collect();
    for g in 0..40u64 {
        ix.add_response(g, &[1, 2, 3], &resp, 0).unwrap();
    }
    let st = ix.stats();
    assert!(st.bytes <= 2_000_000, "{st:?}");
    assert!(st.evictions > 0);
    // The most recent group survives, the first one is gone.
    assert!(ix.group_keys().contains(&39));
    assert!(!ix.group_keys().contains(&0));
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let cfg = IndexConfig {
        vocab_size: Some(100),
        ..Default::default()
    };
    let mut ix = HistoryIndex::new(cfg).unwrap();
    assert!(ix.begin_request(1, 1, &[], None).is_err());
    assert!(ix.begin_request(1, 1, &[5, 100], None).is_err());
    assert!(ix.begin_request(1, 1, &[-1], None).is_err());
    ix.begin_request(1, 1, &[5], None).unwrap();
    assert!(ix.begin_request(1, 1, &[5], None).is_err());
    assert!(ix.extend_request(2, &[1]).is_err());
    let mut toks = vec![0i64; 3];
    let mut mask = vec![0i64; 9];
    let mut tree_fails = |rids: &[u64], d: usize| {
        ix.draft_tree_batch(
            rids,
            d,
            &mut toks,
            &mut mask,
            None,
            None,
            &mut Drafter::default(),
        )
        .is_err()
    };
    assert!(tree_fails(&[1], 0)); // no draft nodes
    assert!(tree_fails(&[1], 4)); // buffers sized for d = 3
    assert!(tree_fails(&[2], 3)); // unknown request
    assert!(HistoryIndex::from_bytes(b"garbage", IndexConfig::default()).is_err());
    let mut snap = ix.to_bytes();
    let n = snap.len();
    snap[n - 9] ^= 1;
    assert!(HistoryIndex::from_bytes(&snap, IndexConfig::default()).is_err());
    assert!(HistoryIndex::new(IndexConfig {
        version_decay: 0.0,
        ..Default::default()
    })
    .is_err());
}
