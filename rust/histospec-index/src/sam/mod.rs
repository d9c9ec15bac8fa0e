//! A generalized suffix automaton with online appends to any number of strings at once.
//!
//! Glossary:
//! - *state*: an equivalence class of substrings that end at the same set of positions (endpos).
//! - *len*: length of the longest substring in a state; the shortest is `len(link) + 1`.
//! - *suffix link*: the state of the longest suffix that falls into a different class.
//! - *occurrence weight* (`cnt`): the weighted size of endpos, i.e. how often (weighted by version)
//!   every substring of the state occurs in the indexed strings. With unit weights it is the exact
//!   occurrence count.
//! - *recent*: the logical clock of the latest occurrence of the state's substrings.
//!
//! Each indexed string keeps its own `last` state; appending token `c` to a string moves its `last`
//! along the generalized construction (with the "transition already exists" case), so strings can
//! grow interleaved, which is how in-flight sibling samples see each other. Occurrence weights and
//! recency are maintained online by walking the suffix-link path of the new position.
//!
//! A state's first transition is stored in the state itself (most states of a history of similar
//! responses have exactly one, so following a match, drafting along it and looking up a token cost
//! one cache line per state). Its other transitions live in one edge arena per automaton, threaded
//! into a singly linked list per state (for enumeration while drafting); states with at least
//! [`HUB_DEGREE`] transitions list their edges in one array instead (a hub list), so that
//! enumerating them does not chase pointers. An *edge reference* names either kind: an arena
//! index, or [`INLINE`] with the id of the state that holds it. A bulk load's [`Sam::recount`]
//! renumbers the arena so that each state's edges are consecutive (see `compact_edges`); edges
//! added online afterwards go to the end of the arena, as they are created.
//! States with at least [`HASHED_DEGREE`] transitions also have them indexed by an open-addressing
//! table keyed by `(state, token)` (for O(1) lookup while extending and matching); states with fewer
//! are searched along their short list, which is most states of a history of similar responses and
//! saves the table's memory and cache misses.

/// Sentinel for "no state" / "no edge".
pub const NONE: u32 = u32::MAX;

/// States with at least this many transitions are looked up through the hash table.
pub const HASHED_DEGREE: u32 = 4;

/// States with at least this many transitions also list their edges in one array (a *hub* list),
/// so that enumerating their children (which drafting does for every kid it scores) issues
/// independent loads instead of chasing the linked list one cache miss after another. Short
/// contexts after a break in a match are such states: a few dozen of them per 256-request draft
/// step held 40% of the children read. A hub's edges leave the linked list; its `head` is then the
/// index of its list, and its `deg` carries a flag saying so. Bulk appends ([`Sam::extend_deferred`]) leave
/// new hubs linked (moving each new edge into an array costs ingest two cache misses) and
/// [`Sam::recount`] moves them; online appends move a state when it reaches this degree.
pub const HUB_DEGREE: u32 = 16;

/// Flag in [`State::deg`]: the state's edges are in a hub list (see [`HUB_DEGREE`]).
const HUB: u32 = 1 << 31;

/// Flag of an edge reference: the edge is the first transition of the state `r & !INLINE`, stored
/// in the state. Without it, a reference is an index into [`Sam::edges`].
pub const INLINE: u32 = 1 << 31;

