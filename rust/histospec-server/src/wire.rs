//! Records as the server keeps and sends them: encoded once, when stored.
//!
//! `EncodedSubscribeResponse` and `EncodedSnapshotChunk` put the same bytes on the wire as
//! `proto::SubscribeResponse` and `proto::SnapshotChunk`: a length-delimited `bytes` field and an
//! embedded message share a wire type, so a field of pre-encoded `Record`s decodes as `repeated
//! Record` on the other side. Every subscriber then costs a copy of bytes instead of a deep clone and a
//! varint encoding of every token.

use bytes::Bytes;
use prost::Message;

use crate::proto::Record;

/// One retained record: what the store, the log and the subscribers need.
#[derive(Debug, Clone)]
pub struct Stored {
    pub sequence: u64,
    pub group_key: Option<u64>,
    pub record_id: Vec<u8>,
    /// Prompt + response tokens.
    pub tokens: u64,
    /// The record's protobuf encoding.
    pub encoded: Bytes,
}

impl Stored {
    /// Encodes `r` (its `sequence` already assigned).
    pub fn new(r: &Record) -> Self {
        Stored {
            sequence: r.sequence,
            group_key: r.group_key,
            record_id: r.record_id.clone(),
            tokens: (r.prompt_ids.len() + r.response_ids.len()) as u64,
            encoded: Bytes::from(r.encode_to_vec()),
        }
    }

    /// The record back (tests, tools).
    pub fn decode(&self) -> Record {
        Record::decode(self.encoded.clone()).expect("the server encoded this record itself")
    }
}

/// `histospec.v1.SubscribeResponse` with its records pre-encoded.
#[derive(Clone, PartialEq, Message)]
pub struct EncodedSubscribeResponse {
    #[prost(bytes = "bytes", repeated, tag = "1")]
    pub records: Vec<Bytes>,
    #[prost(uint64, tag = "2")]
    pub head_sequence: u64,
}

/// `histospec.v1.FollowResponse` with its records pre-encoded.
#[derive(Clone, PartialEq, Message)]
pub struct EncodedFollowResponse {
    #[prost(bytes = "bytes", repeated, tag = "1")]
    pub records: Vec<Bytes>,
    #[prost(uint64, tag = "2")]
    pub head_sequence: u64,
    #[prost(uint64, repeated, tag = "3")]
    pub ready_groups: Vec<u64>,
    #[prost(uint64, tag = "4")]
    pub cursor: u64,
}

/// `histospec.v1.SnapshotChunk` with its records pre-encoded.
#[derive(Clone, PartialEq, Message)]
pub struct EncodedSnapshotChunk {
    #[prost(bytes = "bytes", repeated, tag = "1")]
    pub records: Vec<Bytes>,
    #[prost(uint64, tag = "2")]
    pub through_sequence: u64,
    #[prost(uint64, tag = "3")]
    pub total_records: u64,
    #[prost(bool, tag = "4")]
    pub last: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{SnapshotChunk, SubscribeResponse};

    fn rec(seq: u64) -> Record {
        Record {
            record_id: format!("r{seq}").into_bytes(),
            group_key: Some(seq * 3),
            prompt_ids: vec![1, 300, 70_000],
            response_ids: (0..50).map(|i| i * 997).collect(),
            version: 4,
            sample_index: 2,
            logprobs: vec![-0.5; 50],
            reward: Some(1.0),
            sequence: seq,
        }
    }

    #[test]
    fn encoded_messages_decode_as_the_proto_messages() {
        let recs: Vec<Record> = (1..=3).map(rec).collect();
        let stored: Vec<Stored> = recs.iter().map(Stored::new).collect();
        let sub = EncodedSubscribeResponse {
            records: stored.iter().map(|s| s.encoded.clone()).collect(),
            head_sequence: 9,
        };
        let want = SubscribeResponse {
            records: recs.clone(),
            head_sequence: 9,
        };
        assert_eq!(sub.encode_to_vec(), want.encode_to_vec());
        assert_eq!(
            SubscribeResponse::decode(&sub.encode_to_vec()[..]).unwrap(),
            want
        );
        let chunk = EncodedSnapshotChunk {
            records: stored.iter().map(|s| s.encoded.clone()).collect(),
            through_sequence: 3,
            total_records: 3,
            last: true,
        };
        let got = SnapshotChunk::decode(&chunk.encode_to_vec()[..]).unwrap();
        assert_eq!(got.records, recs);
        assert!(got.last);
        assert_eq!(stored[1].decode(), recs[1]);
        assert_eq!(stored[1].tokens, 53);
    }
}
