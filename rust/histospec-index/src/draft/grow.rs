//! Best-first growth of one draft, and of a batch of drafts with their memory accesses
//! interleaved.

use super::estimate::{by_p, estimate, mix_pointer, one_child_estimate, Kid};
use super::frontier::{Cand, Frontier};
use super::{DraftConfig, Node};
use crate::follow::Log;
use crate::sam::{prefetch, Sam, NONE};

/// A request's source pointer as the drafter sees it: the clock of the source token predicted
/// next (`NONE`: none) in the group's `log`, the weight of its prediction at the root, and the
/// weight of each later prediction along its path.
#[derive(Clone, Copy)]
pub struct Pointer<'a> {
    pub log: &'a Log,
    pub pred: u32,
    pub weight: f32,
    pub then: f32,
}

/// Requests whose growth a batch interleaves. Each expansion of a tree node waits on two cache
/// misses (the node's transitions, then its children's states); while one request waits, the
/// others compute. Chosen with `histospec-sgl bench index` (batch draft time, 256 requests).
pub const LANES: usize = 8;

/// Everything one growth reads besides its scratch space.
#[derive(Clone, Copy)]
pub struct Job<'a> {
    pub sam: &'a Sam,
    /// The last context token (node 0).
    pub root_tok: u32,
    /// The root's matched state (`NONE`: nothing to draft but the pointer's prediction).
    pub anchor: u32,
    pub pointer: Option<Pointer<'a>>,
    /// Most nodes, root included.
    pub budget: usize,
    /// One child per node.
    pub chain: bool,
    /// Weight of one occurrence of the newest version (scales `escape`).
    pub w_new: f32,
}

/// The expansion of one node: the children of `state` (`NONE`: none) mixed with the pointer's
/// prediction at clock `ptr.0` with weight `ptr.1`, under node `parent` of probability `pprob`.
#[derive(Clone, Copy)]
pub(super) struct Step {
    pub state: u32,
    pub ptr: Option<(u32, f32)>,
    pub parent: u32,
    pub pprob: f32,
}

impl Step {
    /// The root's expansion: the anchor's children and the pointer's first prediction.
    pub fn root(job: &Job) -> Option<Self> {
        let ptr = job
            .pointer
            .and_then(|p| (p.pred != NONE).then_some((p.pred, p.weight)));
        (job.anchor != NONE || ptr.is_some()).then_some(Step {
            state: job.anchor,
            ptr,
            parent: 0,
            pprob: 1.0,
        })
    }

    /// The expansion of node `parent` (probability `pprob`), taken from a candidate with
    /// automaton state `state` and pointer clock `ptr`: its state, or when that has no
    /// continuation the longest suffix that has one, and the pointer's path going on with the
    /// source's next token. `None` when neither has anything to offer.
    #[inline]
    pub fn of(
        job: &Job,
        cfg: &DraftConfig,
        parent: u32,
        pprob: f32,
        state: u32,
        ptr: u32,
    ) -> Option<Self> {
        let sam = job.sam;
        let st = if state == NONE {
            NONE
        } else if sam.states[state as usize].has_children() {
            state
        } else {
            sam.longest_with_children(sam.states[state as usize].link, cfg.min_match)
                .unwrap_or(NONE)
        };
        let ptr = match job.pointer {
            Some(p) if ptr != NONE => {
                let n = p.log.next(ptr);
                (n != NONE).then_some((n, p.then))
            }
            _ => None,
        };
        if st == NONE && ptr.is_none() {
            return None;
        }
        Some(Step {
            state: st,
            ptr,
            parent,
            pprob,
        })
    }

    /// Whether the expansion reads at most one child of its state, which mostly sits next to the
    /// state (a response's states and log entries are created in order): such an expansion runs
    /// at once instead of yielding while its children load.
    #[inline(always)]
    fn near(&self, sam: &Sam) -> bool {
        self.state == NONE || sam.degree(self.state) <= 1
    }

    /// The candidates of a near expansion ([`Step::near`]): the state's child with the pointer's
    /// mixture, and the pointer's token when it is another. The same as [`collect_kids`] lists.
    #[inline(always)]
    fn near_kids(&self, job: &Job, cfg: &DraftConfig) -> (Option<Kid>, Option<Kid>) {
        let mut kid = if self.state == NONE {
            None
        } else {
            one_child_estimate(job.sam, self.state, job.w_new, cfg)
        };
        let mut other = None;
        if let (Some((clock, lam)), Some(pt)) = (self.ptr, job.pointer) {
            if let Some(e) = pt.log.get(clock) {
                match kid.as_mut() {
                    Some(k) => {
                        k.p *= 1.0 - lam;
                        if k.tok == e.tok {
                            // At most 1 after rounding (as mix_pointer): no node is more
                            // probable than its parent.
                            k.p = (k.p + lam).min(1.0);
                            k.ptr = clock;
                        } else {
                            other = Some(Kid::pointer(e.tok, clock, lam));
                        }
                    }
                    None => kid = Some(Kid::pointer(e.tok, clock, lam)),
                }
            }
        }
        (kid, other)
    }
}

