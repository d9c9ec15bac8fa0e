//! Chain and tree drafts grown from automaton states.
//!
//! Policy (tuned with `histospec-sgl bench index` and `histospec-sgl replay`):
//! 1. *Match.* The anchor is the longest suffix of the request's context that occurs elsewhere with a
//!    continuation: the request's own last state, followed along suffix links to the first state
//!    that has children. Suffixes shorter than `min_match` never anchor a draft.
//! 2. *Child estimate.* For a tree node in state `s` with children `c_1..c_m` of weighted counts
//!    `n_i` (exact occurrence counts of context+token when versions are unweighted), the frequency
//!    estimate is `n_i / (Σn + escape·w)`, where `w` is the weight of one occurrence of the
//!    group's newest version: the `escape` mass is the chance that the continuation is new, so a
//!    continuation seen once behind a long match is not taken as certain. The recency estimate gives
//!    the child of the r-th most recent occurrence `(Σn/(Σn+escape·w))·(1-β)·β^r`. A node's
//!    probability mixes both, `(1-recency)·freq + recency·rec`. The escape pseudo-count is
//!    `escape + escape_short/L` for a context of length `L` (short matches are less reliable).
//!    With `blend > 0`, the escape mass goes to the next shorter suffix that has continuations
//!    (PPM blending, up to `blend` levels), so a node also offers what shorter contexts predict.
//!    Defaults (recency 0.3, escape_short 2) were chosen on real rollouts with `histospec-sgl
//!    replay` (GRPO, expert iteration, HumanEval): +1% tokens per step. `blend = 1` adds another
//!    +2% there, but costs 5x the draft time of a 256-request batch (short contexts have many
//!    children to score) and 18% tokens per step on the synthetic W1 workload, so it is opt-in.
//! 3. *Growth.* Best-first: the frontier is a max-heap of path probabilities (product of the
//!    estimates along the path); the best candidate becomes a node until the budget is used or the
//!    best candidate falls below `min_prob`. Each node offers at most `max_children` children.
//!    A chain is the same process with one child per node; it is grown without the heap (which
//!    would never hold more than one candidate), and a state with one transition is scored
//!    without enumerating it.
//! 4. *Source following* (`follow > 0`, see [`crate::follow`]). The request keeps a pointer into
//!    the earlier string it is rewriting; the pointer's next token is mixed into each estimate
//!    along its path with a weight learned per request: `(1-λ)·estimate + λ·[token = source's]`,
//!    where λ is the share of the pointer's predictions that held when the automaton's favourite
//!    disagreed (a prior for in-step and after-a-break predictions, then the request's record).
//!    Nodes only the pointer predicts carry no automaton state and continue along the pointer.
//!    On W1 this took k=16 acceptance from 10.3 to 11.2 and d=16 tokens per step from 6.2 to 7.0;
//!    on the real rollouts +1-2% (a fixed λ of 0.9 cost them 15%, which is why it is learned).
//!    A root anchored at a hub (a match with at least [`crate::sam::HUB_DEGREE`] continuations: a short
//!    context, usually because the last token broke a longer match) drafts the pointer's path
//!    alone when the pointer's weight is at least `hub_follow` (0.1): the hub's continuations
//!    share the budget thinly, and reading each of them is most of such a root's cost. On W1 this
//!    took d=16 tokens per step from 6.82 to 6.94 and the one-thread tree step to ~0.75x; on the
//!    real rollouts it changed tokens per step by -0.14% to -0.01%.
//!    `hub_follow_degree` (16) sets how many continuations make a hub for this rule. Lower, it
//!    pays on histories where each response rewrites one earlier response (W1 at 4: d=16 tokens
//!    per step 7.05 → 7.12, tree step 0.46 → 0.35 ms) and costs the real rollouts 0.5-1.1%
//!    (bench/RESULTS.md, "Tried and not kept"), so the default stays at 16.
//! 5. *Fallback.* A node whose state has no continuation (its match reached the end of a stored
//!    string) continues from the longest suffix that has one, if that suffix is at least
//!    `min_match` long.
//! 6. *Layout.* Nodes are emitted in BFS order (parents first, root = last context token at 0).
//!    Unused slots are a chain of token-0 pads hung under the last node, so no node ever has two
//!    children with the same token (SGLang's sampling verification sums duplicate siblings).
//! 7. *Batches.* A batch call grows [`LANES`] requests at a time and alternates between them: each
//!    node expansion first prefetches the transitions' target states, then yields to the next
//!    request, and scores the children when it comes round again, so the cache misses of several
//!    requests overlap. Chains and trees yield only before a state with several transitions: a
//!    state's one child and the pointer's next token mostly sit next to what was just read (a
//!    response's states and log entries are created in order).
//!    The drafts are exactly those drafted one at a time.

use std::cmp::Ordering;

use crate::follow::Log;
use crate::sam::{prefetch, Sam, NONE};

