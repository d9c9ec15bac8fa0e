//! Per-prompt histories: groups, in-flight requests, retention, eviction and batch drafting.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::draft::{write_chain, write_tree, DraftConfig, Drafter, Job, MaskElem, Node, Pointer};
use crate::error::{CoreError, Result};
use crate::follow::{Follow, Log};
use crate::par::{split, split_mut, split_opt, Par, MAX_THREADS};
use crate::sam::{prefetch, Sam, NONE};

thread_local! {
    // Scratch space for the parts of a batch that run on pool threads (and on the caller, when a
    // batch is split).
    static PART_DRAFTER: std::cell::RefCell<Drafter> = std::cell::RefCell::new(Drafter::default());
}

/// A fixed, unseeded hasher for integer keys: map iteration order (never relied upon for results)
/// is the same in every process.
#[derive(Default, Clone, Copy)]
pub struct FixedHasher(u64);
impl Hasher for FixedHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x51_7C_C1_B7_27_22_0A_95);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7C_C1_B7_27_22_0A_95);
    }
}
pub type FixedMap<K, V> = HashMap<K, V, BuildHasherDefault<FixedHasher>>;

/// Shortest automaton match a request's source pointer may start from.
const FOLLOW_MIN_ANCHOR: u32 = 6;

/// Index-wide settings. Zero means "no limit" for the retention and memory fields.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexConfig {
    /// Token ids must be below this (None: any non-negative int32).
    pub vocab_size: Option<u32>,
    /// Keep only the last N finished responses of each group (0 = all).
    pub max_responses: usize,
    /// Keep only the responses of the last E distinct versions of each group (0 = all).
    pub max_versions: usize,
    /// Global memory budget in bytes; least-recently-used idle groups are evicted (0 = none).
    pub max_bytes: usize,
    /// An occurrence from version v weighs `version_decay^(newest - v)`; 1 = plain counts.
    pub version_decay: f32,
    /// The draft policy.
    pub draft: DraftConfig,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            vocab_size: None,
            max_responses: 0,
            max_versions: 0,
            max_bytes: 0,
            version_decay: 1.0,
            draft: DraftConfig::default(),
        }
    }
}

impl IndexConfig {
    /// Checks every field's domain.
    pub fn validate(&self) -> Result<()> {
        if self.vocab_size == Some(0) {
            return Err(CoreError::InvalidArgument(
                "vocab_size must be at least 1".into(),
            ));
        }
        if !(self.version_decay > 0.0 && self.version_decay <= 1.0) {
            return Err(CoreError::InvalidArgument(format!(
                "version_decay must be in (0, 1], got {}",
                self.version_decay
            )));
        }
        self.draft.validate().map_err(CoreError::InvalidArgument)
    }
}

/// One finished response kept as history.
#[derive(Clone, Debug, PartialEq)]
pub struct Response {
    /// Index into the group's `prompts`.
    pub prompt: u32,
    /// Policy / weight version the response was sampled with.
    pub version: u64,
    /// Response tokens (the prompt excluded).
    pub tokens: Vec<u32>,
}