/// The candidates of expansion `st`, in `kids`: the children of its state with their estimates,
/// mixed with the pointer's prediction.
fn collect_kids(kids: &mut Vec<Kid>, job: &Job, cfg: &DraftConfig, st: &Step) {
    kids.clear();
    if st.state != NONE {
        estimate(kids, job.sam, st.state, job.w_new, cfg);
    }
    if let (Some((clock, lam)), Some(pt)) = (st.ptr, job.pointer) {
        mix_pointer(kids, pt.log, clock, lam);
    }
}

/// How a tree growth goes on after taking a node ([`Growth::take`]).
enum Flow {
    /// Expand the node (the expansion is in the caller's `step`).
    Expand,
    /// The same, after the other lanes had their turn (the expansion is in `Growth::pending`).
    Yield,
    /// Nothing to expand: take the frontier's best candidate next.
    Pop,
    /// The draft is complete.
    Stop,
}

/// Scratch space and progress of one growing draft.
#[derive(Default)]
pub(super) struct Growth {
    heap: Frontier,
    kids: Vec<Kid>,
    /// Nodes in growth order (parents before children), then reordered to BFS.
    pub nodes: Vec<Node>,
    pub depth: Vec<u32>,
    order: Vec<u32>,
    remap: Vec<u32>,
    pub out: Vec<Node>,
    pending: Option<Step>,
    seq: u32,
}

/// Reusable scratch space for drafting, so a batch call allocates nothing per request.
pub struct Drafter {
    lanes: Vec<Growth>,
    /// Whether batch calls interleave their requests ([`Drafter::grow_many`]); off, they grow one
    /// request after the other (the same drafts; for paired timing).
    pub interleave: bool,
}

impl Default for Drafter {
    fn default() -> Self {
        Drafter {
            lanes: Vec::new(),
            interleave: true,
        }
    }
}

impl Drafter {
    /// Grows one job to completion; the nodes in BFS order, unpadded.
    pub fn grow_job(&mut self, job: &Job, cfg: &DraftConfig) -> &[Node] {
        if self.lanes.is_empty() {
            self.lanes.push(Growth::default());
        }
        let g = &mut self.lanes[0];
        g.begin(job);
        while !g.advance(job, cfg) {}
        &g.out
    }

