//! Child estimates: the probability that each continuation of an automaton state is accepted
//! next, mixed with the source pointer's prediction.

use std::cmp::Ordering;

use super::DraftConfig;
use crate::follow::Log;
use crate::sam::{Sam, NONE};

/// A candidate child of a node: its token, automaton state (`NONE`: only the pointer predicts
/// it), weighted count, recency rank key, estimate, and clock in the followed source (`NONE`: not
/// the pointer's prediction).
#[derive(Clone, Copy, Debug)]
pub(super) struct Kid {
    pub tok: u32,
    pub to: u32,
    pub cnt: f32,
    pub recent: u32,
    pub p: f32,
    pub ptr: u32,
}

impl Kid {
    /// A child only the pointer predicts: token `tok` at clock `clock` of the source, with the
    /// pointer's weight `lam` as its estimate.
    pub fn pointer(tok: u32, clock: u32, lam: f32) -> Self {
        Kid {
            tok,
            to: NONE,
            cnt: 0.0,
            recent: 0,
            p: lam,
            ptr: clock,
        }
    }
}

/// The escape pseudo-count of a context of length `len`, in units of one occurrence of weight
/// `w_new`.
#[inline(always)]
fn escape_mass(len: u32, w_new: f32, cfg: &DraftConfig) -> f32 {
    let len = len.max(1) as f32;
    (cfg.escape + cfg.escape_short / len) * w_new
}

/// Appends the children of `s` to `kids` with their estimated probabilities.
pub(super) fn estimate(kids: &mut Vec<Kid>, sam: &Sam, s: u32, w_new: f32, cfg: &DraftConfig) {
    if sam.degree(s) == 1 {
        kids.extend(one_child_estimate(sam, s, w_new, cfg));
        return;
    }
    let from = kids.len();
    let mut total = 0.0f32;
    for (tok, to) in sam.children(s) {
        let st = &sam.states[to as usize];
        total += st.cnt;
        kids.push(Kid {
            tok,
            to,
            cnt: st.cnt,
            recent: st.recent,
            p: 0.0,
            ptr: NONE,
        });
    }
    if kids.len() == from || total <= 0.0 {
        kids.truncate(from);
        return;
    }
    let esc = escape_mass(sam.states[s as usize].len, w_new, cfg);
    let denom = total + esc;
    let conf = total / denom;
    let a = cfg.recency;
    let kids = &mut kids[from..];
    for k in kids.iter_mut() {
        k.p = (1.0 - a) * k.cnt / denom;
    }
    if a > 0.0 {
        // Rank by recency (ties: larger count, then smaller token) and add the recency share,
        // which decays geometrically: only the first `ranks` children get a share worth adding,
        // so only they need ordering.
        let b = cfg.recency_decay;
        let r0 = a * conf * (1.0 - b);
        let mut ranks = 1;
        let mut r = r0 * b;
        while ranks < kids.len() && r >= RECENCY_NEGLIGIBLE {
            ranks += 1;
            r *= b;
        }
        if ranks < kids.len() {
            kids.select_nth_unstable_by(ranks - 1, by_recency);
        }
        kids[..ranks].sort_unstable_by(by_recency);
        let mut r = r0;
        for k in &mut kids[..ranks] {
            k.p += r;
            r *= b;
        }
    }
}

/// A recency share below this is not added (it cannot change which children are drafted).
pub(super) const RECENCY_NEGLIGIBLE: f32 = 1e-6;

/// Recency order: most recent first; ties to the larger count, then the smaller token.
pub(super) fn by_recency(x: &Kid, y: &Kid) -> Ordering {
    y.recent
        .cmp(&x.recent)
        .then(y.cnt.total_cmp(&x.cnt))
        .then(x.tok.cmp(&y.tok))
}

/// [`estimate`] for a state `s` with one transition, without enumerating: the child with its
/// estimate (all of the recency share goes to it); `None` when the child has no weight.
#[inline]
pub(super) fn one_child_estimate(sam: &Sam, s: u32, w_new: f32, cfg: &DraftConfig) -> Option<Kid> {
    let st = &sam.states[s as usize];
    let (tok, to) = st.first_child()?;
    let child = &sam.states[to as usize];
    let cnt = child.cnt;
    if cnt <= 0.0 {
        return None;
    }
    let denom = cnt + escape_mass(st.len, w_new, cfg);
    let a = cfg.recency;
    let mut p = (1.0 - a) * cnt / denom;
    if a > 0.0 {
        p += a * (cnt / denom) * (1.0 - cfg.recency_decay);
    }
    Some(Kid {
        tok,
        to,
        cnt,
        recent: child.recent,
        p,
        ptr: NONE,
    })
}

/// Mixes the pointer's prediction (the token at `clock` of `log`, weight `lam`) into `kids`: the
/// source's next token gets `lam` on top of its share `(1-lam)` of the rest.
pub(super) fn mix_pointer(kids: &mut Vec<Kid>, log: &Log, clock: u32, lam: f32) {
    let Some(e) = log.get(clock) else { return };
    for k in kids.iter_mut() {
        k.p *= 1.0 - lam;
    }
    match kids.iter_mut().find(|k| k.tok == e.tok) {
        Some(k) => {
            // At most 1 after rounding, so that no node is more probable than its parent.
            k.p = (k.p + lam).min(1.0);
            k.ptr = clock;
        }
        None => kids.push(Kid::pointer(e.tok, clock, lam)),
    }
}

/// The order in which a node offers its children: most probable first, ties to the smaller token.
#[inline]
pub(super) fn by_p(x: &Kid, y: &Kid) -> Ordering {
    y.p.total_cmp(&x.p).then(x.tok.cmp(&y.tok))
}