/// Knobs of the draft policy; see the module docs for what each does.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftConfig {
    /// Shortest suffix (in tokens) that may anchor a draft or a fallback. At least 1.
    pub min_match: u32,
    /// Nodes whose estimated path probability is below this are not drafted.
    pub min_prob: f32,
    /// Pseudo-count of "something new follows", in units of one newest-version occurrence.
    pub escape: f32,
    /// Weight of the recency estimate against the frequency estimate, in [0, 1].
    pub recency: f32,
    /// Geometric decay β of the recency estimate over recency ranks, in [0, 1).
    pub recency_decay: f32,
    /// Most children a tree node offers to the frontier (a chain uses 1).
    pub max_children: u32,
    /// Share of the root's probability given to recovery hypotheses when the last token broke a
    /// longer match (it was inserted, or it replaced the token history predicted), in [0, 1).
    /// Off by default: small gains in acceptance for 10-17% more draft time.
    pub recover: f32,
    /// Shorter contexts blended into each node's estimate (PPM-style: the escape mass of a context
    /// goes to the next shorter suffix that has continuations). 0 = longest context only.
    pub blend: u32,
    /// Extra escape for short matches: a context of length `L` escapes with
    /// `escape + escape_short / L` pseudo-counts, so one occurrence behind a long match is trusted
    /// more than one behind a one-token match.
    pub escape_short: f32,
    /// Prior weight of the request's source pointer while it is in step (its last prediction
    /// held): a node's estimate becomes `(1-λ)·automaton + λ·[token = the source's next]`, where λ
    /// is the share of the request's own pointer predictions that held where the automaton's
    /// favourite said otherwise, shrunk towards this prior. 0 turns source following off.
    pub follow: f32,
    /// The same prior for the first prediction after the pointer fell out of step (its guess at
    /// where the source resumes).
    pub follow_resync: f32,
    /// A root anchored at a hub (a context with at least [`crate::sam::HUB_DEGREE`] continuations: a short
    /// match, after the last token broke a longer one) drafts the source pointer's path alone when
    /// the pointer's weight is at least this, instead of spreading the budget over the hub's many
    /// continuations (and reading each of them). 1 = never.
    pub hub_follow: f32,
    /// How many continuations make a root a hub for `hub_follow` (at least 2; default
    /// [`crate::sam::HUB_DEGREE`]). Lower values defer to the pointer at more roots: faster, and
    /// better where each response rewrites one earlier response, worse on the real rollouts.
    pub hub_follow_degree: u32,
}

impl Default for DraftConfig {
    fn default() -> Self {
        DraftConfig {
            min_match: 1,
            min_prob: 0.0,
            escape: 1.0,
            recency: 0.3,
            recency_decay: 0.5,
            max_children: 8,
            recover: 0.0,
            blend: 0,
            escape_short: 2.0,
            follow: 0.5,
            follow_resync: 0.1,
            hub_follow: 0.1,
            hub_follow_degree: crate::sam::HUB_DEGREE,
        }
    }
}

impl DraftConfig {
    /// Checks every field's domain.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_match == 0 {
            return Err("min_match must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.min_prob) {
            return Err(format!("min_prob must be in [0, 1], got {}", self.min_prob));
        }
        if !(self.escape >= 0.0 && self.escape.is_finite()) {
            return Err(format!(
                "escape must be a finite number >= 0, got {}",
                self.escape
            ));
        }
        if !(0.0..=1.0).contains(&self.recency) {
            return Err(format!("recency must be in [0, 1], got {}", self.recency));
        }
        if !(0.0..1.0).contains(&self.recency_decay) {
            return Err(format!(
                "recency_decay must be in [0, 1), got {}",
                self.recency_decay
            ));
        }
        if !(0.0..1.0).contains(&self.recover) {
            return Err(format!("recover must be in [0, 1), got {}", self.recover));
        }
        if !(self.escape_short >= 0.0 && self.escape_short.is_finite()) {
            return Err(format!(
                "escape_short must be a finite number >= 0, got {}",
                self.escape_short
            ));
        }
        if !(0.0..1.0).contains(&self.follow) {
            return Err(format!("follow must be in [0, 1), got {}", self.follow));
        }
        if !(0.0..1.0).contains(&self.follow_resync) {
            return Err(format!(
                "follow_resync must be in [0, 1), got {}",
                self.follow_resync
            ));
        }
        if !(0.0..=1.0).contains(&self.hub_follow) {
            return Err(format!(
                "hub_follow must be in [0, 1], got {}",
                self.hub_follow
            ));
        }
        if self.hub_follow_degree < 2 {
            return Err(format!(
                "hub_follow_degree must be at least 2, got {}",
                self.hub_follow_degree
            ));
        }
        if self.blend > 16 {
            return Err(format!("blend must be at most 16, got {}", self.blend));
        }
        if self.max_children == 0 {
            return Err("max_children must be at least 1".into());
        }
        Ok(())
    }
}

/// One drafted node: its token, its parent's position (`NONE` for the root) and its estimated
/// probability of being accepted (product along its path; 1 for the root, 0 for pads).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Node {
    pub tok: u32,
    pub parent: u32,
    pub prob: f32,
}

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

