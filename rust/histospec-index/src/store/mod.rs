//! Per-prompt histories: groups, in-flight requests, retention, eviction and batch drafting.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

mod appends;
mod drafting;
mod group;

pub use drafting::BatchDraftStats;
use group::{append, Group, Request};

use crate::draft::DraftConfig;
use crate::error::{CoreError, Result};
use crate::follow::{Follow, Log};
use crate::par::{Par, MAX_THREADS};
use crate::sam::{Sam, NONE};

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

    /// How many finished responses `group` holds (0 when it is not held).
    pub fn group_len(&self, group: u64) -> usize {
        self.groups.get(&group).map_or(0, |g| g.responses.len())
    }

    /// Groups held, in ascending key order.
    pub fn group_keys(&self) -> Vec<u64> {
        let mut k: Vec<u64> = self.groups.keys().copied().collect();
        k.sort_unstable();
        k
    }
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
