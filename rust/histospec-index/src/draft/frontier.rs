//! The growth's frontier: candidates ordered by path probability.

use std::cmp::Ordering;

/// A candidate node: its path probability, push order (ties go to the earliest), parent, token,
/// automaton state and pointer clock.
#[derive(Clone, Copy, Debug)]
pub(super) struct Cand {
    pub score: f32,
    pub seq: u32,
    pub parent: u32,
    pub tok: u32,
    /// Automaton state of the node (`NONE`: only the pointer predicts it).
    pub state: u32,
    /// Clock of the node's token in the followed source (`NONE`: not on the pointer's path).
    pub ptr: u32,
}

impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Cand {
    fn cmp(&self, o: &Self) -> Ordering {
        // Highest score first; among equals, the earliest pushed (deterministic).
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.seq.cmp(&self.seq))
    }
}

/// The frontier: a binary max-heap of candidates. `std`'s `BinaryHeap` stores a pushed element
/// and reads it back whole to sift it up, and that read waited on the element's field-by-field
/// stores; here an element is held in registers while it sifts and written once. The order of
/// `Cand` is total (no two candidates share a sequence number), so the pops are the same.
#[derive(Default)]
pub(super) struct Frontier {
    v: Vec<Cand>,
}

impl Frontier {
    pub fn clear(&mut self) {
        self.v.clear();
    }

    pub fn peek(&self) -> Option<&Cand> {
        self.v.first()
    }

    #[inline(always)]
    pub fn push(&mut self, c: Cand) {
        let mut i = self.v.len();
        self.v.push(c);
        while i > 0 {
            let up = (i - 1) / 2;
            if self.v[up] >= c {
                break;
            }
            self.v[i] = self.v[up];
            i = up;
        }
        self.v[i] = c;
    }

    #[inline(always)]
    pub fn pop(&mut self) -> Option<Cand> {
        let last = self.v.pop()?;
        let Some(&top) = self.v.first() else {
            return Some(last);
        };
        // Sift `last` down from the root.
        let n = self.v.len();
        let mut i = 0;
        loop {
            let l = 2 * i + 1;
            if l >= n {
                break;
            }
            let r = l + 1;
            let big = if r < n && self.v[r] > self.v[l] { r } else { l };
            if self.v[big] <= last {
                break;
            }
            self.v[i] = self.v[big];
            i = big;
        }
        self.v[i] = last;
        Some(top)
    }
}