/// What [`HistoryIndex::finish_request_as`] does with a finished request's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// They become history of the request's group (a response, with the request's version).
    Keep,
    /// They are not history and leave the group's automaton now (the group is rebuilt).
    Drop,
    /// They are not history, but leave the automaton only at the group's next rebuild: when its
    /// last in-flight request finishes, or once such tokens are more than half of what it holds.
    /// Until then in-flight siblings may draft from them. For engines: with a draft server every
    /// request finishes unkept (its response comes back as a published record), and rebuilding a
    /// GRPO group per finished sibling costs milliseconds each; this rebuilds once per wave. A
    /// group with nothing in flight always holds exactly its history.
    DropLater,
}

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
    prompt_last: Vec<u32>,
    /// Occurrence counts are stale (bulk appends since the last recount). Invariant: a group with
    /// in-flight requests is never dirty, so drafts always see exact counts.
    dirty: bool,
    /// Finished responses kept, oldest first.
    pub responses: VecDeque<Response>,
    /// Number of in-flight requests drafting from this group (never evicted while > 0).
    pub active: u32,
    /// Tokens of requests finished with [`Finish::DropLater`] that the automaton still holds.
    /// Invariant: 0 when `active` is 0.
    discarded: usize,
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
    fn new(version: u64) -> Self {
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

    fn measure(&self) -> usize {
        let toks: usize = self.prompts.iter().map(|p| p.capacity()).sum::<usize>()
            + self
                .responses
                .iter()
                .map(|r| r.tokens.capacity())
                .sum::<usize>();
        self.sam.bytes() + self.log.bytes() + 4 * toks + std::mem::size_of::<Group>()
    }

    fn prompt_index(&mut self, prompt: &[u32]) -> u32 {
        if let Some(i) = self.prompts.iter().position(|p| p.as_slice() == prompt) {
            return i as u32;
        }
        self.prompts.push(prompt.to_vec());
        self.prompt_last.push(NONE);
        (self.prompts.len() - 1) as u32
    }

    /// Weight of one occurrence from `version` under decay `gamma`.
    fn weight(&self, version: u64, gamma: f32) -> f32 {
        if gamma >= 1.0 {
            return 1.0;
        }
        let e = (version as f64 - self.weight_base as f64) * -(gamma as f64).ln();
        e.clamp(-80.0, 80.0).exp() as f32
    }

    /// Appends `t` to the string whose last state is `last` and whose last token has clock `prev`
    /// (`NONE` for a string's first token); returns the new state and the token's clock.
    /// With `deferred` the counts go stale (`dirty`) until [`Group::ensure_clean`].
    fn push(&mut self, last: u32, prev: u32, t: u32, w: f32, deferred: bool) -> (u32, u32) {
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
    fn push_uncounted(&mut self, last: u32, prev: u32, t: u32, w: f32) -> (u32, u32) {
        let s = self.sam.extend_uncounted(last, t, w);
        self.log.push(self.sam.clock, prev, t);
        (s, self.sam.clock)
    }

    /// Inserts `prompt + tokens` (the prompt only the first time); returns the last state and the
    /// clock of the last token of `tokens` (`NONE` when empty).
    fn insert(&mut self, prompt: u32, tokens: &[u32], w: f32, deferred: bool) -> (u32, u32) {
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
    fn ensure_clean(&mut self) {
        if self.dirty {
            self.sam.recount();
            self.dirty = false;
        }
    }
}

#[derive(Clone, Debug)]
struct Request {
    group: u64,
    prompt: u32,
    /// The automaton state of the request's whole context (prompt + generated).
    last: u32,
    /// Clock of the last generated token (`NONE` before the first).
    clock: u32,
    /// The request's pointer into the earlier string it follows.
    follow: Follow,
    /// Generated tokens so far.
    tokens: Vec<u32>,
    version: u64,
    weight: f32,
    /// Begin order, for deterministic re-insertion on rebuild.
    seq: u64,
}

/// Appends accepted tokens `toks` to request `req` of group `g`, advancing its source pointer.
fn append(req: &mut Request, g: &mut Group, toks: &[u32], follow: bool) {
    for &t in toks {
        (req.last, req.clock) = g.push(req.last, req.clock, t, req.weight, false);
        req.tokens.push(t);
        if follow {
            req.follow
                .step(&g.log, &g.sam, req.last, &req.tokens, FOLLOW_MIN_ANCHOR);
        }
    }
}

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

/// Counts of what the index holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub groups: usize,
    pub requests: usize,
    pub responses: usize,
    /// Response tokens held (finished responses plus in-flight generated tokens).
    pub tokens: usize,
    pub prompt_tokens: usize,
    pub states: usize,
    pub edges: usize,
    pub bytes: usize,
    pub rebuilds: u64,
    pub evictions: u64,
}

/// What one batch draft call produced, summed over the batch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchDraftStats {
    /// Requests that got at least one draft node beyond the root.
    pub nonempty: usize,
    /// Real draft nodes (root and pads excluded).
    pub nodes: usize,
}

impl std::ops::Add for BatchDraftStats {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        BatchDraftStats {
            nonempty: self.nonempty + o.nonempty,
            nodes: self.nodes + o.nodes,
        }
    }
}

/// Converts boundary token ids (int32) to internal ids, checking the range.
pub fn check_tokens(tokens: &[i32], vocab: Option<u32>) -> Result<Vec<u32>> {
    let limit = vocab.map(|v| v as u64).unwrap_or(i32::MAX as u64 + 1);
    tokens
        .iter()
        .map(|&t| {
            if t < 0 || t as u64 >= limit {
                Err(CoreError::InvalidToken {
                    token: t as i64,
                    limit,
                })
            } else {
                Ok(t as u32)
            }
        })
        .collect()
}

