//! Drafting: one request, and whole batches into SGLang's buffers, split across threads.

use super::group::{Group, Request};
use super::HistoryIndex;
use crate::draft::{write_chain, write_tree, Drafter, Job, MaskElem, Node, Pointer};
use crate::error::{CoreError, Result};
use crate::par::{split, split_mut, split_opt};
use crate::sam::{prefetch, NONE};

thread_local! {
    // Scratch space for the parts of a batch that run on pool threads (and on the caller, when a
    // batch is split).
    static PART_DRAFTER: std::cell::RefCell<Drafter> = std::cell::RefCell::new(Drafter::default());
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

impl HistoryIndex {
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
