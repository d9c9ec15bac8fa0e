//! Source following: a request keeps a pointer into one earlier string of its group (a finished
//! response, an in-flight sibling, the prompt, or its own earlier text) and drafts that string's
//! next tokens, position by position.
//!
//! The automaton knows *what* follows a context, but after a mutation (a substituted, inserted or
//! deleted token) the request's longest match shrinks to the few tokens since the break, which
//! occur all over the group, so for a few steps the automaton drafts what usually follows those
//! tokens anywhere. A response that rewrites an earlier one keeps its place in it across the break:
//! the pointer re-synchronizes locally (the token it predicted was replaced, skipped, or had tokens
//! inserted before it) and drafts the source's continuation from the right place at once.
//!
//! Storage: every appended token gets the automaton's clock value; the group's [`Log`] records, per
//! clock, the token and the clock of the next token of the same string (`NONE` at the end of what is
//! known of the string so far). Bulk-loaded strings occupy consecutive clocks, so following one
//! reads memory sequentially. Cost: 8 bytes per indexed token.

use std::cmp::Ordering;

use crate::sam::{prefetch, Sam, NONE};

/// One logged token: the token and the clock of the next token of the same string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub tok: u32,
    pub next: u32,
}

/// Per-group token log indexed by automaton clock (clock 0 is a placeholder).
#[derive(Clone, Debug)]
pub struct Log {
    entries: Vec<Entry>,
}

impl Default for Log {
    fn default() -> Self {
        Self::new()
    }
}

impl Log {
    pub fn new() -> Self {
        Log {
            entries: vec![Entry { tok: 0, next: NONE }],
        }
    }

    /// Records token `tok` at `clock`, the successor of `prev` (`NONE` = first token of a string).
    /// Clocks must arrive in order; a log that lost step (the 32-bit clock wrapped) stops growing
    /// and every lookup past its end answers "unknown".
    pub fn push(&mut self, clock: u32, prev: u32, tok: u32) {
        if clock as usize != self.entries.len() {
            return;
        }
        self.entries.push(Entry { tok, next: NONE });
        if let Some(p) = self.entries.get_mut(prev as usize) {
            p.next = clock;
        }
    }

    /// The entry at `clock`, if logged.
    #[inline]
    pub fn get(&self, clock: u32) -> Option<Entry> {
        if clock == 0 {
            return None;
        }
        self.entries.get(clock as usize).copied()
    }

    /// Asks the CPU to start loading the entry at `clock`.
    #[inline]
    pub fn prefetch(&self, clock: u32) {
        prefetch(&self.entries, clock as usize);
    }

    /// The clock after `clock` in its string (`NONE` when unknown).
    #[inline]
    pub fn next(&self, clock: u32) -> u32 {
        self.get(clock).map_or(NONE, |e| e.next)
    }

    pub fn bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
    }
}

/// Tokens of the source scanned for a re-synchronization after a break.
const WINDOW: usize = 8;
/// Strength of the prior of a pointer's hit rate, in predictions.
const PRIOR_TRIES: f32 = 4.0;
/// Longest tail of the request matched against the window.
const RESYNC_TAIL: usize = 3;
/// After this many tokens out of step, the pointer may jump to where the automaton's match points.
const REANCHOR_AFTER: u32 = 6;

/// A request's pointer into its source string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Follow {
    /// Clock of the source token predicted to come next (`NONE`: no source).
    pub pred: u32,
    /// Clock of the first source token that failed to match at the current break (`NONE`: in step).
    brk: u32,
    /// Request tokens appended since the break (0 when in step).
    pub since: u32,
    /// Whether the automaton's most frequent next token was `pred`'s token when it was chosen.
    agrees: bool,
    /// Predictions that differed from the automaton's most frequent next token, made in step and
    /// after a break: `[in step, after a break]`.
    tries: [u32; 2],
    /// How many of them the request's next token confirmed.
    hits: [u32; 2],
}

impl Default for Follow {
    fn default() -> Self {
        Follow::LOST
    }
}