/// The history index: per-group automata, in-flight requests, and batch drafting.
#[derive(Clone, Debug)]
pub struct HistoryIndex {
    cfg: IndexConfig,
    pub(crate) groups: FixedMap<u64, Group>,
    requests: FixedMap<u64, Request>,
    pub(crate) tick: u64,
    seq: u64,
    version: u64,
    total_bytes: usize,
    rebuilds: u64,
    evictions: u64,
    /// Threads for batch calls (not part of the history: snapshots and clones do not carry a pool).
    par: Par,
}

impl HistoryIndex {
    /// An empty index; fails on an invalid configuration.
    pub fn new(cfg: IndexConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(HistoryIndex {
            cfg,
            groups: FixedMap::default(),
            requests: FixedMap::default(),
            tick: 0,
            seq: 0,
            version: 0,
            total_bytes: 0,
            rebuilds: 0,
            evictions: 0,
            par: Par::new(1),
        })
    }

    /// Threads that batch calls ([`HistoryIndex::draft_tree_batch`],
    /// [`HistoryIndex::draft_chain_batch`], [`HistoryIndex::extend_batch`]) may use, the calling
    /// thread included (1 = the caller only, the default). Results do not depend on it.
    pub fn set_threads(&mut self, threads: usize) -> Result<()> {
        if !(1..=MAX_THREADS).contains(&threads) {
            return Err(CoreError::InvalidArgument(format!(
                "threads must be in 1..={MAX_THREADS}, got {threads}"
            )));
        }
        if threads != self.par.threads() {
            self.par = Par::new(threads);
        }
        Ok(())
    }

    /// Threads that batch calls may use.
    pub fn threads(&self) -> usize {
        self.par.threads()
    }

    /// The configuration in force.
    pub fn config(&self) -> &IndexConfig {
        &self.cfg
    }

    /// Replaces the draft policy (history is unaffected).
    pub fn set_draft_config(&mut self, draft: DraftConfig) -> Result<()> {
        draft.validate().map_err(CoreError::InvalidArgument)?;
        self.cfg.draft = draft;
        Ok(())
    }

    /// The version new requests are tagged with unless they name one.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Sets the version new requests are tagged with (e.g. the policy's weight version).
    pub fn set_version(&mut self, v: u64) {
        self.version = v;
    }

    /// Converts and range-checks boundary token ids with this index's vocabulary.
    pub fn check_tokens(&self, tokens: &[i32]) -> Result<Vec<u32>> {
        check_tokens(tokens, self.cfg.vocab_size)
    }

    fn touch(&mut self, key: u64) {
        self.tick += 1;
        if let Some(g) = self.groups.get_mut(&key) {
            g.last_used = self.tick;
        }
    }

    fn remeasure(&mut self, key: u64) {
        if let Some(g) = self.groups.get_mut(&key) {
            let b = g.measure();
            self.total_bytes = self.total_bytes + b - g.bytes;
            g.bytes = b;
        }
    }

    fn group_mut(&mut self, key: u64, version: u64) -> &mut Group {
        self.groups
            .entry(key)
            .or_insert_with(|| Group::new(version))
    }

    /// Starts a request of `group` whose context begins with `prompt` (non-empty). Its tokens are
    /// visible to every other request of the group as they are appended.
    pub fn begin_request(
        &mut self,
        rid: u64,
        group: u64,
        prompt: &[i32],
        version: Option<u64>,
    ) -> Result<()> {
        if self.requests.contains_key(&rid) {
            return Err(CoreError::DuplicateRequest(rid));
        }
        if prompt.is_empty() {
            return Err(CoreError::InvalidArgument(
                "prompt must contain at least one token".into(),
            ));
        }
        let prompt = self.check_tokens(prompt)?;
        let version = version.unwrap_or(self.version);
        let gamma = self.cfg.version_decay;
        let g = self.group_mut(group, version);
        g.max_version = g.max_version.max(version);
        let pi = g.prompt_index(&prompt);
        let weight = g.weight(version, gamma);
        g.ensure_clean();
        let (last, _) = g.insert(pi, &[], weight, false);
        g.active += 1;
        self.seq += 1;
        let seq = self.seq;
        self.requests.insert(
            rid,
            Request {
                group,
                prompt: pi,
                last,
                clock: NONE,
                follow: Follow::LOST,
                tokens: Vec::new(),
                version,
                weight,
                seq,
            },
        );
        self.rebase_if_needed(group);
        self.touch(group);
        self.remeasure(group);
        self.enforce_budget();
        Ok(())
    }