#[derive(Clone, Copy)]
struct Cand {
    score: f32,
    seq: u32,
    parent: u32,
    tok: u32,
    /// Automaton state of the node (`NONE`: only the pointer predicts it).
    state: u32,
    /// Clock of the node's token in the followed source (`NONE`: not on the pointer's path).
    ptr: u32,
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
struct Frontier {
    v: Vec<Cand>,
}

impl Frontier {
    fn clear(&mut self) {
        self.v.clear();
    }

    fn peek(&self) -> Option<&Cand> {
        self.v.first()
    }

    #[inline(always)]
    fn push(&mut self, c: Cand) {
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
    fn pop(&mut self) -> Option<Cand> {
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

#[derive(Clone, Copy)]
struct Kid {
    tok: u32,
    to: u32,
    cnt: f32,
    recent: u32,
    p: f32,
    ptr: u32,
}

impl Kid {
    /// A child only the pointer predicts: token `tok` at clock `clock` of the source, with the
    /// pointer's weight `lam` as its estimate.
    fn pointer(tok: u32, clock: u32, lam: f32) -> Self {
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

/// Most root anchors one growth starts from (the match and two recovery hypotheses).
pub const MAX_ANCHORS: usize = 3;

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
    /// Weighted root states; the first `n_anchors` are used (none: nothing to draft but the
    /// pointer's prediction).
    pub anchors: [(u32, f32); MAX_ANCHORS],
    pub n_anchors: usize,
    /// Per anchor, a token its children must not offer (`NONE`: none); see [`Job::avoiding`].
    pub avoid: [u32; MAX_ANCHORS],
    pub pointer: Option<Pointer<'a>>,
    /// Most nodes, root included.
    pub budget: usize,
    /// One child per node.
    pub chain: bool,
    /// Weight of one occurrence of the newest version (scales `escape`).
    pub w_new: f32,
}

impl<'a> Job<'a> {
    /// A job from an anchor slice of at most [`MAX_ANCHORS`] entries (extra ones are ignored).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        sam: &'a Sam,
        root_tok: u32,
        anchors: &[(u32, f32)],
        pointer: Option<Pointer<'a>>,
        budget: usize,
        chain: bool,
        w_new: f32,
    ) -> Self {
        let n_anchors = anchors.len().min(MAX_ANCHORS);
        let mut a = [(NONE, 0.0); MAX_ANCHORS];
        a[..n_anchors].copy_from_slice(&anchors[..n_anchors]);
        Job {
            sam,
            root_tok,
            anchors: a,
            n_anchors,
            avoid: [NONE; MAX_ANCHORS],
            pointer,
            budget,
            chain,
            w_new,
        }
    }
}

impl Job<'_> {
    /// The same job, but anchor `i` does not offer token `tok` (a recovery anchor that assumes
    /// the last token was inserted must not predict that token, which follows it only in the
    /// request's own string).
    pub fn avoiding(mut self, i: usize, tok: u32) -> Self {
        self.avoid[i] = tok;
        self
    }
}

/// The next node expansion of a growth: offer the children of `sources` (and the pointer's
/// prediction at clock `ptr.0` with weight `ptr.1`) under node `parent` of probability `pprob`.
#[derive(Clone, Copy)]
struct Pending {
    sources: [(u32, f32); MAX_ANCHORS],
    /// Per source, a token it does not offer (`NONE`: none; only root anchors have one).
    avoid: [u32; MAX_ANCHORS],
    n: usize,
    parent: u32,
    pprob: f32,
    ptr: Option<(u32, f32)>,
}

impl Pending {
    /// The pointer's prediction this expansion mixes in: (log, clock, weight).
    fn pointer<'a>(&self, job: &Job<'a>) -> Option<(&'a Log, u32, f32)> {
        match (self.ptr, job.pointer) {
            (Some((clock, lam)), Some(pt)) => Some((pt.log, clock, lam)),
            _ => None,
        }
    }
}

/// An expansion of one node from at most one state (with weight 1) and the pointer's
/// prediction: what a tree node mostly expands. Kept apart from [`Pending`] so that a growth
/// running down a chain of such nodes moves a few registers per node, not a whole `Pending`.
#[derive(Clone, Copy)]
struct Step {
    /// The state whose children are offered (`NONE`: only the pointer's prediction).
    state: u32,
    ptr: Option<(u32, f32)>,
    parent: u32,
    pprob: f32,
}

impl Step {
    /// The expansion of node `parent` (probability `pprob`), taken from a candidate with
    /// automaton state `state` and pointer clock `ptr`: its state, or when that has no
    /// continuation the longest suffix that has one, and the pointer's path going on with the
    /// source's next token. `None` when neither has anything to offer.
    #[inline]
    fn of(
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

    /// The candidates `collect_kids` lists for this expansion (one source of weight 1 with one
    /// transition, or none, and no blending): the state's child (`estimate`'s one-child case)
    /// with the pointer's mixture, and the pointer's token when it is another.
    #[inline(always)]
    fn kids(&self, job: &Job, cfg: &DraftConfig) -> (Option<Kid>, Option<Kid>) {
        let mut kid = if self.state == NONE {
            None
        } else {
            one_child_estimate(job.sam, self.state, job.w_new, cfg).map(|(k, _)| k)
        };
        let mut other = None;
        if let (Some((clock, lam)), Some(pt)) = (self.ptr, job.pointer) {
            if let Some(e) = pt.log.get(clock) {
                match kid.as_mut() {
                    Some(k) => {
                        k.p *= 1.0 - lam;
                        if k.tok == e.tok {
                            k.p += lam;
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

    /// The same expansion as a [`Pending`].
    fn pending(self) -> Pending {
        let mut sources = [(NONE, 0.0); MAX_ANCHORS];
        let n = usize::from(self.state != NONE);
        if n == 1 {
            sources[0] = (self.state, 1.0);
        }
        Pending {
            sources,
            avoid: [NONE; MAX_ANCHORS],
            n,
            parent: self.parent,
            pprob: self.pprob,
            ptr: self.ptr,
        }
    }
}

/// How a tree growth goes on after taking a node ([`Growth::take`]).
enum Flow {
    /// Expand the node (`pending` or `step` holds what).
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
struct Growth {
    heap: Frontier,
    kids: Vec<Kid>,
    /// Nodes in growth order (parents before children), then reordered to BFS.
    nodes: Vec<Node>,
    depth: Vec<u32>,
    order: Vec<u32>,
    remap: Vec<u32>,
    out: Vec<Node>,
    pending: Option<Pending>,
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
    /// Grows a draft of at most `budget` nodes (root included) from the weighted root `anchors`
    /// (matched states, at most [`MAX_ANCHORS`]; empty = nothing to draft) and the request's
    /// source `pointer`, and returns the nodes in BFS order, unpadded.
    ///
    /// `w_new` is the weight of one occurrence of the newest version (scales `escape`).
    #[allow(clippy::too_many_arguments)]
    pub fn grow(
        &mut self,
        sam: &Sam,
        root_tok: u32,
        anchors: &[(u32, f32)],
        pointer: Option<Pointer>,
        budget: usize,
        chain: bool,
        w_new: f32,
        cfg: &DraftConfig,
    ) -> &[Node] {
        let job = Job::new(sam, root_tok, anchors, pointer, budget, chain, w_new);
        self.grow_job(&job, cfg)
    }

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
        let sam = job.sam;
        for &(a, _) in &job.anchors[..job.n_anchors] {
            sam.prefetch_expansion(a);
        }
        self.pending = Some(Pending {
            sources: job.anchors,
            avoid: job.avoid,
            n: job.n_anchors,
            parent: 0,
            pprob: 1.0,
            ptr: job
                .pointer
                .and_then(|p| (p.pred != NONE).then_some((p.pred, p.weight))),
        });
    }

    /// Prefetches what the pending expansion reads: its sources' child states and the pointer's
    /// log entry.
    fn touch(&self, job: &Job) {
        let Some(p) = &self.pending else { return };
        let sam = job.sam;
        for &(s, _) in &p.sources[..p.n] {
            for (_, to) in sam.children(s) {
                prefetch(&sam.states, to as usize);
            }
        }
        if let (Some((clock, _)), Some(ptr)) = (p.ptr, job.pointer) {
            ptr.log.prefetch(clock);
        }
    }

    /// Runs the pending expansion, then takes the best candidates as nodes until one has
    /// something to expand (false: call again) or the draft is complete (true: `out` holds it).
    /// An expansion of one state with at most one transition runs at once, without yielding.
    fn advance(&mut self, job: &Job, cfg: &DraftConfig) -> bool {
        if job.chain {
            return self.advance_chain(job, cfg);
        }
        let sam = job.sam;
        let per_node = cfg.max_children as usize;
        // Kept in locals while the growth runs on without yielding (stored and reloaded through
        // `self` at every node, it waited on the store). A node that expands one state with one
        // transition (or only the pointer) is a `Step`, which is cheaper to carry than a `Pending`.
        let mut pending = self.pending.take();
        let mut step: Option<Step> = None;
        // Each source of the next node (the expansion's lone candidate, or the frontier) hands
        // its candidate to `take` at its own call site: merged into one `Option<Cand>` first,
        // the candidate went through the stack and its reload waited on the stores.
        // (With a budget of one node, the root's expansion could not become a node either.)
        while self.nodes.len() < job.budget {
            let mut flow = Flow::Pop;
            if let Some(p) = pending.take() {
                let direct = self.offer(
                    sam,
                    &p.sources[..p.n],
                    &p.avoid,
                    p.parent,
                    p.pprob,
                    per_node,
                    job.w_new,
                    cfg,
                    p.pointer(job),
                );
                if let Some(c) = direct {
                    flow = self.take(job, cfg, c, &mut pending, &mut step);
                }
            } else if let Some(st) = step.take() {
                if let Some(c) = self.offer_step(job, cfg, st, per_node) {
                    flow = self.take(job, cfg, c, &mut pending, &mut step);
                }
            }
            while let Flow::Pop = flow {
                flow = match self.heap.pop() {
                    Some(c) => self.take(job, cfg, c, &mut pending, &mut step),
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
    /// (in `pending` or `step`, or in `self.pending` to yield first), the frontier's next
    /// candidate when it has nothing to expand, or the end (the budget is spent, or `c` is
    /// below `min_prob`).
    #[inline(always)]
    fn take(
        &mut self,
        job: &Job,
        cfg: &DraftConfig,
        c: Cand,
        pending: &mut Option<Pending>,
        step: &mut Option<Step>,
    ) -> Flow {
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
        // Yield (while the children load) unless the expansion reads one child of one state,
        // which mostly sits next to it (as in a chain).
        let near = st.state == NONE || sam.degree(st.state) <= 1;
        if !near {
            self.pending = Some(st.pending());
            return Flow::Yield;
        }
        if cfg.blend == 0 {
            *step = Some(st);
        } else {
            *pending = Some(st.pending());
        }
        Flow::Expand
    }

    /// [`Growth::advance`] for a chain: the same nodes as a tree growth offering one child per
    /// node, without the frontier heap (it never holds more than one candidate) or the BFS
    /// reordering (a chain is in BFS order). It yields only before expanding a state with several
    /// transitions.
    fn advance_chain(&mut self, job: &Job, cfg: &DraftConfig) -> bool {
        let sam = job.sam;
        // In locals while the chain runs on without yielding, as in `advance`.
        let mut pending = self.pending.take();
        let mut step: Option<Step> = None;
        while self.nodes.len() < job.budget {
            // The first of `offer`'s order.
            let (k, parent, pprob) = if let Some(p) = pending.take() {
                self.collect_kids(
                    sam,
                    &p.sources[..p.n],
                    &p.avoid,
                    job.w_new,
                    cfg,
                    p.pointer(job),
                );
                let Some(k) = self.kids.iter().copied().min_by(by_p) else {
                    break;
                };
                (k, p.parent, p.pprob)
            } else if let Some(st) = step.take() {
                let (Some(k), other) = st.kids(job, cfg) else {
                    break;
                };
                let k = match other {
                    Some(o) if by_p(&o, &k) == Ordering::Less => o,
                    _ => k,
                };
                (k, st.parent, st.pprob)
            } else {
                break;
            };
            let score = pprob * k.p;
            if score < cfg.min_prob || score <= 0.0 {
                break;
            }
            let id = self.nodes.len() as u32;
            self.nodes.push(Node {
                tok: k.tok,
                parent,
                prob: score,
            });
            if self.nodes.len() >= job.budget {
                break;
            }
            let Some(next) = Step::of(job, cfg, id, score, k.to, k.ptr) else {
                break;
            };
            // Yield (to the other lanes, while the children load) only before a state with several
            // transitions: a state's one child, and the pointer's next entry, mostly sit next to
            // what was just read (a response's states and log entries are created in order).
            if next.state != NONE && sam.degree(next.state) > 1 {
                sam.prefetch_expansion(next.state);
                self.pending = Some(next.pending());
                return false;
            }
            if cfg.blend == 0 {
                step = Some(next);
            } else {
                pending = Some(next.pending());
            }
        }
        self.out.clear();
        self.out.extend_from_slice(&self.nodes);
        true
    }

    /// Offers the children of the weighted `sources` (merged by token; source `i` never offers
    /// `avoid[i]`) as candidates under `parent`, mixed with the pointer's prediction `ptr` (log,
    /// clock of the predicted token, weight). A single candidate that outranks every candidate
    /// in the frontier is returned instead of pushed: the caller takes it as the next node, as
    /// the next pop would have.
    #[allow(clippy::too_many_arguments)]
    fn offer(
        &mut self,
        sam: &Sam,
        sources: &[(u32, f32)],
        avoid: &[u32; MAX_ANCHORS],
        parent: u32,
        pprob: f32,
        per_node: usize,
        w_new: f32,
        cfg: &DraftConfig,
        ptr: Option<(&Log, u32, f32)>,
    ) -> Option<Cand> {
        self.collect_kids(sam, sources, avoid, w_new, cfg, ptr);
        self.offer_kids(sam, parent, pprob, per_node, cfg)
    }

    /// [`Growth::offer`] for a [`Step`] (one state with one transition, or none, and the
    /// pointer; no blending): the same candidates, without the general merging. A lone
    /// candidate, the usual case, never goes through `kids`.
    #[inline]
    fn offer_step(
        &mut self,
        job: &Job,
        cfg: &DraftConfig,
        st: Step,
        per_node: usize,
    ) -> Option<Cand> {
        let sam = job.sam;
        let (kid, other) = st.kids(job, cfg);
        let k = kid?;
        if let Some(o) = other {
            self.kids.clear();
            self.kids.push(k);
            self.kids.push(o);
            return self.offer_kids(sam, st.parent, st.pprob, per_node, cfg);
        }
        let c = self.candidate(sam, k, st.parent, st.pprob, cfg)?;
        if self.heap.peek().is_none_or(|top| c > *top) {
            return Some(c);
        }
        self.heap.push(c);
        None
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
        sort_small(&mut self.kids, by_p);
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

    /// The candidates [`Growth::offer`] chooses from, in `kids`: the children of the weighted
    /// `sources` with their estimates, merged by token, mixed with the pointer's prediction.
    fn collect_kids(
        &mut self,
        sam: &Sam,
        sources: &[(u32, f32)],
        avoid: &[u32; MAX_ANCHORS],
        w_new: f32,
        cfg: &DraftConfig,
        ptr: Option<(&Log, u32, f32)>,
    ) {
        self.kids.clear();
        let mut merged = sources.len() > 1;
        for (&(s, weight), &avoid) in sources.iter().zip(avoid) {
            // PPM blending: what the context leaves to "something new" goes to its next shorter
            // suffix with continuations, down `cfg.blend` levels.
            let mut st = Some(s);
            let mut wt = weight;
            let mut level = 0;
            while let Some(cur) = st {
                let from = self.kids.len();
                let esc = self.estimate(sam, cur, w_new, cfg, from);
                for k in &mut self.kids[from..] {
                    k.p *= wt;
                }
                if avoid != NONE {
                    // Its share of the estimate is dropped, not given to the others.
                    let mut w = from;
                    for r in from..self.kids.len() {
                        if self.kids[r].tok != avoid {
                            self.kids[w] = self.kids[r];
                            w += 1;
                        }
                    }
                    self.kids.truncate(w);
                }
                level += 1;
                if level > cfg.blend as usize || esc <= 0.0 {
                    break;
                }
                wt *= esc;
                st = sam.longest_with_children(sam.states[cur as usize].link, cfg.min_match);
                merged |= st.is_some();
            }
        }
        if merged {
            // Merge duplicate tokens from different sources: sum their estimates, follow the
            // state of the larger one.
            self.kids
                .sort_unstable_by(|x, y| x.tok.cmp(&y.tok).then(y.p.total_cmp(&x.p)));
            let mut w = 0usize;
            for r in 0..self.kids.len() {
                if w > 0 && self.kids[w - 1].tok == self.kids[r].tok {
                    self.kids[w - 1].p += self.kids[r].p;
                } else {
                    self.kids[w] = self.kids[r];
                    w += 1;
                }
            }
            self.kids.truncate(w);
        }
        if let Some((log, clock, lam)) = ptr {
            if let Some(e) = log.get(clock) {
                // Mixture: the source's next token gets `lam` on top of its share of the rest.
                for k in &mut self.kids {
                    k.p *= 1.0 - lam;
                }
                match self.kids.iter_mut().find(|k| k.tok == e.tok) {
                    Some(k) => {
                        k.p += lam;
                        k.ptr = clock;
                    }
                    None => self.kids.push(Kid::pointer(e.tok, clock, lam)),
                }
            }
        }
    }

    /// Appends the children of `s` to `kids[from..]` with their estimated probabilities, and
    /// returns the escape probability (the mass left for continuations not seen behind `s`).
    fn estimate(&mut self, sam: &Sam, s: u32, w_new: f32, cfg: &DraftConfig, from: usize) -> f32 {
        if sam.degree(s) == 1 {
            let Some(k) = one_child_estimate(sam, s, w_new, cfg) else {
                return 1.0;
            };
            self.kids.push(k.0);
            return k.1;
        }
        let mut total = 0.0f32;
        for (tok, to) in sam.children(s) {
            let st = &sam.states[to as usize];
            total += st.cnt;
            self.kids.push(Kid {
                tok,
                to,
                cnt: st.cnt,
                recent: st.recent,
                p: 0.0,
                ptr: NONE,
            });
        }
        if self.kids.len() == from || total <= 0.0 {
            self.kids.truncate(from);
            return 1.0;
        }
        let len = sam.states[s as usize].len.max(1) as f32;
        let esc = (cfg.escape + cfg.escape_short / len) * w_new;
        let denom = total + esc;
        let conf = total / denom;
        let a = cfg.recency;
        let kids = &mut self.kids[from..];
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
            while ranks < kids.len() && r >= 1e-6 {
                ranks += 1;
                r *= b;
            }
            let by_recency = |x: &Kid, y: &Kid| {
                y.recent
                    .cmp(&x.recent)
                    .then(y.cnt.total_cmp(&x.cnt))
                    .then(x.tok.cmp(&y.tok))
            };
            if ranks < kids.len() {
                kids.select_nth_unstable_by(ranks - 1, by_recency);
            }
            sort_small(&mut kids[..ranks], by_recency);
            let mut r = r0;
            for k in &mut kids[..ranks] {
                k.p += r;
                r *= b;
            }
        }
        esc / denom
    }

    /// Puts `nodes` (growth order, parents first) into BFS order in `out`: a stable sort by depth,
    /// with parent positions renumbered.
    fn reorder_bfs(&mut self) {
        let n = self.nodes.len();
        self.out.clear();
        // Often the growth order is already BFS order (a chain, or siblings taken before their
        // children).
        if self.depth.windows(2).all(|w| w[0] <= w[1]) {
            self.out.extend_from_slice(&self.nodes);
            return;
        }
        if n <= 64 {
            // A counting sort on the stack (a node's depth is below its position).
            let mut at = [0u8; 65];
            for &dp in &self.depth {
                at[dp as usize + 1] += 1;
            }
            for k in 1..=n {
                at[k] += at[k - 1];
            }
            let mut order = [0u8; 64];
            let mut remap = [0u8; 64];
            for (i, &dp) in self.depth.iter().enumerate() {
                let slot = &mut at[dp as usize];
                order[*slot as usize] = i as u8;
                remap[i] = *slot;
                *slot += 1;
            }
            for &old in &order[..n] {
                let mut node = self.nodes[old as usize];
                if node.parent != NONE {
                    node.parent = u32::from(remap[node.parent as usize]);
                }
                self.out.push(node);
            }
            return;
        }
        // Counting sort by depth, stable in growth order.
        let deepest = self.depth.iter().copied().max().unwrap_or(0) as usize;
        self.remap.clear();
        self.remap.resize(deepest + 2, 0);
        for &dp in &self.depth {
            self.remap[dp as usize + 1] += 1;
        }
        for k in 1..self.remap.len() {
            self.remap[k] += self.remap[k - 1];
        }
        self.order.clear();
        self.order.resize(n, 0);
        for (i, &dp) in self.depth.iter().enumerate() {
            let at = &mut self.remap[dp as usize];
            self.order[*at as usize] = i as u32;
            *at += 1;
        }
        self.remap.clear();
        self.remap.resize(n, 0);
        for (new, &old) in self.order.iter().enumerate() {
            self.remap[old as usize] = new as u32;
        }
        for &old in &self.order {
            let mut node = self.nodes[old as usize];
            if node.parent != NONE {
                node.parent = self.remap[node.parent as usize];
            }
            self.out.push(node);
        }
    }
}

/// [`Growth::estimate`] for a state `s` with one transition, without enumerating: the child
/// with its estimate (all of the recency share goes to it) and the escape probability; `None`
/// when the child has no weight.
#[inline]
fn one_child_estimate(sam: &Sam, s: u32, w_new: f32, cfg: &DraftConfig) -> Option<(Kid, f32)> {
    let st = &sam.states[s as usize];
    let (tok, to) = st.first_child()?;
    let child = &sam.states[to as usize];
    let cnt = child.cnt;
    if cnt <= 0.0 {
        return None;
    }
    let len = st.len.max(1) as f32;
    let esc = (cfg.escape + cfg.escape_short / len) * w_new;
    let denom = cnt + esc;
    let a = cfg.recency;
    let mut p = (1.0 - a) * cnt / denom;
    if a > 0.0 {
        p += a * (cnt / denom) * (1.0 - cfg.recency_decay);
    }
    let kid = Kid {
        tok,
        to,
        cnt,
        recent: child.recent,
        p,
        ptr: NONE,
    };
    Some((kid, esc / denom))
}

/// The order in which a node offers its children: most probable first, ties to the smaller token.
#[inline]
fn by_p(x: &Kid, y: &Kid) -> Ordering {
    y.p.total_cmp(&x.p).then(x.tok.cmp(&y.tok))
}

/// Sorts `v` by the total order `cmp`: insertion sort for the few children most nodes have, the
/// standard sort otherwise (the same result either way, as the order is total).
#[inline]
fn sort_small<T: Copy>(v: &mut [T], cmp: impl Fn(&T, &T) -> Ordering) {
    if v.len() > 12 {
        v.sort_unstable_by(cmp);
        return;
    }
    for i in 1..v.len() {
        let x = v[i];
        let mut j = i;
        while j > 0 && cmp(&x, &v[j - 1]) == Ordering::Less {
            v[j] = v[j - 1];
            j -= 1;
        }
        v[j] = x;
    }
}

/// An element type SGLang's mask buffer may have (int64 as NGRAM returns it, or bool/uint8).
pub trait MaskElem: Copy + Send {
    const ZERO: Self;
    const ONE: Self;
    /// Row pieces: entry `n` holds the four elements of bits `n & 1`, `n >> 1 & 1`, ... (so a
    /// row is written four elements per lookup, not one bit at a time).
    const NIBBLES: [[Self; 4]; 16];
    /// `ONE` for bit 1, `ZERO` for bit 0 (`bit` is 0 or 1), without a branch.
    fn from_bit(bit: u64) -> Self;
}

/// [`MaskElem`] for a type whose `ZERO`/`ONE` are `$zero`/`$one` and whose `from_bit` is `$from`.
macro_rules! mask_elem {
    ($t:ty, $zero:expr, $one:expr, $from:expr) => {
        impl MaskElem for $t {
            const ZERO: $t = $zero;
            const ONE: $t = $one;
            const NIBBLES: [[$t; 4]; 16] = {
                let mut t = [[$zero; 4]; 16];
                let mut n = 0;
                while n < 16 {
                    let mut j = 0;
                    while j < 4 {
                        if (n >> j) & 1 == 1 {
                            t[n][j] = $one;
                        }
                        j += 1;
                    }
                    n += 1;
                }
                t
            };
            #[inline(always)]
            fn from_bit(bit: u64) -> $t {
                $from(bit)
            }
        }
    };
}
mask_elem!(i64, 0, 1, |b: u64| b as i64);
mask_elem!(i32, 0, 1, |b: u64| b as i32);
mask_elem!(u8, 0, 1, |b: u64| b as u8);
mask_elem!(bool, false, true, |b: u64| b != 0);

/// Writes `nodes` (BFS order, at most `d`) padded to exactly `d` nodes into one request's slices:
/// `tokens[d]`, `mask[d*d]` (row i = i and its ancestors) and optionally `probs[d]`.
/// Returns the number of real (unpadded) nodes.
pub fn write_tree<M: MaskElem>(
    nodes: &[Node],
    d: usize,
    tokens: &mut [i64],
    mask: &mut [M],
    mut probs: Option<&mut [f32]>,
) -> usize {
    let n = nodes.len().min(d);
    // Every row is written whole, so the buffer needs no clearing first: half the memory traffic
    // of a 256-request batch's int64 masks. Up to 64 nodes, each node's ancestor set is a bit
    // mask and its row is written from the bits; beyond, a row is its parent's row copied.
    let mut anc = [0u64; 64];
    for i in 0..d {
        let (tok, parent, prob) = if i < n {
            let nd = nodes[i];
            (nd.tok as i64, nd.parent, nd.prob)
        } else {
            // Pad chain: each pad is the only child of the previous slot.
            (0, (i - 1) as u32, 0.0)
        };
        tokens[i] = tok;
        if let Some(p) = probs.as_deref_mut() {
            p[i] = prob;
        }
        if d <= 64 {
            let bits = if parent == NONE {
                0
            } else {
                anc[parent as usize]
            } | 1 << i;
            anc[i] = bits;
            let row = &mut mask[i * d..(i + 1) * d];
            let mut quads = row.chunks_exact_mut(4);
            let mut b = bits;
            for q in &mut quads {
                q.copy_from_slice(&M::NIBBLES[(b & 15) as usize]);
                b >>= 4;
            }
            for (j, m) in quads.into_remainder().iter_mut().enumerate() {
                *m = M::from_bit((b >> j) & 1);
            }
            continue;
        }
        if parent != NONE {
            let (before, row) = mask.split_at_mut(i * d);
            row[..d].copy_from_slice(&before[parent as usize * d..parent as usize * d + d]);
        } else {
            mask[i * d..(i + 1) * d].fill(M::ZERO);
        }
        mask[i * d + i] = M::ONE;
    }
    n
}

/// Writes a chain (the nodes after the root, in order) into `tokens[k]`, padding with 0;
/// returns its real length.
pub fn write_chain(nodes: &[Node], tokens: &mut [i64], mut probs: Option<&mut [f32]>) -> usize {
    let n = nodes.len().saturating_sub(1).min(tokens.len());
    for (i, t) in tokens.iter_mut().enumerate() {
        *t = if i < n { nodes[i + 1].tok as i64 } else { 0 };
        if let Some(p) = probs.as_deref_mut() {
            p[i] = if i < n { nodes[i + 1].prob } else { 0.0 };
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

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
            blend: 0,
            escape_short: 0.0,
            ..DraftConfig::default()
        }
    }

    #[test]
    fn blending_offers_shorter_context_continuations() {
        // Behind [2, 3] only 4 follows; behind [3] alone, 7 also does. With blending the root
        // offers both, the longer context's continuation first.
        let (sam, _) = sam_of(&[&[1, 2, 3, 4], &[9, 3, 7]]);
        let anchor = sam.walk(&[2, 3]).unwrap();
        let mut d = Drafter::default();
        let blend = DraftConfig {
            blend: 1,
            ..frequency_only()
        };
        let nodes = d
            .grow(&sam, 3, &[(anchor, 1.0)], None, 8, false, 1.0, &blend)
            .to_vec();
        let root_kids: Vec<u32> = nodes
            .iter()
            .filter(|n| n.parent == 0)
            .map(|n| n.tok)
            .collect();
        assert_eq!(root_kids, vec![4, 7]);
        assert!(nodes[1].prob > nodes[2].prob);
        let plain = d
            .grow(
                &sam,
                3,
                &[(anchor, 1.0)],
                None,
                8,
                false,
                1.0,
                &frequency_only(),
            )
            .to_vec();
        assert!(plain.iter().all(|n| n.tok != 7));
    }

    #[test]
    fn chain_follows_most_frequent_continuation() {
        let (sam, _) = sam_of(&[&[1, 2, 3, 4], &[1, 2, 3, 5], &[1, 2, 3, 4]]);
        let anchor = sam.walk(&[2, 3]);
        let mut d = Drafter::default();
        let nodes = d
            .grow(
                &sam,
                3,
                &[(anchor.unwrap(), 1.0)],
                None,
                4,
                true,
                1.0,
                &frequency_only(),
            )
            .to_vec();
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
        let mut d = Drafter::default();
        let nodes = d
            .grow(
                &sam,
                2,
                &[(anchor.unwrap(), 1.0)],
                None,
                8,
                false,
                1.0,
                &DraftConfig::default(),
            )
            .to_vec();
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
}
