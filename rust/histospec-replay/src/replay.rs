//! Offline simulation of speculative decoding against a known continuation.
//!
//! The request drafts exactly as the SGLang worker does at each verify step; the draft is accepted
//! greedily along the tree (exact match with the logged continuation); the request then advances by
//! accepted + 1 tokens (the bonus token the target model emits), which are appended to the index.

use std::time::Instant;

use histospec_index::{CoreError, Drafter, HistoryIndex, Node, Result};

/// Per-step outcome of a replay.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplayTrace {
    /// Accepted draft tokens at each verify step (the bonus token excluded).
    pub accepted: Vec<u32>,
    /// Real draft nodes offered at each step (root excluded).
    pub drafted: Vec<u32>,
    /// Tokens the step emitted: accepted + 1, or just the accepted rest of the response.
    pub emitted: Vec<u32>,
    /// Nanoseconds spent drafting, summed over steps.
    pub draft_ns: u64,
    /// Nanoseconds spent appending accepted tokens, summed over steps.
    pub update_ns: u64,
}

/// Length of the longest root path of `nodes` whose tokens equal `truth`'s prefix.
pub fn accept_greedy(nodes: &[Node], truth: &[u32]) -> usize {
    let mut cur = 0u32;
    let mut acc = 0usize;
    'outer: while acc < truth.len() {
        for (j, n) in nodes.iter().enumerate().skip(cur as usize + 1) {
            if n.parent == cur && n.tok == truth[acc] {
                cur = j as u32;
                acc += 1;
                continue 'outer;
            }
        }
        break;
    }
    acc
}

/// Replays `truth` as the continuation of in-flight request `rid` of `ix`. `truth[0]` is appended as
/// the prefill's token; every later token comes from a verify step.
///
/// `budget`: tree nodes including the root (`chain`: chain length + 1). With `every_position`
/// the request advances one token per step (acceptance measured at every position) instead of
/// accepted + 1.
pub fn replay(
    ix: &mut HistoryIndex,
    rid: u64,
    truth: &[i32],
    budget: usize,
    chain: bool,
    every_position: bool,
    drafter: &mut Drafter,
) -> Result<ReplayTrace> {
    if budget < 2 {
        return Err(CoreError::InvalidArgument(
            "replay needs a draft budget of at least 2 nodes".into(),
        ));
    }
    let truth = ix.check_tokens(truth)?;
    let truth_i32: Vec<i32> = truth.iter().map(|&t| t as i32).collect();
    let mut tr = ReplayTrace::default();
    if truth.is_empty() {
        return Ok(tr);
    }
    // The first token comes from prefill, which cannot verify a draft.
    ix.extend_request(rid, &truth_i32[..1])?;
    let mut pos = 1usize;
    while pos < truth.len() {
        let t0 = Instant::now();
        let nodes = ix.draft_nodes(rid, budget, chain, drafter)?;
        let t1 = Instant::now();
        // The draft below the root predicts truth[pos..]; when it covers the rest of the
        // response, no bonus token follows.
        let acc = accept_greedy(&nodes, &truth[pos..]);
        tr.accepted.push(acc as u32);
        tr.drafted.push(nodes.len() as u32 - 1);
        let adv = if every_position {
            1
        } else {
            (acc + 1).min(truth.len() - pos)
        };
        tr.emitted.push((acc + 1).min(truth.len() - pos) as u32);
        let t2 = Instant::now();
        ix.extend_request(rid, &truth_i32[pos..pos + adv])?;
        tr.update_ns += t2.elapsed().as_nanos() as u64;
        tr.draft_ns += (t1 - t0).as_nanos() as u64;
        pos += adv;
    }
    Ok(tr)
}
