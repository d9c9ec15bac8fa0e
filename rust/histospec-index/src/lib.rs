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

/// The group key of a prompt: XXH3-64 (seed 0) of its token ids as little-endian int32 bytes
/// (`group_key(Group::Prompt(prompt))`).
pub fn prompt_key(prompt: &[i32]) -> u64 {
    let mut bytes = Vec::with_capacity(prompt.len() * 4);
    for &t in prompt {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

/// The seed of a named group's hash: named groups and prompts hash in separate domains, so a name
/// whose UTF-8 bytes equal some prompt's token bytes does not share its group.
pub const NAMED_GROUP_SEED: u64 = 0x6869_7374_6f73_7065; // "histospe"

/// What places a request in its group, the one rule every component keys history by (the SGLang
/// worker, the index binding, the draft server, the trainer adapters and routers):
/// a prompt's token ids (the default: siblings and later epochs of a prompt share its key), a key a
/// caller chose, or a name a caller gave (a trainer's prompt id, a prompt's text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group<'a> {
    /// `prompt_key` of the token ids.
    Prompt(&'a [i32]),
    /// The key itself.
    Key(u64),
    /// XXH3-64 of the name's UTF-8 bytes, seeded with [`NAMED_GROUP_SEED`].
    Name(&'a str),
}

/// The group key of `group` (see [`Group`]).
pub fn group_key(group: Group<'_>) -> u64 {
    match group {
        Group::Prompt(p) => prompt_key(p),
        Group::Key(k) => k,
        Group::Name(n) => xxhash_rust::xxh3::xxh3_64_with_seed(n.as_bytes(), NAMED_GROUP_SEED),
    }
}

#[cfg(test)]
mod group_tests {
    use super::*;

    #[test]
    fn one_rule_for_prompts_keys_and_names() {
        assert_eq!(group_key(Group::Prompt(&[1, 2, 3])), prompt_key(&[1, 2, 3]));
        assert_ne!(prompt_key(&[1, 2, 3]), prompt_key(&[1, 2, 4]));
        assert_eq!(group_key(Group::Key(7)), 7);
        let a = group_key(Group::Name("prompt-17"));
        assert_eq!(a, group_key(Group::Name("prompt-17")));
        assert_ne!(a, group_key(Group::Name("prompt-18")));
        // A name whose bytes are a prompt's token bytes is still another group.
        let bytes: Vec<u8> = [97i32].iter().flat_map(|t| t.to_le_bytes()).collect();
        let name = std::str::from_utf8(&bytes).unwrap();
        assert_ne!(group_key(Group::Name(name)), prompt_key(&[97]));
    }
}