impl Follow {
    pub const LOST: Follow = Follow {
        pred: NONE,
        brk: NONE,
        since: 0,
        agrees: false,
        tries: [0; 2],
        hits: [0; 2],
    };

    /// Weights of the pointer's next prediction and of the predictions after it (which assume
    /// the pointer in step): the share of this request's predictions of the same kind (in step,
    /// or after a break) that held where the automaton's favourite said otherwise, shrunk towards
    /// `prior` (`[in step, after a break]`) with the strength of [`PRIOR_TRIES`] predictions.
    pub fn weights(&self, prior: [f32; 2]) -> (f32, f32) {
        let rate = |k: usize| {
            (self.hits[k] as f32 + PRIOR_TRIES * prior[k]) / (self.tries[k] as f32 + PRIOR_TRIES)
        };
        let first = if self.in_step() { rate(0) } else { rate(1) };
        (first, rate(0))
    }

    /// Whether the last appended token was the one the source predicted.
    pub fn in_step(&self) -> bool {
        self.pred != NONE && self.brk == NONE
    }

    /// Advances after the request appended `tokens.last()`. `last` is the automaton state of the
    /// request's whole context; `min_anchor` the shortest automaton match a new pointer may start
    /// from.
    pub fn step(&mut self, log: &Log, sam: &Sam, last: u32, tokens: &[u32], min_anchor: u32) {
        let Some(&t) = tokens.last() else { return };
        if self.pred != NONE {
            let said = log.get(self.pred).map(|e| e.tok);
            if !self.agrees {
                let k = usize::from(!self.in_step());
                self.tries[k] += 1;
                self.hits[k] += u32::from(said == Some(t));
            }
            if said == Some(t) {
                self.pred = log.next(self.pred);
                self.brk = NONE;
                self.since = 0;
            } else {
                if self.brk == NONE {
                    self.brk = self.pred;
                    self.since = 0;
                }
                self.since += 1;
                self.resync(log, tokens);
            }
        }
        if self.pred == NONE || self.since >= REANCHOR_AFTER {
            if let Some(p) = anchor(sam, last, min_anchor) {
                self.pred = p;
                self.brk = NONE;
                self.since = 0;
            } else if self.pred == NONE {
                self.brk = NONE;
                self.since = 0;
            }
        }
        self.agrees = log
            .get(self.pred)
            .is_some_and(|e| is_favourite(sam, last, e.tok));
    }

    /// Looks for the request's last few tokens in the source just after the break: a hit means the
    /// break deleted source tokens or inserted request tokens, and the pointer continues after the
    /// hit. Otherwise the break is taken as a substitution of equal length.
    fn resync(&mut self, log: &Log, tokens: &[u32]) {
        let mut win = [NONE; WINDOW + 1];
        let mut toks = [0u32; WINDOW];
        let mut n = 0;
        let mut c = self.brk;
        while n < WINDOW {
            let Some(e) = log.get(c) else { break };
            win[n] = c;
            toks[n] = e.tok;
            c = e.next;
            n += 1;
        }
        win[n] = c;
        let tail_max = (self.since as usize).min(RESYNC_TAIL).min(tokens.len());
        for m in (1..=tail_max).rev() {
            let tail = &tokens[tokens.len() - m..];
            if let Some(j) = (m - 1..n).find(|&j| toks[j + 1 - m..=j] == *tail) {
                self.pred = if j + 1 < n {
                    win[j + 1]
                } else {
                    log.next(win[j])
                };
                return;
            }
        }
        self.pred = if (self.since as usize) < n {
            win[self.since as usize]
        } else {
            NONE
        };
    }
}

/// Whether `tok` is the automaton's most frequent next token after the state `last` (ties go to
/// the smaller token): its most frequent child. Reads only `tok`'s child when
/// it holds the majority of the occurrences, and stops at the first child that beats it.
fn is_favourite(sam: &Sam, last: u32, tok: u32) -> bool {
    let Some(a) = sam.longest_with_children(last, 1) else {
        return false;
    };
    let Some(c) = sam.next_state(a, tok) else {
        return false;
    };
    let n = sam.states[c as usize].cnt;
    if 2.0 * n > sam.states[a as usize].cnt {
        return true;
    }
    !sam.children(a)
        .any(|(t, s)| match sam.states[s as usize].cnt.total_cmp(&n) {
            Ordering::Greater => true,
            Ordering::Equal => t < tok,
            Ordering::Less => false,
        })
}