    /// Appends accepted tokens to an in-flight request.
    pub fn extend_request(&mut self, rid: u64, tokens: &[i32]) -> Result<()> {
        let toks = self.check_tokens(tokens)?;
        self.extend_checked(rid, &toks)
    }

    fn extend_checked(&mut self, rid: u64, toks: &[u32]) -> Result<()> {
        let req = self
            .requests
            .get_mut(&rid)
            .ok_or(CoreError::UnknownRequest(rid))?;
        let g = self
            .groups
            .get_mut(&req.group)
            .expect("in-flight request without its group");
        append(req, g, toks, self.cfg.draft.follow > 0.0);
        let key = req.group;
        self.touch(key);
        self.remeasure(key);
        Ok(())
    }

    /// Appends tokens to many requests at once: `tokens` is the concatenation, `lens[i]` tokens
    /// for `rids[i]`. Everything is validated before anything is applied.
    pub fn extend_batch(&mut self, rids: &[u64], tokens: &[i32], lens: &[i64]) -> Result<()> {
        if lens.len() != rids.len() {
            return Err(CoreError::BufferShape {
                name: "lens",
                got: lens.len(),
                expected: rids.len(),
            });
        }
        let mut total = 0usize;
        for &l in lens {
            if l < 0 {
                return Err(CoreError::InvalidArgument(format!(
                    "lens must be >= 0, got {l}"
                )));
            }
            total += l as usize;
        }
        if total != tokens.len() {
            return Err(CoreError::BufferShape {
                name: "tokens",
                got: tokens.len(),
                expected: total,
            });
        }
        for &r in rids {
            if !self.requests.contains_key(&r) {
                return Err(CoreError::UnknownRequest(r));
            }
        }
        let toks = self.check_tokens(tokens)?;
        self.extend_grouped(rids, &toks, lens);
        self.enforce_budget();
        Ok(())
    }

    /// [`HistoryIndex::extend_batch`] for validated input, by group, spread over the index's
    /// threads. Each group goes to one thread, which applies its requests' appends in batch order
    /// ([`apply_appends`], several groups interleaved), so automata, pointers and counts come out
    /// exactly as one by one; LRU ticks and sizes are then updated in batch order, as one by one.
    fn extend_grouped(&mut self, rids: &[u64], toks: &[u32], lens: &[i64]) {
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

    /// Ends a request. With `keep` its response becomes history of its group (tagged with its
    /// version); otherwise it is removed from the group's automaton, which means rebuilding the
    /// group (one insertion per token it holds). See [`HistoryIndex::finish_request_as`].
    pub fn finish_request(&mut self, rid: u64, keep: bool) -> Result<()> {
        self.finish_request_as(rid, if keep { Finish::Keep } else { Finish::Drop })
    }

    /// Ends a request; `how` says what becomes of its tokens ([`Finish`]).
    pub fn finish_request_as(&mut self, rid: u64, how: Finish) -> Result<()> {
        let req = self
            .requests
            .remove(&rid)
            .ok_or(CoreError::UnknownRequest(rid))?;
        let key = req.group;
        let g = self
            .groups
            .get_mut(&key)
            .expect("in-flight request without its group");
        g.active -= 1;
        let mut rebuild = false;
        match how {
            Finish::Keep => {
                g.responses.push_back(Response {
                    prompt: req.prompt,
                    version: req.version,
                    tokens: req.tokens,
                });
                rebuild |= apply_retention(g, &self.cfg);
            }
            Finish::Drop => rebuild = true,
            // (Plus one: a request that generated nothing may still have brought a new prompt.)
            Finish::DropLater => g.discarded += req.tokens.len() + 1,
        }
        if g.responses.is_empty() && g.active == 0 {
            self.drop_group(key);
            return Ok(());
        }
        rebuild |= g.discarded > 0 && (g.active == 0 || 2 * g.discarded > g.sam.clock as usize);
        if rebuild {
            self.rebuild(key);
        }
        self.touch(key);
        self.remeasure(key);
        self.enforce_budget();
        Ok(())
    }

    /// Adds a finished response to a group's history directly (bulk loads, other engines).
    pub fn add_response(
        &mut self,
        group: u64,
        prompt: &[i32],
        response: &[i32],
        version: u64,
    ) -> Result<()> {
        if prompt.is_empty() {
            return Err(CoreError::InvalidArgument(
                "prompt must contain at least one token".into(),
            ));
        }
        let prompt = self.check_tokens(prompt)?;
        let response = self.check_tokens(response)?;
        self.add_response_checked(group, &prompt, response, version);
        self.enforce_budget();
        Ok(())
    }

    pub(crate) fn add_response_checked(
        &mut self,
        group: u64,
        prompt: &[u32],
        response: Vec<u32>,
        version: u64,
    ) {
        let gamma = self.cfg.version_decay;
        let cfg = &self.cfg;
        let g = self
            .groups
            .entry(group)
            .or_insert_with(|| Group::new(version));
        g.max_version = g.max_version.max(version);
        let pi = g.prompt_index(prompt);
        let w = g.weight(version, gamma);
        // Idle groups take bulk history with deferred counts; groups drafting now stay exact.
        g.insert(pi, &response, w, g.active == 0);
        g.responses.push_back(Response {
            prompt: pi,
            version,
            tokens: response,
        });
        if apply_retention(g, cfg) {
            self.rebuild(group);
        } else {
            self.rebase_if_needed(group);
        }
        self.touch(group);
        self.remeasure(group);
    }

    /// Forgets a whole group (its in-flight requests are finished without keeping them).
    pub fn remove_group(&mut self, group: u64) -> bool {
        let rids: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| r.group == group)
            .map(|(&k, _)| k)
            .collect();
        for r in rids {
            self.requests.remove(&r);
        }
        self.drop_group(group)
    }

