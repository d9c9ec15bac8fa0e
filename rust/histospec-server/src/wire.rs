//! Records as the server keeps and sends them: encoded once, when stored.
//!
//! `EncodedSubscribeResponse` and `EncodedSnapshotChunk` put the same bytes on the wire as
//! `proto::SubscribeResponse` and `proto::SnapshotChunk`: a length-delimited `bytes` field and an
//! embedded message share a wire type, so a field of pre-encoded `Record`s decodes as `repeated
//! Record` on the other side. Every subscriber then costs a copy of bytes instead of a deep clone and a
//! varint encoding of every token.

use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use prost::Message;

use crate::proto::Record;

/// One file of the data dir (a log, or the snapshot), open for reading for as long as a record lies
/// in it: reads go on after compaction has unlinked the file, whose space the system frees once the
/// last such record has moved on.
#[derive(Debug)]
pub struct Segment {
    pub file: File,
    pub path: PathBuf,
}

impl Segment {
    pub fn open(path: PathBuf) -> io::Result<Arc<Segment>> {
        Ok(Arc::new(Segment {
            file: File::open(&path)?,
            path,
        }))
    }
}

/// Where a record's frame payload lies on disk.
#[derive(Debug, Clone)]
pub struct Loc {
    pub segment: Arc<Segment>,
    /// Offset of the payload (its frame header, length and CRC-32, is the 8 bytes before).
    pub offset: u64,
}

/// One retained record: what the store, the log and the subscribers need.
#[derive(Debug, Clone)]
pub struct Stored {
    pub sequence: u64,
    pub group_key: Option<u64>,
    pub record_id: Vec<u8>,
    /// Prompt + response tokens.
    pub tokens: u64,
    /// Bytes of its protobuf encoding.
    pub len: usize,
    /// The encoding, while the record is held in memory (None: read it back from `at`).
    pub encoded: Option<Bytes>,
    /// Where it is on disk, once appended to the data dir's log.
    pub at: Option<Loc>,
    /// Its content hash (`validate::content_hash`: what an idempotent re-publish is compared with).
    pub hash: u64,
}

impl Stored {
    /// Encodes `r` (its `sequence` already assigned), whose content hash is `hash`.
    pub fn new(r: &Record, hash: u64) -> Self {
        let encoded = Bytes::from(r.encode_to_vec());
        Stored {
            sequence: r.sequence,
            group_key: r.group_key,
            record_id: r.record_id.clone(),
            tokens: (r.prompt_ids.len() + r.response_ids.len()) as u64,
            len: encoded.len(),
            encoded: Some(encoded),
            at: None,
            hash,
        }
    }

    /// The record's encoding: from memory, or read back from its frame on disk (checked against the
    /// frame's length and CRC-32).
    pub fn bytes(&self) -> io::Result<Bytes> {
        if let Some(b) = &self.encoded {
            return Ok(b.clone());
        }
        let at = self.at.as_ref().ok_or_else(|| {
            io::Error::other(format!(
                "record {} is held neither in memory nor on disk",
                self.sequence
            ))
        })?;
        let mut buf = vec![0u8; 8 + self.len];
        read_exact_at(&at.segment.file, &mut buf, at.offset - 8)?;
        let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(buf[4..8].try_into().unwrap());
        if len != self.len || crc32fast::hash(&buf[8..]) != crc {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: the frame of record {} at byte {} is damaged",
                    at.segment.path.display(),
                    self.sequence,
                    at.offset
                ),
            ));
        }
        Ok(Bytes::from(buf).slice(8..))
    }

    /// The same record with its encoding read back into memory (it stays on disk too).
    pub fn warm(&self) -> io::Result<Stored> {
        Ok(Stored {
            encoded: Some(self.bytes()?),
            ..self.clone()
        })
    }

    /// The same record without its encoding in memory, if it is on disk.
    pub fn cold(&self) -> Option<Stored> {
        self.at.as_ref()?;
        Some(Stored {
            encoded: None,
            ..self.clone()
        })
    }

    /// The record back (tests, tools).
    pub fn decode(&self) -> Record {
        Record::decode(self.bytes().expect("the record is readable"))
            .expect("the server encoded this record itself")
    }
}

#[cfg(unix)]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(f, buf, offset)
}

#[cfg(not(unix))]
fn read_exact_at(f: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = f.try_clone()?;
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(buf)
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
    #[prost(uint64, repeated, tag = "5")]
    pub announced_groups: Vec<u64>,
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
        let stored: Vec<Stored> = recs.iter().map(|r| Stored::new(r, 0)).collect();
        let sub = EncodedSubscribeResponse {
            records: stored.iter().map(|s| s.bytes().unwrap()).collect(),
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
            records: stored.iter().map(|s| s.bytes().unwrap()).collect(),
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