/// Where a pointer starts: the latest occurrence of the most frequent continuation of the
/// request's longest match, when that match is at least `min_len` tokens long.
fn anchor(sam: &Sam, last: u32, min_len: u32) -> Option<u32> {
    let a = sam.longest_with_children(last, min_len.max(1))?;
    let best = sam.children(a).max_by(|x, y| {
        let (sx, sy) = (&sam.states[x.1 as usize], &sam.states[y.1 as usize]);
        sx.cnt.total_cmp(&sy.cnt).then(sx.recent.cmp(&sy.recent))
    })?;
    let r = sam.states[best.1 as usize].recent;
    (r != 0).then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn favourite_agrees_with_the_most_frequent_child() {
        // Small and wide alphabets (the wide one makes hubs), repeated substrings so that counts
        // tie and differ; weights of two versions so that they are not integers.
        let mut x = 12345u64;
        let mut rnd = |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        for alphabet in [3u32, 40] {
            let mut sam = Sam::new();
            for s in 0..12 {
                let w = if s % 2 == 0 { 1.0 } else { 0.5 };
                let mut last = 0;
                for _ in 0..300 {
                    last = sam.extend(last, rnd(alphabet as u64) as u32, w);
                }
            }
            for s in 0..sam.num_states() as u32 {
                let fav = sam
                    .longest_with_children(s, 1)
                    .and_then(|a| sam.most_frequent_child(a));
                for t in 0..alphabet {
                    let expect = fav.is_some_and(|(f, _)| f == t);
                    assert_eq!(is_favourite(&sam, s, t), expect, "state {s} token {t}");
                }
            }
        }
    }

    /// Appends `t` to the string whose last state is `last` and whose last clock is `prev`, in
    /// both the automaton and the log (what `Group::push` does in the index).
    fn append(sam: &mut Sam, log: &mut Log, last: &mut u32, prev: &mut u32, t: u32) {
        *last = sam.extend(*last, t, 1.0);
        log.push(sam.clock, *prev, t);
        *prev = sam.clock;
    }

    /// Logs `strings` one after another (each its own chain) in a fresh automaton + log.
    fn build(strings: &[&[u32]]) -> (Sam, Log) {
        let mut sam = Sam::new();
        let mut log = Log::new();
        for s in strings {
            let (mut last, mut prev) = (0, NONE);
            for &t in *s {
                append(&mut sam, &mut log, &mut last, &mut prev, t);
            }
        }
        (sam, log)
    }

    /// Feeds `req` token by token as a new string; returns the predicted token after each step.
    fn follow(sam: &mut Sam, log: &mut Log, req: &[u32]) -> Vec<Option<u32>> {
        let mut f = Follow::LOST;
        let (mut last, mut prev) = (0, NONE);
        let mut out = Vec::new();
        for i in 0..req.len() {
            append(sam, log, &mut last, &mut prev, req[i]);
            f.step(log, sam, last, &req[..=i], 3);
            out.push(log.get(f.pred).map(|e| e.tok));
        }
        out
    }

    #[test]
    fn log_links_each_string() {
        let (_, log) = build(&[&[1, 2, 3], &[4, 5]]);
        assert_eq!(log.get(1).unwrap(), Entry { tok: 1, next: 2 });
        assert_eq!(log.get(3).unwrap(), Entry { tok: 3, next: NONE });
        assert_eq!(log.get(4).unwrap(), Entry { tok: 4, next: 5 });
        assert_eq!(log.get(0), None);
        assert_eq!(log.get(9), None);
    }

    #[test]
    fn keeps_its_place_across_a_substitution() {
        let src: Vec<u32> = (10..40).collect();
        let (mut sam, mut log) = build(&[&src]);
        // 10..15 in step, 99 replaces 16, then 17.. continues.
        let mut req: Vec<u32> = (10..16).collect();
        req.push(99);
        req.extend(17..20);
        let p = follow(&mut sam, &mut log, &req);
        assert_eq!(p[5], Some(16)); // after 15 the source says 16
        assert_eq!(p[6], Some(17)); // 99 replaced 16: the source's 17 comes next
        assert_eq!(p[7], Some(18));
    }

    #[test]
    fn skips_deleted_tokens_and_waits_out_insertions() {
        let src: Vec<u32> = (10..40).collect();
        let (mut sam, mut log) = build(&[&src]);
        // Deletion: 10..15, then 19 (16..18 deleted).
        let mut req: Vec<u32> = (10..16).collect();
        req.push(19);
        let p = follow(&mut sam, &mut log, &req);
        assert_eq!(p[6], Some(20));
        // Insertion: 10..15, then 91 92, then 16 ...
        let (mut sam, mut log) = build(&[&src]);
        let mut req: Vec<u32> = (10..16).collect();
        req.extend([91, 92, 16]);
        let p = follow(&mut sam, &mut log, &req);
        assert_eq!(p[8], Some(17));
    }

    #[test]
    fn anchors_from_the_automaton_and_stops_at_the_end() {
        let (mut sam, mut log) = build(&[&[1, 2, 3, 4, 5]]);
        let p = follow(&mut sam, &mut log, &[7, 2, 3, 4, 5]);
        // Match "2 3 4" (3 tokens) anchors: the source predicts 5, then the source ends.
        assert_eq!(p[3], Some(5));
        assert_eq!(p[4], None);
    }
}