/// Asks the CPU to start loading `slice[i]` into cache (a hint; no effect out of range or off x86-64).
#[inline(always)]
pub fn prefetch<T>(slice: &[T], i: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(x) = slice.get(i) {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch of a valid reference; SSE is part of the x86-64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(x as *const T as *const i8) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (slice, i);
}

/// One equivalence class of the automaton.
#[derive(Clone, Copy, Debug)]
pub struct State {
    /// Length of the longest substring of this class. Invariant: `len > len(link)`.
    pub len: u32,
    /// Suffix link; `NONE` only for the root (state 0).
    pub link: u32,
    /// Most recent transition in the arena other than the first, `NONE` when there is none; for
    /// a hub (see [`HUB_DEGREE`]) the index of its hub list instead.
    head: u32,
    /// Weighted number of end positions (occurrences) of the class's substrings.
    pub cnt: f32,
    /// Clock value of the most recent occurrence (0 = never, e.g. the root before any append).
    pub recent: u32,
    /// Number of outgoing transitions ([`State::degree`]), with the flag [`HUB`] when they are in
    /// a hub list.
    deg: u32,
    /// Token of the first (oldest) transition; meaningful when the degree is at least 1.
    tok0: u32,
    /// Target of the first transition.
    to0: u32,
}

impl State {
    /// Number of outgoing transitions.
    #[inline]
    pub fn degree(&self) -> u32 {
        self.deg & !HUB
    }

    /// Whether the state has a transition.
    #[inline]
    pub fn has_children(&self) -> bool {
        self.deg != 0
    }

    /// The arena edge to prefetch before enumerating the transitions: the first linked edge,
    /// `NONE` (nothing) for a state with one transition (it is in the state) and for a hub, whose
    /// edges are not on one line anyway.
    #[inline]
    fn first_edge(&self) -> u32 {
        if self.is_hub() {
            NONE
        } else {
            self.head
        }
    }

    /// The first transition `(token, target)`, stored in the state; `None` without transitions.
    #[inline]
    pub fn first_child(&self) -> Option<(u32, u32)> {
        self.has_children().then_some((self.tok0, self.to0))
    }

    fn new(len: u32, link: u32, cnt: f32, recent: u32) -> State {
        State {
            len,
            link,
            head: NONE,
            cnt,
            recent,
            deg: 0,
            tok0: 0,
            to0: NONE,
        }
    }

    /// Whether the transitions are in a hub list (`head` indexes it).
    #[inline]
    fn is_hub(&self) -> bool {
        self.deg & HUB != 0
    }
}

/// One transition `from --tok--> to` in the arena, a node of `from`'s child list.
#[derive(Clone, Copy, Debug)]
pub struct Edge {
    /// Token labelling the transition.
    pub tok: u32,
    /// Target state.
    pub to: u32,
    /// Next edge of the same source state, `NONE` at the end of the list.
    pub next: u32,
}

/// The automaton. State 0 is the root (the empty string).
#[derive(Clone, Debug)]
pub struct Sam {
    /// All states; index = state id.
    pub states: Vec<State>,
    /// Every transition but the states' first ones (which are in the states); never removed,
    /// only redirected (`to` changes when a state is cloned).
    pub edges: Vec<Edge>,
    /// Per state: the weight of the positions whose longest string ends exactly there (the
    /// leaves of `cnt`) and the clock of the latest one; [`Sam::recount`] sums them.
    own: Vec<(f32, u32)>,
    /// Open-addressing index over the edges of states with at least [`HASHED_DEGREE`] transitions.
    slots: Vec<Slot>,
    /// Number of occupied `slots`.
    hashed: usize,
    /// Logical clock, advanced by one per appended token.
    pub clock: u32,
    /// Edge ids of each state with at least [`HUB_DEGREE`] transitions, in creation order; a hub
    /// state's `head` indexes this.
    hubs: Vec<Vec<u32>>,
    /// Bytes held by `hubs` (kept up to date, as [`Sam::bytes`] is asked after every append).
    hub_bytes: usize,
    /// Number of transitions (inline and in the arena).
    num_edges: usize,
    /// Bulk appends since the last recount: states reaching [`HUB_DEGREE`] stay linked till then.
    bulk: bool,
}

/// One entry of the transition table: `from --tok-->` is the edge reference `edge`; `edge == NONE`
/// when empty.
#[derive(Clone, Copy, Debug)]
struct Slot {
    from: u32,
    tok: u32,
    edge: u32,
}

const EMPTY: Slot = Slot {
    from: 0,
    tok: 0,
    edge: NONE,
};

/// `(edge id, edge)` along a linked list of edges from `e`.
#[inline]
fn linked(edges: &[Edge], mut e: u32) -> impl Iterator<Item = (u32, &Edge)> + '_ {
    std::iter::from_fn(move || {
        (e != NONE).then(|| {
            let id = e;
            let edge = &edges[id as usize];
            e = edge.next;
            (id, edge)
        })
    })
}

