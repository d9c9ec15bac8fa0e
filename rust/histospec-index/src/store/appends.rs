//! Appending a batch's accepted tokens: by group, spread over threads, several groups interleaved.

use super::group::{Group, Request};
use super::{FixedMap, HistoryIndex, FOLLOW_MIN_ANCHOR};
use crate::sam::{prefetch, NONE};

/// Groups whose appends [`apply_appends`] interleaves (8 gave update 0.90-0.93x, 16 gave 0.86-0.91x
/// in paired W1 runs).
const APPEND_LANES: usize = 16;

/// Where one lane of [`apply_appends`] is: its group (`work`), the next append and token, and
/// the count walk in progress (`walk`: the next state to count, `NONE` when none).
#[derive(Clone, Copy)]
struct AppendLane {
    work: usize,
    append: usize,
    tok: usize,
    req: usize,
    walk: u32,
    weight: f32,
    clock: u32,
}

/// Applies every group's appends exactly as [`append`] does one by one, but several groups at a
/// time: recording an appended token's occurrence walks its suffix links, one dependent cache miss
/// per state, so each step of a walk starts loading the next state and hands over to the next
/// group while it loads. A group's own steps stay in order (its tokens, its walks and its
/// pointer updates), and groups share nothing, so the result is the same.
fn apply_appends(works: &mut [GroupWork], toks: &[u32], follow: bool) {
    let mut lanes: Vec<AppendLane> = Vec::with_capacity(APPEND_LANES);
    let mut next = 0;
    loop {
        while lanes.len() < APPEND_LANES && next < works.len() {
            lanes.push(AppendLane {
                work: next,
                append: 0,
                tok: 0,
                req: 0,
                walk: NONE,
                weight: 0.0,
                clock: 0,
            });
            next += 1;
        }
        if lanes.is_empty() {
            return;
        }
        let mut i = 0;
        while i < lanes.len() {
            if append_step(&mut lanes[i], works, toks, follow) {
                lanes.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }
}

/// One move of a lane of [`apply_appends`]: the next state of its count walk (and the pointer's
/// update when the walk ends), after starting its next token when no walk is under way. True
/// when its group has nothing left.
#[inline]
fn append_step(lane: &mut AppendLane, works: &mut [GroupWork], toks: &[u32], follow: bool) -> bool {
    let w = &mut works[lane.work];
    let g = &mut w.group;
    if lane.walk == NONE {
        while lane.append < w.appends.len() && lane.tok == w.appends[lane.append].2 {
            lane.append += 1;
            lane.tok = 0;
        }
        let Some(&(i, off, _)) = w.appends.get(lane.append) else {
            return true;
        };
        let t = toks[off + lane.tok];
        lane.tok += 1;
        let req = &mut w.reqs[i].1;
        (req.last, req.clock) = g.push_uncounted(req.last, req.clock, t, req.weight);
        req.tokens.push(t);
        // The new state was just written: its count step follows at once.
        *lane = AppendLane {
            req: i,
            walk: req.last,
            weight: req.weight,
            clock: req.clock,
            ..*lane
        };
    }
    lane.walk = g.sam.count_step(lane.walk, lane.weight, lane.clock);
    // Start loading the walk's next state before handing over to the next group.
    prefetch(&g.sam.states, lane.walk as usize);
    if lane.walk == NONE && follow {
        let req = &mut w.reqs[lane.req].1;
        req.follow
            .step(&g.log, &g.sam, req.last, &req.tokens, FOLLOW_MIN_ANCHOR);
    }
    false
}

/// One group's share of a parallel [`HistoryIndex::extend_batch`].
struct GroupWork {
    key: u64,
    group: Group,
    /// The batch's requests of this group (each once).
    reqs: Vec<(u64, Request)>,
    /// (index into `reqs`, offset, length) of each append, in batch order: siblings interleave
    /// in the automaton exactly as they do one by one.
    appends: Vec<(usize, usize, usize)>,
    /// Tokens to append plus one per append, for dealing groups to threads.
    load: usize,
}

impl HistoryIndex {
    /// [`HistoryIndex::extend_batch`] for validated input, by group, spread over the index's
    /// threads. Each group goes to one thread, which applies its requests' appends in batch order
    /// ([`apply_appends`], several groups interleaved), so automata, pointers and counts come out
    /// exactly as one by one; LRU ticks and sizes are then updated in batch order, as one by one.
    pub(super) fn extend_grouped(&mut self, rids: &[u64], toks: &[u32], lens: &[i64]) {
        // The batch's requests and groups leave their maps for the call, so that each thread owns
        // what it mutates. A request listed twice is taken once.
        let mut work: Vec<GroupWork> = Vec::new();
        let mut group_slot: FixedMap<u64, usize> = FixedMap::default();
        let mut req_slot: FixedMap<u64, (usize, usize)> = FixedMap::default();
        let mut off = 0;
        for (&r, &l) in rids.iter().zip(lens) {
            let l = l as usize;
            let (w, i) = match req_slot.get(&r) {
                Some(&slot) => slot,
                None => {
                    let req = self.requests.remove(&r).expect("validated request id");
                    let key = req.group;
                    let w = *group_slot.entry(key).or_insert_with(|| {
                        let group = self
                            .groups
                            .remove(&key)
                            .expect("in-flight request without its group");
                        work.push(GroupWork {
                            key,
                            group,
                            reqs: Vec::new(),
                            appends: Vec::new(),
                            load: 0,
                        });
                        work.len() - 1
                    });
                    work[w].reqs.push((r, req));
                    let slot = (w, work[w].reqs.len() - 1);
                    req_slot.insert(r, slot);
                    slot
                }
            };
            work[w].appends.push((i, off, l));
            work[w].load += l + 1;
            off += l;
        }
        // Deal the groups to the threads, largest first, each to the least loaded thread.
        let parts = self.par.parts(rids.len()).min(work.len());
        work.sort_by_key(|w| std::cmp::Reverse(w.load));
        let mut bins: Vec<(usize, Vec<GroupWork>)> = (0..parts).map(|_| (0, Vec::new())).collect();
        for w in work {
            let b = bins.iter_mut().min_by_key(|b| b.0).expect("parts >= 1");
            b.0 += w.load;
            b.1.push(w);
        }
        let follow = self.cfg.draft.follow > 0.0;
        let done = self.par.run(bins, |(_, mut bin)| {
            apply_appends(&mut bin, toks, follow);
            bin
        });
        for w in done.into_iter().flatten() {
            self.groups.insert(w.key, w.group);
            self.requests.extend(w.reqs);
        }
        for &r in rids {
            let key = self.requests[&r].group;
            self.touch(key);
            self.remeasure(key);
        }
    }
}