#[cfg(test)]
mod index_tests {
    use crate::{DraftConfig, Drafter, HistoryIndex, IndexConfig};

    fn index(follow: f32) -> HistoryIndex {
        let draft = DraftConfig {
            follow,
            ..DraftConfig::default()
        };
        HistoryIndex::new(IndexConfig {
            draft,
            ..IndexConfig::default()
        })
        .unwrap()
    }

    /// After a substituted token no suffix of the context occurs in history, so the automaton has
    /// nothing to offer; the followed response still says what comes next.
    #[test]
    fn draft_resumes_the_followed_response_after_a_substitution() {
        let src: Vec<i32> = (100..160).collect();
        let mut req: Vec<i32> = (100..120).collect();
        req.push(7); // replaces 120
        for (follow, want) in [(0.0, vec![]), (0.5, (121..127).collect::<Vec<u32>>())] {
            let mut ix = index(follow);
            ix.add_response(1, &[1, 2], &src, 0).unwrap();
            ix.begin_request(9, 1, &[1, 2], None).unwrap();
            ix.extend_request(9, &req).unwrap();
            let nodes = ix.draft_nodes(9, 7, true, &mut Drafter::default()).unwrap();
            let got: Vec<u32> = nodes[1..].iter().map(|n| n.tok).collect();
            assert_eq!(got, want, "follow = {follow}");
        }
    }

    /// A rebuild (here: dropping an unkept sibling) renumbers clocks; pointers start over and
    /// find their place again instead of reading a stale position.
    #[test]
    fn pointers_survive_a_rebuild() {
        let src: Vec<i32> = (100..160).collect();
        let mut ix = index(0.5);
        ix.add_response(1, &[1, 2], &src, 0).unwrap();
        ix.begin_request(8, 1, &[1, 2], None).unwrap();
        ix.extend_request(8, &[100, 101, 102]).unwrap();
        ix.begin_request(9, 1, &[1, 2], None).unwrap();
        ix.extend_request(9, &(100..110).collect::<Vec<i32>>())
            .unwrap();
        ix.finish_request(8, false).unwrap();
        assert_eq!(ix.stats().rebuilds, 1);
        ix.extend_request(9, &(110..118).collect::<Vec<i32>>())
            .unwrap();
        let nodes = ix.draft_nodes(9, 5, true, &mut Drafter::default()).unwrap();
        let got: Vec<u32> = nodes[1..].iter().map(|n| n.tok).collect();
        assert_eq!(got, vec![118, 119, 120, 121]);
    }
}
