//! A group: one prompt's history (automaton, token log, responses), and its in-flight requests.

use std::collections::VecDeque;

use super::{Response, FOLLOW_MIN_ANCHOR};
use crate::follow::{Follow, Log};
use crate::sam::{Sam, NONE};

/// The history of one prompt (or one caller-chosen group key).
#[derive(Clone, Debug)]
pub struct Group {
    /// Automaton over every `prompt + response` of the group and every in-flight request.
    pub sam: Sam,
    /// Every token the automaton holds, by clock, linked to the next token of its string.
    pub log: Log,
    /// Distinct prompts seen in this group (almost always exactly one).
    pub prompts: Vec<Vec<u32>>,
    /// State of each whole prompt once inserted (`NONE` before): later strings with the same
    /// prompt continue from it, so a prompt is counted once per group, not once per response.
    pub(super) prompt_last: Vec<u32>,
    /// Occurrence counts are stale (bulk appends since the last recount). Invariant: a group with
    /// in-flight requests is never dirty, so drafts always see exact counts.
    pub(super) dirty: bool,
    /// Finished responses kept, oldest first.
    pub responses: VecDeque<Response>,
    /// Number of in-flight requests drafting from this group (never evicted while > 0).
    pub active: u32,
    /// Tokens of requests finished with [`Finish::DropLater`] that the automaton still holds.
    /// Invariant: 0 when `active` is 0.
    pub(super) discarded: usize,
    /// LRU tick of the last mutation.
    pub last_used: u64,
    /// The version whose occurrences weigh exactly 1.
    pub weight_base: u64,
    /// Newest version seen in the group (history or in flight).
    pub max_version: u64,
    /// Bytes held by this group (automaton and token buffers), kept current after each mutation.
    pub bytes: usize,
}

impl Group {
    pub(super) fn new(version: u64) -> Self {
        Group {
            sam: Sam::new(),
            log: Log::new(),
            prompts: Vec::new(),
            prompt_last: Vec::new(),
            dirty: false,
            responses: VecDeque::new(),
            active: 0,
            discarded: 0,
            last_used: 0,
            weight_base: version,
            max_version: version,
            bytes: 0,
        }
    }

    pub(super) fn measure(&self) -> usize {
        let toks: usize = self.prompts.iter().map(|p| p.capacity()).sum::<usize>()
            + self
                .responses
                .iter()
                .map(|r| r.tokens.capacity())
                .sum::<usize>();
        self.sam.bytes() + self.log.bytes() + 4 * toks + std::mem::size_of::<Group>()
    }

    pub(super) fn prompt_index(&mut self, prompt: &[u32]) -> u32 {
        if let Some(i) = self.prompts.iter().position(|p| p.as_slice() == prompt) {
            return i as u32;
        }
        self.prompts.push(prompt.to_vec());
        self.prompt_last.push(NONE);
        (self.prompts.len() - 1) as u32
    }

    /// Weight of one occurrence from `version` under decay `gamma`.
    pub(super) fn weight(&self, version: u64, gamma: f32) -> f32 {
        if gamma >= 1.0 {
            return 1.0;
        }
        let e = (version as f64 - self.weight_base as f64) * -(gamma as f64).ln();
        e.clamp(-80.0, 80.0).exp() as f32
    }

    /// Appends `t` to the string whose last state is `last` and whose last token has clock `prev`
    /// (`NONE` for a string's first token); returns the new state and the token's clock.
    /// With `deferred` the counts go stale (`dirty`) until [`Group::ensure_clean`].
    pub(super) fn push(
        &mut self,
        last: u32,
        prev: u32,
        t: u32,
        w: f32,
        deferred: bool,
    ) -> (u32, u32) {
        let s = if deferred {
            self.sam.extend_deferred(last, t, w)
        } else {
            self.sam.extend(last, t, w)
        };
        self.log.push(self.sam.clock, prev, t);
        (s, self.sam.clock)
    }

    /// [`Group::push`] online without recording the occurrence: the caller walks the new state's
    /// suffix links with [`Sam::count_step`] before anything else changes the automaton.
    pub(super) fn push_uncounted(&mut self, last: u32, prev: u32, t: u32, w: f32) -> (u32, u32) {
        let s = self.sam.extend_uncounted(last, t, w);
        self.log.push(self.sam.clock, prev, t);
        (s, self.sam.clock)
    }

    /// Inserts `prompt + tokens` (the prompt only the first time); returns the last state and the
    /// clock of the last token of `tokens` (`NONE` when empty).
    pub(super) fn insert(
        &mut self,
        prompt: u32,
        tokens: &[u32],
        w: f32,
        deferred: bool,
    ) -> (u32, u32) {
        debug_assert!(
            deferred || !self.dirty,
            "online insert into a group with stale counts"
        );
        let mut last = self.prompt_last[prompt as usize];
        if last == NONE {
            last = 0;
            let mut clock = NONE;
            for i in 0..self.prompts[prompt as usize].len() {
                let t = self.prompts[prompt as usize][i];
                (last, clock) = self.push(last, clock, t, w, deferred);
            }
            self.prompt_last[prompt as usize] = last;
        }
        let mut clock = NONE;
        for &t in tokens {
            (last, clock) = self.push(last, clock, t, w, deferred);
        }
        self.dirty |= deferred;
        (last, clock)
    }

    /// Brings occurrence counts up to date after bulk appends.
    pub(super) fn ensure_clean(&mut self) {
        if self.dirty {
            self.sam.recount();
            self.dirty = false;
        }
    }
}

#[derive(Clone, Debug)]
pub(super) struct Request {
    pub(super) group: u64,
    pub(super) prompt: u32,
    /// The automaton state of the request's whole context (prompt + generated).
    pub(super) last: u32,
    /// Clock of the last generated token (`NONE` before the first).
    pub(super) clock: u32,
    /// The request's pointer into the earlier string it follows.
    pub(super) follow: Follow,
    /// Generated tokens so far.
    pub(super) tokens: Vec<u32>,
    pub(super) version: u64,
    pub(super) weight: f32,
    /// Begin order, for deterministic re-insertion on rebuild.
    pub(super) seq: u64,
}

/// Appends accepted tokens `toks` to request `req` of group `g`, advancing its source pointer.
pub(super) fn append(req: &mut Request, g: &mut Group, toks: &[u32], follow: bool) {
    for &t in toks {
        (req.last, req.clock) = g.push(req.last, req.clock, t, req.weight, false);
        req.tokens.push(t);
        if follow {
            req.follow
                .step(&g.log, &g.sam, req.last, &req.tokens, FOLLOW_MIN_ANCHOR);
        }
    }
}