    /// Drops every group and request.
    pub fn clear(&mut self) {
        self.groups.clear();
        self.requests.clear();
        self.total_bytes = 0;
    }

    fn drop_group(&mut self, key: u64) -> bool {
        match self.groups.remove(&key) {
            Some(g) => {
                self.total_bytes -= g.bytes;
                true
            }
            None => false,
        }
    }

    /// Rebuilds one group's automaton from its kept responses and in-flight requests.
    /// Cost: one insertion per token held by the group (the same speed as ingest).
    fn rebuild(&mut self, key: u64) {
        let gamma = self.cfg.version_decay;
        let mut active: Vec<(u64, u64)> = self
            .requests
            .iter()
            .filter(|(_, r)| r.group == key)
            .map(|(&rid, r)| (r.seq, rid))
            .collect();
        active.sort_unstable();
        let g = self
            .groups
            .get_mut(&key)
            .expect("rebuild of a missing group");
        let min_v = g
            .responses
            .iter()
            .map(|r| r.version)
            .chain(active.iter().map(|(_, rid)| self.requests[rid].version))
            .min()
            .unwrap_or(g.max_version);
        g.weight_base = min_v;
        g.sam = Sam::new();
        g.log = Log::new();
        g.prompt_last.iter_mut().for_each(|l| *l = NONE);
        g.dirty = false;
        g.discarded = 0;
        let resp = std::mem::take(&mut g.responses);
        for r in &resp {
            let w = g.weight(r.version, gamma);
            g.insert(r.prompt, &r.tokens, w, true);
        }
        g.responses = resp;
        for (_, rid) in active {
            let req = self.requests.get_mut(&rid).expect("listed request");
            req.weight = g.weight(req.version, gamma);
            // Clocks changed: the pointer starts over from the automaton's next match.
            req.follow = Follow::LOST;
            match req.tokens.split_last() {
                Some((&t, head)) => {
                    let (prev, clock) = g.insert(req.prompt, head, req.weight, true);
                    (req.last, req.clock) = g.push(prev, clock, t, req.weight, true);
                }
                None => {
                    req.clock = NONE;
                    req.last = g.insert(req.prompt, &[], req.weight, true).0;
                }
            }
        }
        if g.active > 0 {
            g.ensure_clean();
        }
        self.rebuilds += 1;
    }

    /// Keeps version weights inside f32 range: rebuilds with a newer base when needed.
    fn rebase_if_needed(&mut self, key: u64) {
        let gamma = self.cfg.version_decay;
        if gamma >= 1.0 {
            return;
        }
        let g = &self.groups[&key];
        if (g.max_version.saturating_sub(g.weight_base)) as f64 * -(gamma as f64).ln() > 60.0 {
            self.rebuild(key);
        }
    }