#[inline]
fn mix(from: u32, tok: u32) -> u64 {
    // A fixed (unseeded) 64-bit mixer: the same (state, token) hashes identically in every process,
    // which keeps every replica of the index deterministic.
    let mut h = ((from as u64) << 32 | tok as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

impl Default for Sam {
    fn default() -> Self {
        Self::new()
    }
}

impl Sam {
    /// An automaton holding only the root.
    pub fn new() -> Self {
        Sam {
            states: vec![State::new(0, NONE, 0.0, 0)],
            edges: Vec::new(),
            own: vec![(0.0, 0)],
            slots: vec![EMPTY; 16],
            hashed: 0,
            clock: 0,
            hubs: Vec::new(),
            hub_bytes: 0,
            num_edges: 0,
            bulk: false,
        }
    }

    /// Adds a state without transitions; its id.
    fn push_state(&mut self, len: u32, link: u32, cnt: f32, recent: u32) -> u32 {
        let id = self.states.len() as u32;
        debug_assert!(id < INLINE, "state ids must leave the INLINE bit free");
        self.states.push(State::new(len, link, cnt, recent));
        self.own.push((0.0, 0));
        id
    }

    /// Bytes held by the automaton's buffers (capacity, not just length).
    pub fn bytes(&self) -> usize {
        self.states.capacity() * std::mem::size_of::<State>()
            + self.edges.capacity() * std::mem::size_of::<Edge>()
            + self.slots.capacity() * std::mem::size_of::<Slot>()
            + self.own.capacity() * std::mem::size_of::<(f32, u32)>()
            + self.hub_bytes
    }

    /// Number of transitions of `s`.
    #[inline]
    pub fn degree(&self, s: u32) -> u32 {
        self.states[s as usize].degree()
    }

    /// Number of states (the root included).
    pub fn num_states(&self) -> usize {
        self.states.len()
    }

    /// Number of transitions.
    pub fn num_edges(&self) -> usize {
        self.num_edges
    }

    /// `(token, target)` of the edge reference `r`.
    #[inline]
    fn edge(&self, r: u32) -> (u32, u32) {
        if r & INLINE != 0 {
            let st = &self.states[(r & !INLINE) as usize];
            (st.tok0, st.to0)
        } else {
            let e = &self.edges[r as usize];
            (e.tok, e.to)
        }
    }

    /// Points the edge reference `r` at `to`.
    fn set_target(&mut self, r: u32, to: u32) {
        if r & INLINE != 0 {
            self.states[(r & !INLINE) as usize].to0 = to;
        } else {
            self.edges[r as usize].to = to;
        }
    }

    /// The edge reference of `from --tok-->`, if any.
    #[inline]
    pub fn find(&self, from: u32, tok: u32) -> Option<u32> {
        let st = &self.states[from as usize];
        if st.degree() < HASHED_DEGREE {
            if st.has_children() && st.tok0 == tok {
                return Some(INLINE | from);
            }
            return linked(&self.edges, st.head)
                .find(|(_, edge)| edge.tok == tok)
                .map(|(e, _)| e);
        }
        let mask = self.slots.len() - 1;
        let mut i = (mix(from, tok) as usize) & mask;
        loop {
            let s = self.slots[i];
            if s.edge == NONE {
                return None;
            }
            if s.from == from && s.tok == tok {
                return Some(s.edge);
            }
            i = (i + 1) & mask;
        }
    }

    /// The target of `from --tok-->`, if any.
    #[inline]
    pub fn next_state(&self, from: u32, tok: u32) -> Option<u32> {
        self.find(from, tok).map(|r| self.edge(r).1)
    }

    fn insert_slot(slots: &mut [Slot], from: u32, tok: u32, edge: u32) {
        let mask = slots.len() - 1;
        let mut i = (mix(from, tok) as usize) & mask;
        while slots[i].edge != NONE {
            i = (i + 1) & mask;
        }
        slots[i] = Slot { from, tok, edge };
    }

    /// Where the transitions of `s` are: its hub list (oldest first; empty when not a hub), the
    /// first edge of its linked list (`NONE` for a hub) and its inline edge's reference (`NONE`
    /// for a hub, whose list holds it, and for a state without transitions). The linked list, then
    /// the inline edge, is most recent first.
    #[inline]
    fn lists(&self, s: u32) -> (&[u32], u32, u32) {
        let st = &self.states[s as usize];
        if st.is_hub() {
            (&self.hubs[st.head as usize], NONE, NONE)
        } else if st.has_children() {
            (&[], st.head, INLINE | s)
        } else {
            (&[], NONE, NONE)
        }
    }

    /// The edge references of `s`, most recently created first.
    fn edge_refs(&self, s: u32) -> impl Iterator<Item = u32> + '_ {
        let (hub, head, inline) = self.lists(s);
        hub.iter()
            .rev()
            .copied()
            .chain(linked(&self.edges, head).map(|(e, _)| e))
            .chain((inline != NONE).then_some(inline))
    }

    fn add_edge(&mut self, from: u32, tok: u32, to: u32) {
        self.num_edges += 1;
        let st = &mut self.states[from as usize];
        st.deg += 1;
        let deg = st.degree();
        let id = if deg == 1 {
            // The first transition goes into the state (a hub has more than one).
            st.tok0 = tok;
            st.to0 = to;
            INLINE | from
        } else {
            let id = self.edges.len() as u32;
            debug_assert!(id < INLINE, "edge ids must leave INLINE free");
            // A hub lists the new edge; otherwise it becomes the head of the linked list.
            let next = if st.is_hub() {
                let ids = &mut self.hubs[st.head as usize];
                let cap = ids.capacity();
                ids.push(id);
                self.hub_bytes += (ids.capacity() - cap) * 4;
                NONE
            } else {
                std::mem::replace(&mut st.head, id)
            };
            self.edges.push(Edge { tok, to, next });
            id
        };
        if deg == HUB_DEGREE && !self.bulk {
            self.make_hub(from);
        }
        if deg < HASHED_DEGREE {
            return;
        }
        // The state joins the table with all its transitions, or adds the new one.
        let joining = if deg == HASHED_DEGREE {
            deg as usize
        } else {
            1
        };
        if (self.hashed + joining) * 4 > self.slots.len() * 3 {
            self.grow_slots(self.hashed + joining);
        }
        if joining == 1 {
            Self::insert_slot(&mut self.slots, from, tok, id);
        } else {
            let mut refs = [NONE; HASHED_DEGREE as usize];
            for (r, e) in refs.iter_mut().zip(self.edge_refs(from)) {
                *r = e;
            }
            for r in refs {
                let tok = self.edge(r).0;
                Self::insert_slot(&mut self.slots, from, tok, r);
            }
        }
        self.hashed += joining;
    }

    /// Moves the edges of `s` (linked and inline) into a hub list, oldest first.
    fn make_hub(&mut self, s: u32) {
        let mut ids: Vec<u32> = self.edge_refs(s).collect();
        ids.reverse();
        self.hub_bytes += ids.capacity() * 4 + std::mem::size_of::<Vec<u32>>();
        let st = &mut self.states[s as usize];
        st.head = self.hubs.len() as u32;
        st.deg |= HUB;
        self.hubs.push(ids);
    }

    /// Rebuilds the table with room for `need` entries at a load of at most 3/4.
    fn grow_slots(&mut self, need: usize) {
        let mut size = self.slots.len() * 2;
        while need * 4 > size * 3 {
            size *= 2;
        }
        let mut slots = vec![EMPTY; size];
        for (from, st) in self.states.iter().enumerate() {
            if st.degree() >= HASHED_DEGREE {
                for r in self.edge_refs(from as u32) {
                    Self::insert_slot(&mut slots, from as u32, self.edge(r).0, r);
                }
            }
        }
        self.slots = slots;
    }

    fn clone_state(&mut self, q: u32, len: u32) -> u32 {
        let src = self.states[q as usize];
        let id = self.push_state(len, src.link, src.cnt, src.recent);
        // The clone gets the same transitions, added most recent first (walked by index rather
        // than with `edge_refs`, which would borrow the lists while `add_edge` grows them).
        if src.is_hub() {
            let hub = src.head as usize;
            for i in (0..self.hubs[hub].len()).rev() {
                let (tok, to) = self.edge(self.hubs[hub][i]);
                self.add_edge(id, tok, to);
            }
        } else {
            let mut e = src.head;
            while e != NONE {
                let edge = self.edges[e as usize];
                self.add_edge(id, edge.tok, edge.to);
                e = edge.next;
            }
            if let Some((tok, to)) = src.first_child() {
                self.add_edge(id, tok, to);
            }
        }
        id
    }

    /// Redirect `p --c--> q` to `clone` along the suffix links of `p` while they point at `q`.
    fn redirect(&mut self, mut p: u32, c: u32, q: u32, clone: u32) {
        while p != NONE {
            match self.find(p, c) {
                Some(r) if self.edge(r).1 == q => {
                    self.set_target(r, clone);
                    p = self.states[p as usize].link;
                }
                _ => break,
            }
        }
    }

    /// Appends token `c` to the string whose current last state is `last`, records one occurrence
    /// of weight `w` for every suffix of the extended string, and returns the new last state.
    /// Requires `cnt`/`recent` to be current (no deferred appends since the last recount).
    /// Amortized O(1) automaton work plus the length of the new state's suffix-link path.
    pub fn extend(&mut self, last: u32, c: u32, w: f32) -> u32 {
        let new = self.extend_uncounted(last, c, w);
        let clock = self.clock;
        let mut v = new;
        while v != NONE {
            v = self.count_step(v, w, clock);
        }
        new
    }

    /// One state of the count walk of [`Sam::extend`]: records an occurrence of weight `w` at
    /// logical time `clock` at state `v` and returns its suffix link (`NONE` after the root).
    #[inline]
    pub fn count_step(&mut self, v: u32, w: f32, clock: u32) -> u32 {
        let s = &mut self.states[v as usize];
        s.cnt += w;
        s.recent = clock;
        s.link
    }

    /// Like [`Sam::extend`] but records the occurrence only at the new state (`own`): `cnt` and
    /// `recent` are stale until [`Sam::recount`]. Bulk loads use this and recount once.
    pub fn extend_deferred(&mut self, last: u32, c: u32, w: f32) -> u32 {
        self.bulk = true;
        self.extend_uncounted(last, c, w)
    }

    /// The new position of [`Sam::extend`], its weight recorded only at the new state. Online,
    /// the caller then records the occurrence along the new state's suffix-link path with
    /// [`Sam::count_step`], from the returned state to the root, before anything else changes
    /// the automaton (split from [`Sam::extend`] so that a batch can overlap the cache misses of
    /// several groups' walks).
    pub fn extend_uncounted(&mut self, last: u32, c: u32, w: f32) -> u32 {
        let new = self.extend_structure(last, c);
        self.clock = self.clock.wrapping_add(1).max(1);
        let own = &mut self.own[new as usize];
        own.0 += w;
        own.1 = self.clock;
        new
    }

    /// Recomputes `cnt` and `recent` of every state from `own`/`own_recent` (sums and maxima over
    /// the suffix-link tree), in O(states) with a counting sort by `len`, and moves the states that
    /// reached [`HUB_DEGREE`] meanwhile into hub lists.
    pub fn recount(&mut self) {
        self.bulk = false;
        for s in 0..self.states.len() {
            let st = &self.states[s];
            if !st.is_hub() && st.degree() >= HUB_DEGREE {
                self.make_hub(s as u32);
            }
        }
        self.compact_edges();
        let max_len = self.states.iter().map(|s| s.len).max().unwrap_or(0) as usize;
        let mut start = vec![0u32; max_len + 2];
        for s in &self.states {
            start[s.len as usize + 1] += 1;
        }
        for i in 1..start.len() {
            start[i] += start[i - 1];
        }
        let mut order = vec![0u32; self.states.len()];
        for (i, (s, &(own, own_recent))) in self.states.iter_mut().zip(&self.own).enumerate() {
            s.cnt = own;
            s.recent = own_recent;
            let b = &mut start[s.len as usize];
            order[*b as usize] = i as u32;
            *b += 1;
        }
        for &v in order.iter().rev() {
            let s = self.states[v as usize];
            if s.link != NONE {
                let l = &mut self.states[s.link as usize];
                l.cnt += s.cnt;
                l.recent = l.recent.max(s.recent);
            }
        }
    }

    /// Renumbers the arena so that every state's edges are consecutive, in the order they are
    /// enumerated (a hub's in its list's order, others along their linked list), and states'
    /// edges follow each other in state order. Bulk appends create a state's transitions at
    /// different times, scattered over the arena; enumerating them while drafting then chased one
    /// cache miss (and often one TLB miss) per edge. Afterwards the edges of a state share one or
    /// two cache lines. Enumeration order, and so every draft, is unchanged; online appends after
    /// this add their edges at the end as before.
    fn compact_edges(&mut self) {
        let n = self.edges.len();
        if n == 0 {
            return;
        }
        // One pass lays the edges out and rewrites the state heads, the lists' links and the hub
        // lists as it goes; `new_id` is only needed for the transition table.
        let mut new_id = vec![NONE; n];
        let mut edges: Vec<Edge> = Vec::with_capacity(self.edges.capacity());
        for s in 0..self.states.len() {
            let st = self.states[s];
            if st.is_hub() {
                let list = &mut self.hubs[st.head as usize];
                for r in list.iter_mut().rev() {
                    if *r & INLINE == 0 {
                        let id = edges.len() as u32;
                        new_id[*r as usize] = id;
                        // A hub's edges left the linked list: their `next` is not read.
                        edges.push(Edge {
                            next: NONE,
                            ..self.edges[*r as usize]
                        });
                        *r = id;
                    }
                }
            } else if st.head != NONE {
                self.states[s].head = edges.len() as u32;
                for (e, edge) in linked(&self.edges, st.head) {
                    let id = edges.len() as u32;
                    new_id[e as usize] = id;
                    let next = if edge.next == NONE { NONE } else { id + 1 };
                    edges.push(Edge { next, ..*edge });
                }
            }
        }
        debug_assert_eq!(edges.len(), n, "every arena edge is in exactly one list");
        let map = |r: u32| {
            if r == NONE || r & INLINE != 0 {
                r
            } else {
                new_id[r as usize]
            }
        };
        for slot in &mut self.slots {
            slot.edge = map(slot.edge);
        }
        self.edges = edges;
    }

    fn extend_structure(&mut self, last: u32, c: u32) -> u32 {
        let last_len = self.states[last as usize].len;
        if let Some(r) = self.find(last, c) {
            // Generalized case: the extended string already occurs.
            let q = self.edge(r).1;
            if self.states[q as usize].len == last_len + 1 {
                return q;
            }
            let clone = self.clone_state(q, last_len + 1);
            self.states[q as usize].link = clone;
            self.redirect(last, c, q, clone);
            return clone;
        }
        let cur = self.push_state(last_len + 1, 0, 0.0, 0);
        let mut p = last;
        let mut target = NONE;
        while p != NONE {
            if let Some(r) = self.find(p, c) {
                target = self.edge(r).1;
                break;
            }
            self.add_edge(p, c, cur);
            p = self.states[p as usize].link;
        }
        if p != NONE {
            let q = target;
            if self.states[p as usize].len + 1 == self.states[q as usize].len {
                self.states[cur as usize].link = q;
            } else {
                let clone = self.clone_state(q, self.states[p as usize].len + 1);
                self.redirect(p, c, q, clone);
                self.states[q as usize].link = clone;
                self.states[cur as usize].link = clone;
            }
        }
        cur
    }

    /// Walks `tokens` from the root along transitions; the state of the whole string, if it occurs.
    pub fn walk(&self, tokens: &[u32]) -> Option<u32> {
        let mut s = 0u32;
        for &t in tokens {
            s = self.next_state(s, t)?;
        }
        Some(s)
    }

    /// Iterates the outgoing edges `(token, target)` of `s` (most recently created first).
    pub fn children(&self, s: u32) -> ChildIter<'_> {
        let (hub, e, inline) = self.lists(s);
        ChildIter {
            sam: self,
            e,
            hub,
            inline: (inline != NONE).then(|| self.edge(inline)),
        }
    }

    /// The most frequent transition `(token, target)` of `s` (ties go to the smaller token);
    /// `None` when `s` has none.
    #[cfg(test)]
    pub fn most_frequent_child(&self, s: u32) -> Option<(u32, u32)> {
        self.children(s).max_by(|x, y| {
            let (cx, cy) = (self.states[x.1 as usize].cnt, self.states[y.1 as usize].cnt);
            cx.total_cmp(&cy).then(y.0.cmp(&x.0))
        })
    }

    /// Starts loading the first linked edge of `s`, which enumerating its children reads first
    /// (nothing when its only transition is in the state, or for a hub). Prefetching the only
    /// child's state here as well, before the node is even chosen, was slower in paired runs.
    #[inline]
    pub fn prefetch_expansion(&self, s: u32) {
        prefetch(&self.edges, self.states[s as usize].first_edge() as usize);
    }

    /// The first state on the suffix-link path of `s` (itself included) that has a continuation and
    /// represents a suffix of length at least `min_len`; `None` when there is none.
    pub fn longest_with_children(&self, mut s: u32, min_len: u32) -> Option<u32> {
        while s != NONE {
            let st = &self.states[s as usize];
            if st.len < min_len {
                return None;
            }
            if st.has_children() {
                return Some(s);
            }
            s = st.link;
        }
        None
    }
}

/// Iterator over `(token, target)` of one state's transitions, most recent first.
pub struct ChildIter<'a> {
    sam: &'a Sam,
    /// Next edge of the linked list (`NONE`: done, or a hub).
    e: u32,
    /// A hub's edge references not yet visited, iterated from the back (most recent first).
    hub: &'a [u32],
    /// The state's inline (first) transition, last of a state that is not a hub.
    inline: Option<(u32, u32)>,
}

impl Iterator for ChildIter<'_> {
    type Item = (u32, u32);
    #[inline]
    fn next(&mut self) -> Option<(u32, u32)> {
        if let Some((&r, rest)) = self.hub.split_last() {
            self.hub = rest;
            return Some(self.sam.edge(r));
        }
        if self.e == NONE {
            return self.inline.take();
        }
        let edge = &self.sam.edges[self.e as usize];
        self.e = edge.next;
        Some((edge.tok, edge.to))
    }
}

#[cfg(test)]
mod tests;