    /// Grows the drafts of `n` requests, [`LANES`] at a time with their memory accesses
    /// interleaved, and hands each result to `emit(i, nodes)` (in completion order). `job(i)`
    /// describes request `i`; when interleaving, `ahead(i)` is called before `job(i)`, early enough
    /// to prefetch what `job(i)` will read. The drafts are exactly those of [`Drafter::grow_job`].
    pub fn grow_many<'a>(
        &mut self,
        n: usize,
        cfg: &DraftConfig,
        mut job: impl FnMut(usize) -> Job<'a>,
        mut ahead: impl FnMut(usize),
        mut emit: impl FnMut(usize, &[Node]),
    ) {
        if !self.interleave {
            for i in 0..n {
                let j = job(i);
                emit(i, self.grow_job(&j, cfg));
            }
            return;
        }
        if self.lanes.len() < LANES {
            self.lanes.resize_with(LANES, Growth::default);
        }
        // Per lane: the request it grows, its job, and whether its next move is the prefetch.
        let mut slots: [Option<(usize, Job<'a>, bool)>; LANES] = [None; LANES];
        for i in 0..n.min(2 * LANES) {
            ahead(i);
        }
        let mut next = 0;
        let mut busy = 0;
        loop {
            for (lane, slot) in self.lanes.iter_mut().zip(slots.iter_mut()) {
                if slot.is_none() && next < n {
                    if next + 2 * LANES < n {
                        ahead(next + 2 * LANES);
                    }
                    let j = job(next);
                    lane.begin(&j);
                    *slot = Some((next, j, true));
                    next += 1;
                    busy += 1;
                    continue;
                }
                let Some((i, j, touch)) = slot.as_mut() else {
                    continue;
                };
                if *touch {
                    lane.touch(j);
                    *touch = false;
                } else if lane.advance(j, cfg) {
                    emit(*i, &lane.out);
                    *slot = None;
                    busy -= 1;
                } else {
                    *touch = true;
                }
            }
            if busy == 0 && next >= n {
                break;
            }
        }
    }
}

impl Growth {
    /// Starts growing `job`: the root node, and the root's expansion pending.
    fn begin(&mut self, job: &Job) {
        self.heap.clear();
        self.nodes.clear();
        self.depth.clear();
        self.seq = 0;
        self.nodes.push(Node {
            tok: job.root_tok,
            parent: NONE,
            prob: 1.0,
        });
        self.depth.push(0);
        if job.anchor != NONE {
            job.sam.prefetch_expansion(job.anchor);
        }
        self.pending = Step::root(job);
    }

    /// Prefetches what the pending expansion reads: its state's child states and the pointer's
    /// log entry.
    fn touch(&self, job: &Job) {
        let Some(p) = &self.pending else { return };
        let sam = job.sam;
        if p.state != NONE {
            for (_, to) in sam.children(p.state) {
                prefetch(&sam.states, to as usize);
            }
        }
        if let (Some((clock, _)), Some(ptr)) = (p.ptr, job.pointer) {
            ptr.log.prefetch(clock);
        }
    }

    /// Runs the pending expansion, then takes the best candidates as nodes until one has
    /// something to expand that is not near (false: call again) or the draft is complete (true:
    /// `out` holds it).
    fn advance(&mut self, job: &Job, cfg: &DraftConfig) -> bool {
        if job.chain {
            return self.advance_chain(job, cfg);
        }
        let per_node = cfg.max_children as usize;
        // Kept in a local while the growth runs on without yielding (stored and reloaded through
        // `self` at every node, it waited on the store).
        let mut step = self.pending.take();
        // (With a budget of one node, the root's expansion could not become a node either.)
        while self.nodes.len() < job.budget {
            let mut flow = Flow::Pop;
            if let Some(st) = step.take() {
                // Each source of the next node (the expansion's lone candidate, or the frontier)
                // hands its candidate to `take` at its own call site: merged into one
                // `Option<Cand>` first, the candidate went through the stack and its reload waited
                // on the stores.
                if let Some(c) = self.offer(job, cfg, st, per_node) {
                    flow = self.take(job, cfg, c, &mut step);
                }
            }
            while let Flow::Pop = flow {
                flow = match self.heap.pop() {
                    Some(c) => self.take(job, cfg, c, &mut step),
                    None => Flow::Stop,
                };
            }
            match flow {
                Flow::Yield => return false,
                Flow::Stop => break,
                Flow::Pop | Flow::Expand => {}
            }
        }
        self.reorder_bfs();
        true
    }

    /// Takes candidate `c` as the next node and says how the growth goes on: its expansion
    /// (in `step`, or in `self.pending` to yield first), the frontier's next candidate when it
    /// has nothing to expand, or the end (the budget is spent, or `c` is below `min_prob`).
    #[inline(always)]
    fn take(&mut self, job: &Job, cfg: &DraftConfig, c: Cand, step: &mut Option<Step>) -> Flow {
        if c.score < cfg.min_prob || c.score <= 0.0 {
            return Flow::Stop;
        }
        let sam = job.sam;
        let id = self.nodes.len() as u32;
        self.nodes.push(Node {
            tok: c.tok,
            parent: c.parent,
            prob: c.score,
        });
        self.depth.push(self.depth[c.parent as usize] + 1);
        if self.nodes.len() >= job.budget {
            // The budget is spent: what this node would offer can never become a node.
            return Flow::Stop;
        }
        let Some(st) = Step::of(job, cfg, id, c.score, c.state, c.ptr) else {
            return Flow::Pop;
        };
        // `c.state`'s transitions were prefetched when it was offered; a fallback state's were
        // not.
        if st.state != NONE && st.state != c.state {
            sam.prefetch_expansion(st.state);
        }
        if !st.near(sam) {
            self.pending = Some(st);
            return Flow::Yield;
        }
        *step = Some(st);
        Flow::Expand
    }

    /// [`Growth::advance`] for a chain: the same nodes as a tree growth offering one child per
    /// node, without the frontier heap (it never holds more than one candidate) or the BFS
    /// reordering (a chain is in BFS order). It yields only before expanding a state with several
    /// transitions.
    fn advance_chain(&mut self, job: &Job, cfg: &DraftConfig) -> bool {
        let sam = job.sam;
        let mut step = self.pending.take();
        while self.nodes.len() < job.budget {
            let Some(st) = step.take() else { break };
            // The first of `offer`'s order.
            let k = if st.near(sam) {
                let (Some(k), other) = st.near_kids(job, cfg) else {
                    break;
                };
                match other {
                    Some(o) if by_p(&o, &k).is_lt() => o,
                    _ => k,
                }
            } else {
                collect_kids(&mut self.kids, job, cfg, &st);
                let Some(k) = self.kids.iter().copied().min_by(by_p) else {
                    break;
                };
                k
            };
            let score = st.pprob * k.p;
            if score < cfg.min_prob || score <= 0.0 {
                break;
            }
            let id = self.nodes.len() as u32;
            self.nodes.push(Node {
                tok: k.tok,
                parent: st.parent,
                prob: score,
            });
            if self.nodes.len() >= job.budget {
                break;
            }
            let Some(next) = Step::of(job, cfg, id, score, k.to, k.ptr) else {
                break;
            };
            if !next.near(sam) {
                sam.prefetch_expansion(next.state);
                self.pending = Some(next);
                return false;
            }
            step = Some(next);
        }
        self.out.clear();
        self.out.extend_from_slice(&self.nodes);
        true
    }

    /// Offers the candidates of expansion `st` (at most `per_node`, most probable first) to the
    /// frontier. A single candidate that outranks every candidate in the frontier is returned
    /// instead of pushed: the caller takes it as the next node, as the next pop would have.
    #[inline]
    fn offer(&mut self, job: &Job, cfg: &DraftConfig, st: Step, per_node: usize) -> Option<Cand> {
        let sam = job.sam;
        if st.near(sam) {
            // A lone candidate, the usual case, never goes through `kids`.
            let (kid, other) = st.near_kids(job, cfg);
            let k = kid?;
            if other.is_none() {
                let c = self.candidate(sam, k, st.parent, st.pprob, cfg)?;
                if self.heap.peek().is_none_or(|top| c > *top) {
                    return Some(c);
                }
                self.heap.push(c);
                return None;
            }
            self.kids.clear();
            self.kids.push(k);
            self.kids.extend(other);
        } else {
            collect_kids(&mut self.kids, job, cfg, &st);
        }
        self.offer_kids(sam, st.parent, st.pprob, per_node, cfg)
    }

    /// The tail of [`Growth::offer`]: offers the candidates in `kids` (at most `per_node`, most
    /// probable first) under `parent`.
    fn offer_kids(
        &mut self,
        sam: &Sam,
        parent: u32,
        pprob: f32,
        per_node: usize,
        cfg: &DraftConfig,
    ) -> Option<Cand> {
        if self.kids.is_empty() {
            return None;
        }
        let m = per_node.min(self.kids.len());
        if m < self.kids.len() {
            self.kids.select_nth_unstable_by(m - 1, by_p);
            self.kids.truncate(m);
        }
        self.kids.sort_unstable_by(by_p);
        let lone = self.kids.len() == 1;
        for i in 0..self.kids.len() {
            let Some(c) = self.candidate(sam, self.kids[i], parent, pprob, cfg) else {
                break;
            };
            // A lone child that outranks the whole frontier is what the next pop would return:
            // hand it over without the push and the pop (most nodes of a history of similar
            // responses have one child).
            if lone && self.heap.peek().is_none_or(|top| c > *top) {
                return Some(c);
            }
            self.heap.push(c);
        }
        None
    }

    /// Kid `k` as the next candidate under `parent` (probability `pprob`), its expansion
    /// prefetched; `None` when it is below `min_prob` (and so are the kids after it, which come
    /// in order).
    #[inline(always)]
    fn candidate(
        &mut self,
        sam: &Sam,
        k: Kid,
        parent: u32,
        pprob: f32,
        cfg: &DraftConfig,
    ) -> Option<Cand> {
        let score = pprob * k.p;
        if score < cfg.min_prob {
            return None;
        }
        if k.to != NONE {
            sam.prefetch_expansion(k.to);
        }
        let c = Cand {
            score,
            seq: self.seq,
            parent,
            tok: k.tok,
            state: k.to,
            ptr: k.ptr,
        };
        self.seq += 1;
        Some(c)
    }

    /// Puts `nodes` (growth order, parents first) into BFS order in `out`: a stable sort by depth,
    /// with parent positions renumbered.
    pub(super) fn reorder_bfs(&mut self) {
        let n = self.nodes.len();
        self.order.clear();
        self.order.extend(0..n as u32);
        let depth = &self.depth;
        self.order.sort_by_key(|&i| depth[i as usize]);
        self.remap.clear();
        self.remap.resize(n, 0);
        for (new, &old) in self.order.iter().enumerate() {
            self.remap[old as usize] = new as u32;
        }
        self.out.clear();
        for &old in &self.order {
            let mut node = self.nodes[old as usize];
            if node.parent != NONE {
                node.parent = self.remap[node.parent as usize];
            }
            self.out.push(node);
        }
    }
}