    fn enforce_budget(&mut self) {
        let max = self.cfg.max_bytes;
        if max == 0 || self.total_bytes <= max {
            return;
        }
        // Evict down to 90% of the budget so that a steady stream of finishes does not evict on
        // every call.
        let target = max / 10 * 9;
        let mut idle: Vec<(u64, u64)> = self
            .groups
            .iter()
            .filter(|(_, g)| g.active == 0)
            .map(|(&k, g)| (g.last_used, k))
            .collect();
        idle.sort_unstable();
        for (_, k) in idle {
            if self.total_bytes <= target {
                break;
            }
            self.drop_group(k);
            self.evictions += 1;
        }
    }

    /// Snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let mut s = Stats {
            groups: self.groups.len(),
            requests: self.requests.len(),
            bytes: self.total_bytes,
            rebuilds: self.rebuilds,
            evictions: self.evictions,
            ..Default::default()
        };
        for g in self.groups.values() {
            s.responses += g.responses.len();
            s.tokens += g.responses.iter().map(|r| r.tokens.len()).sum::<usize>();
            s.prompt_tokens += g.prompts.iter().map(|p| p.len()).sum::<usize>();
            s.states += g.sam.num_states();
            s.edges += g.sam.num_edges();
        }
        s.tokens += self
            .requests
            .values()
            .map(|r| r.tokens.len())
            .sum::<usize>();
        s
    }

    /// Whether `rid` is in flight.
    pub fn has_request(&self, rid: u64) -> bool {
        self.requests.contains_key(&rid)
    }

    /// The group a request belongs to.
    pub fn request_group(&self, rid: u64) -> Result<u64> {
        self.requests
            .get(&rid)
            .map(|r| r.group)
            .ok_or(CoreError::UnknownRequest(rid))
    }

    /// The kept responses of a group, oldest first (empty when the group is unknown).
    pub fn responses(&self, group: u64) -> Vec<(Vec<u32>, &Response)> {
        match self.groups.get(&group) {
            Some(g) => g
                .responses
                .iter()
                .map(|r| (g.prompts[r.prompt as usize].clone(), r))
                .collect(),
            None => Vec::new(),
        }
    }

    /// Groups held, in ascending key order.
    pub fn group_keys(&self) -> Vec<u64> {
        let mut k: Vec<u64> = self.groups.keys().copied().collect();
        k.sort_unstable();
        k
    }

    /// Grows the draft for one request: nodes in BFS order, unpadded, root first.
    pub fn draft_nodes(
        &self,
        rid: u64,
        budget: usize,
        chain: bool,
        drafter: &mut Drafter,
    ) -> Result<Vec<Node>> {
        if budget == 0 {
            return Err(CoreError::InvalidArgument(
                "draft budget must be at least 1".into(),
            ));
        }
        Ok(self.grow(rid, budget, chain, drafter)?.to_vec())
    }

    fn grow<'d>(
        &self,
        rid: u64,
        budget: usize,
        chain: bool,
        drafter: &'d mut Drafter,
    ) -> Result<&'d [Node]> {
        let (req, g) = self.request_and_group(rid)?;
        let job = self.job(req, g, budget, chain);
        Ok(drafter.grow_job(&job, &self.cfg.draft))
    }

    /// What the reference drafter reads for request `rid` (the tests check the drafter against
    /// it): its group's automaton, the state of its context, the root token, its pointer and
    /// the newest version's weight.
    #[cfg(test)]
    pub(crate) fn reference_input(&self, rid: u64) -> Result<crate::draft::reference::Input<'_>> {
        let (req, g) = self.request_and_group(rid)?;
        let job = self.job(req, g, 1, false);
        Ok(crate::draft::reference::Input {
            sam: &g.sam,
            last: req.last,
            root_tok: job.root_tok,
            pointer: job.pointer.map(|p| (p.log, p.pred, p.weight, p.then)),
            w_new: job.w_new,
        })
    }

    /// An in-flight request and its group.
    fn request_and_group(&self, rid: u64) -> Result<(&Request, &Group)> {
        let req = self
            .requests
            .get(&rid)
            .ok_or(CoreError::UnknownRequest(rid))?;
        Ok((req, &self.groups[&req.group]))
    }

    /// Prefetches the automaton state and pointer entry that [`HistoryIndex::job`] reads first.
    fn prefetch_job(req: &Request, g: &Group) {
        prefetch(&g.sam.states, req.last as usize);
        g.log.prefetch(req.follow.pred);
    }

    /// What growing `req`'s draft reads: its anchor (the longest match with continuations), its
    /// pointer and its group `g`'s automaton.
    fn job<'a>(&self, req: &Request, g: &'a Group, budget: usize, chain: bool) -> Job<'a> {
        let root_tok = match req.tokens.last() {
            Some(&t) => t,
            None => *g.prompts[req.prompt as usize]
                .last()
                .expect("non-empty prompt"),
        };
        let cfg = &self.cfg.draft;
        let sam = &g.sam;
        let mut anchor = sam
            .longest_with_children(req.last, cfg.min_match)
            .unwrap_or(NONE);
        let w_new = g.weight(g.max_version, self.cfg.version_decay);
        let (weight, then) = req.follow.weights([cfg.follow, cfg.follow_resync]);
        let pointer = (cfg.follow > 0.0).then_some(Pointer {
            log: &g.log,
            pred: req.follow.pred,
            weight,
            then,
        });
        // A hub root (a short match with many continuations) defers to a trusted source pointer.
        if let Some(p) = pointer {
            if anchor != NONE
                && cfg.hub_follow < 1.0
                && p.pred != NONE
                && p.weight >= cfg.hub_follow
                && sam.degree(anchor) >= cfg.hub_follow_degree
            {
                anchor = NONE;
            }
        }
        Job {
            sam,
            root_tok,
            anchor,
            pointer,
            budget,
            chain,
            w_new,
        }
    }

    /// Every request of a batch with its group (the first unknown id is an error). The lookups
    /// are independent, so the CPU overlaps their cache misses.
    fn resolve(&self, rids: &[u64]) -> Result<Vec<(&Request, &Group)>> {
        rids.iter().map(|&r| self.request_and_group(r)).collect()
    }

    /// Grows the drafts of `reqs` with their memory accesses interleaved
    /// ([`Drafter::grow_many`]); `emit(i, nodes)` receives request `i`'s draft.
    fn grow_batch(
        &self,
        reqs: &[(&Request, &Group)],
        budget: usize,
        chain: bool,
        drafter: &mut Drafter,
        emit: impl FnMut(usize, &[Node]),
    ) {
        drafter.grow_many(
            reqs.len(),
            &self.cfg.draft,
            |i| self.job(reqs[i].0, reqs[i].1, budget, chain),
            |i| Self::prefetch_job(reqs[i].0, reqs[i].1),
            emit,
        );
    }

    /// Drafts a `d`-node tree for every request of a batch into flat buffers:
    /// `tokens[bs*d]`, `mask[bs*d*d]`, optional `probs[bs*d]` and optional `counts[bs]` (real
    /// draft nodes per request, root and pads excluded). Large batches are split across the
    /// index's threads ([`HistoryIndex::set_threads`]); the drafts are the same.
    #[allow(clippy::too_many_arguments)]
    pub fn draft_tree_batch<M: MaskElem>(
        &self,
        rids: &[u64],
        d: usize,
        tokens: &mut [i64],
        mask: &mut [M],
        probs: Option<&mut [f32]>,
        counts: Option<&mut [i64]>,
        drafter: &mut Drafter,
    ) -> Result<BatchDraftStats> {
        if d == 0 {
            return Err(CoreError::InvalidArgument(
                "the number of draft nodes must be at least 1".into(),
            ));
        }
        let bs = rids.len();
        expect_len("tokens", tokens.len(), bs * d)?;
        expect_len("mask", mask.len(), bs * d * d)?;
        if let Some(p) = probs.as_deref() {
            expect_len("probs", p.len(), bs * d)?;
        }
        if let Some(c) = counts.as_deref() {
            expect_len("counts", c.len(), bs)?;
        }
        let reqs = self.resolve(rids)?;
        let ranges = split(bs, self.par.parts(bs));
        let tasks: Vec<_> = ranges
            .iter()
            .cloned()
            .zip(split_mut(tokens, &ranges, d))
            .zip(split_mut(mask, &ranges, d * d))
            .zip(split_opt(probs, &ranges, d))
            .zip(split_opt(counts, &ranges, 1))
            .collect();
        Ok(self.draft_parts(
            tasks,
            drafter,
            |((((r, tokens), mask), mut probs), mut counts), dr| {
                let mut st = BatchDraftStats::default();
                self.grow_batch(&reqs[r], d, false, dr, |i, nodes| {
                    let p = probs.as_deref_mut().map(|p| &mut p[i * d..(i + 1) * d]);
                    let n = write_tree(
                        nodes,
                        d,
                        &mut tokens[i * d..(i + 1) * d],
                        &mut mask[i * d * d..(i + 1) * d * d],
                        p,
                    );
                    if let Some(c) = counts.as_deref_mut() {
                        c[i] = (n - 1) as i64;
                    }
                    st.nodes += n - 1;
                    st.nonempty += (n > 1) as usize;
                });
                st
            },
        ))
    }

    /// Drafts a chain of up to `k` tokens for every request: `tokens[bs*k]` (0-padded),
    /// `lens[bs]` real lengths, optional `probs[bs*k]`. Split across threads like
    /// [`HistoryIndex::draft_tree_batch`].
    pub fn draft_chain_batch(
        &self,
        rids: &[u64],
        k: usize,
        tokens: &mut [i64],
        lens: &mut [i64],
        probs: Option<&mut [f32]>,
        drafter: &mut Drafter,
    ) -> Result<BatchDraftStats> {
        if k == 0 {
            return Err(CoreError::InvalidArgument(
                "the chain length must be at least 1".into(),
            ));
        }
        let bs = rids.len();
        expect_len("tokens", tokens.len(), bs * k)?;
        expect_len("lens", lens.len(), bs)?;
        if let Some(p) = probs.as_deref() {
            expect_len("probs", p.len(), bs * k)?;
        }
        let reqs = self.resolve(rids)?;
        let ranges = split(bs, self.par.parts(bs));
        let tasks: Vec<_> = ranges
            .iter()
            .cloned()
            .zip(split_mut(tokens, &ranges, k))
            .zip(split_mut(lens, &ranges, 1))
            .zip(split_opt(probs, &ranges, k))
            .collect();
        Ok(
            self.draft_parts(tasks, drafter, |(((r, tokens), lens), mut probs), dr| {
                let mut st = BatchDraftStats::default();
                self.grow_batch(&reqs[r], k + 1, true, dr, |i, nodes| {
                    let p = probs.as_deref_mut().map(|p| &mut p[i * k..(i + 1) * k]);
                    let n = write_chain(nodes, &mut tokens[i * k..(i + 1) * k], p);
                    lens[i] = n as i64;
                    st.nodes += n;
                    st.nonempty += (n > 0) as usize;
                });
                st
            }),
        )
    }

    /// Drafts the parts of a batch (from [`split`]) and sums their stats: a batch in one part on
    /// the caller's `drafter`, several on the index's threads, each with its own scratch drafter
    /// (the same drafts either way; `drafter.interleave` applies to all).
    fn draft_parts<T: Send>(
        &self,
        tasks: Vec<T>,
        drafter: &mut Drafter,
        part: impl Fn(T, &mut Drafter) -> BatchDraftStats + Sync,
    ) -> BatchDraftStats {
        if tasks.len() == 1 {
            let task = tasks.into_iter().next().expect("one task");
            return part(task, drafter);
        }
        let interleave = drafter.interleave;
        self.par
            .run(tasks, |t| {
                PART_DRAFTER.with(|dr| {
                    let dr = &mut dr.borrow_mut();
                    dr.interleave = interleave;
                    part(t, dr)
                })
            })
            .into_iter()
            .fold(BatchDraftStats::default(), |a, b| a + b)
    }
}

fn expect_len(name: &'static str, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(CoreError::BufferShape {
            name,
            got,
            expected,
        });
    }
    Ok(())
}

/// Drops responses beyond the per-group limits; true when something was dropped.
fn apply_retention(g: &mut Group, cfg: &IndexConfig) -> bool {
    let mut dropped = false;
    if cfg.max_responses > 0 {
        while g.responses.len() > cfg.max_responses {
            g.responses.pop_front();
            dropped = true;
        }
    }
    if cfg.max_versions > 0 {
        let mut vs: Vec<u64> = g.responses.iter().map(|r| r.version).collect();
        vs.sort_unstable();
        vs.dedup();
        if vs.len() > cfg.max_versions {
            let cutoff = vs[vs.len() - cfg.max_versions];
            let before = g.responses.len();
            g.responses.retain(|r| r.version >= cutoff);
            dropped |= g.responses.len() != before;
        }
    }
    dropped
}
