//! Checks every published record before anything is stored: a request is accepted whole or refused
//! whole, with the index of the first bad record in the message.

use crate::proto::Record;

/// Longest accepted record id, in bytes.
pub const MAX_RECORD_ID: usize = 128;
/// Largest token id + 1 (ids are int32 in the index).
pub const TOKEN_LIMIT: u32 = 1 << 31;

/// Why a record was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Invalid {
    #[error("record {0}: record_id must be 1..{MAX_RECORD_ID} bytes, got {1}")]
    RecordId(usize, usize),
    #[error("record {0}: prompt_ids is empty")]
    EmptyPrompt(usize),
    #[error("record {0}: response_ids is empty")]
    EmptyResponse(usize),
    #[error("record {0}: token id {1} in {2} is not below 2^31")]
    Token(usize, u32, &'static str),
    #[error("record {0}: {1} logprobs for {2} response tokens (give none or one per token)")]
    LogprobLen(usize, usize, usize),
    #[error("record {0}: logprob {1} at position {2} is NaN or positive")]
    Logprob(usize, f32, usize),
    #[error("record {0}: reward is NaN")]
    Reward(usize),
    #[error("record {0} has {1} tokens; the server takes at most {2} per record")]
    TooLong(usize, usize, usize),
    #[error("record_id {0:?} appears twice in one request with different contents")]
    Conflict(String),
}

/// Validates record `i`; `max_tokens_per_record` bounds prompt + response.
pub fn check(i: usize, r: &Record, max_tokens_per_record: usize) -> Result<(), Invalid> {
    if r.record_id.is_empty() || r.record_id.len() > MAX_RECORD_ID {
        return Err(Invalid::RecordId(i, r.record_id.len()));
    }
    if r.prompt_ids.is_empty() {
        return Err(Invalid::EmptyPrompt(i));
    }
    if r.response_ids.is_empty() {
        return Err(Invalid::EmptyResponse(i));
    }
    let n = r.prompt_ids.len() + r.response_ids.len();
    if n > max_tokens_per_record {
        return Err(Invalid::TooLong(i, n, max_tokens_per_record));
    }
    for (field, ids) in [
        ("prompt_ids", &r.prompt_ids),
        ("response_ids", &r.response_ids),
    ] {
        if let Some(&t) = ids.iter().find(|&&t| t >= TOKEN_LIMIT) {
            return Err(Invalid::Token(i, t, field));
        }
    }
    if !r.logprobs.is_empty() {
        if r.logprobs.len() != r.response_ids.len() {
            return Err(Invalid::LogprobLen(
                i,
                r.logprobs.len(),
                r.response_ids.len(),
            ));
        }
        // -inf is a legal log-prob (a token the policy gave no mass, e.g. under a filter).
        if let Some((p, &lp)) = r
            .logprobs
            .iter()
            .enumerate()
            .find(|(_, lp)| lp.is_nan() || **lp > 0.0)
        {
            return Err(Invalid::Logprob(i, lp, p));
        }
    }
    if r.reward.is_some_and(f32::is_nan) {
        return Err(Invalid::Reward(i));
    }
    Ok(())
}

/// The group key a record is stored under: its explicit key or `prompt_key(prompt_ids)`.
pub fn group_of(r: &Record) -> u64 {
    use histospec_index::{group_key, Group};
    match r.group_key {
        Some(k) => group_key(Group::Key(k)),
        None => {
            let p: Vec<i32> = r.prompt_ids.iter().map(|&t| t as i32).collect();
            group_key(Group::Prompt(&p))
        }
    }
}

/// Content hash of a record as stored (group resolved; its sequence excluded), so a record reloaded
/// from disk hashes as it did when published: tells a retry from a reused id.
pub fn content_hash(r: &Record) -> u64 {
    use prost::Message;
    let mut c = r.clone();
    c.sequence = 0;
    xxhash_rust::xxh3::xxh3_64(&c.encode_to_vec())
}

/// Resolves every record's group as the server stores it (an explicit key, or `prompt_key`) and
/// returns their content hashes: a record published with or without its `prompt_key` as explicit
/// group is the same record.
pub fn resolve(records: &mut [Record]) -> Vec<u64> {
    records
        .iter_mut()
        .map(|r| {
            r.group_key = Some(group_of(r));
            content_hash(r)
        })
        .collect()
}
