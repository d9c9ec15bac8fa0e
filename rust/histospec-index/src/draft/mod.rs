//! Chain and tree drafts grown from automaton states.
//!
//! Policy (tuned with `histospec-sgl bench index` and `histospec-sgl replay`):
//! 1. *Match.* The anchor is the longest suffix of the request's context that occurs elsewhere with a
//!    continuation: the request's own last state, followed along suffix links to the first state
//!    that has children. Suffixes shorter than `min_match` never anchor a draft.
//! 2. *Child estimate* ([`estimate`]). For a tree node in state `s` with children `c_1..c_m` of
//!    weighted counts `n_i` (exact occurrence counts of context+token when versions are
//!    unweighted), the frequency estimate is `n_i / (Σn + escape·w)`, where `w` is the weight of
//!    one occurrence of the group's newest version: the `escape` mass is the chance that the
//!    continuation is new, so a continuation seen once behind a long match is not taken as
//!    certain. The recency estimate gives the child of the r-th most recent occurrence
//!    `(Σn/(Σn+escape·w))·(1-β)·β^r`. A node's probability mixes both,
//!    `(1-recency)·freq + recency·rec`. The escape pseudo-count is `escape + escape_short/L` for a
//!    context of length `L` (short matches are less reliable). Defaults (recency 0.3,
//!    escape_short 2) were chosen on real rollouts with `histospec-sgl replay` (GRPO, expert
//!    iteration, HumanEval).
//! 3. *Growth* ([`grow`]). Best-first: the frontier is a max-heap of path probabilities (product
//!    of the estimates along the path); the best candidate becomes a node until the budget is used
//!    or the best candidate falls below `min_prob`. Each node offers at most `max_children`
//!    children. A chain is the same process with one child per node.
//! 4. *Source following* (`follow > 0`, see [`crate::follow`]). The request keeps a pointer into
//!    the earlier string it is rewriting; the pointer's next token is mixed into each estimate
//!    along its path with a weight learned per request: `(1-λ)·estimate + λ·[token = source's]`,
//!    where λ is the share of the pointer's predictions that held when the automaton's favourite
//!    disagreed (a prior for in-step and after-a-break predictions, then the request's record).
//!    Nodes only the pointer predicts carry no automaton state and continue along the pointer.
//!    A fixed λ lost acceptance on the real rollouts, which is why it is learned.
//!    A root anchored at a hub (a match with at least `hub_follow_degree` continuations: a short
//!    context, usually because the last token broke a longer match) drafts the pointer's path
//!    alone when the pointer's weight is at least `hub_follow`: the hub's continuations share the
//!    budget thinly, and reading each of them is most of such a root's cost.
//! 5. *Fallback.* A node whose state has no continuation (its match reached the end of a stored
//!    string) continues from the longest suffix that has one, if that suffix is at least
//!    `min_match` long.
//! 6. *Layout* ([`layout`]). Nodes are emitted in BFS order (parents first, root = last context
//!    token at 0). Unused slots are a chain of token-0 pads hung under the last node, so no node
//!    ever has two children with the same token (SGLang's sampling verification sums duplicate
//!    siblings).
//! 7. *Batches.* A batch call grows [`LANES`] requests at a time and alternates between them: a
//!    node expansion that reads a state with several transitions first prefetches them, then
//!    yields to the next request, so the cache misses of several requests overlap. The drafts are
//!    exactly those drafted one at a time.
//!
//! The test-only `reference` module writes the same policy as plainly as possible; property tests
//! check that the drafter's output equals it.

mod config;
mod estimate;
mod frontier;
mod grow;
mod layout;
#[cfg(test)]
pub(crate) mod reference;
#[cfg(test)]
mod tests;

pub use config::{DraftConfig, KnobValue};
#[cfg(test)]
pub(crate) use grow::LANES;
pub use grow::{Drafter, Job, Pointer};
pub use layout::{write_chain, write_tree, MaskElem};

/// One drafted node: its token, its parent's position (`NONE` for the root) and its estimated
/// probability of being accepted (product along its path; 1 for the root, 0 for pads).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Node {
    pub tok: u32,
    pub parent: u32,
    pub prob: f32,
}
