//! histospec-index: per-prompt generalized suffix automata over RL rollout history that draft
//! speculative-decoding chains and trees for a whole decode batch.
//!
//! The entry point is [`HistoryIndex`]: requests begin in a group (one prompt's history), grow as
//! tokens are accepted, and become history when they finish; [`HistoryIndex::draft_tree_batch`]
//! fills SGLang's draft-token and mask buffers for a batch in one call.

mod draft;
mod error;
mod follow;
mod par;
#[cfg(test)]
mod props;
mod sam;
mod snapshot;
mod store;

pub use draft::{DraftConfig, Drafter, KnobValue, Node};
pub use error::{CoreError, Result};
pub use snapshot::FORMAT_VERSION;
pub use store::{
    check_tokens, BatchDraftStats, Finish, FixedMap, HistoryIndex, IndexConfig, Response, Stats,
};

/// The group key of a prompt: XXH3-64 (seed 0) of its token ids as little-endian int32 bytes.
/// Every component (SGLang worker, publisher, draft server) derives group keys this way.
pub fn prompt_key(prompt: &[i32]) -> u64 {
    let mut bytes = Vec::with_capacity(prompt.len() * 4);
    for &t in prompt {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&bytes)
}
