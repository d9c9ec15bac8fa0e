//! The retained records, in sequence order, with their ids for idempotent publishing, a token
//! budget that evicts the oldest records first, and a memory budget past which the oldest records'
//! encodings are dropped from memory and read back from the data dir when a client asks for them.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::proto::{Record, StatsResponse};
use crate::wire::{Loc, Stored};

/// What a publish did with one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// New: it gets this sequence.
    New(u64),
    /// Already stored under this sequence (same id, same content).
    Duplicate(u64),
}

/// A record id reused with different contents.
#[derive(Debug, thiserror::Error)]
#[error("record_id {id:?} is already stored (sequence {sequence}) with different contents")]
pub struct IdConflict {
    pub id: String,
    pub sequence: u64,
}

/// Retention limits (0: none).
#[derive(Debug, Clone, Copy, Default)]
pub struct Retention {
    pub max_tokens: u64,
    pub max_records: u64,
}

/// Retained records in sequence order, each encoded once. Sequences are consecutive: `records[i]`
/// has `first + i`. `records[..hot_from]` are held on disk only.
#[derive(Debug, Default)]
pub struct Store {
    records: VecDeque<Arc<Stored>>,
    hot_from: usize,
    /// Encoded bytes held in memory, and the most to hold (0: all).
    hot_bytes: u64,
    memory_bytes: u64,
    /// Sequence of `records[0]`; `head + 1` when empty.
    first: u64,
    head: u64,
    ids: HashMap<Vec<u8>, (u64, u64)>,
    /// Each group's retained sequences, oldest first (what `Follow` sends when a group is added).
    groups: HashMap<u64, VecDeque<u64>>,
    tokens: u64,
    retention: Retention,
    pub evicted: u64,
    pub duplicates: u64,
}

/// How many of `records` go into one Subscribe or Snapshot message: at most `max_records`, and none
/// after the one with which the encoded records reach `max_bytes` (always at least one, if any).
pub(crate) fn batch_len<'a>(
    records: impl IntoIterator<Item = &'a Arc<Stored>>,
    max_records: usize,
    max_bytes: usize,
) -> usize {
    let (mut n, mut bytes) = (0usize, 0usize);
    for r in records {
        if n >= max_records || (n > 0 && bytes >= max_bytes) {
            break;
        }
        bytes += r.len;
        n += 1;
    }
    n
}

impl Store {
    pub fn new(retention: Retention) -> Self {
        Store {
            first: 1,
            retention,
            ..Default::default()
        }
    }

    /// Holds at most `bytes` of encoded records in memory (0: all); past it, the oldest records that
    /// are on disk are read back from there when a client asks for them.
    pub fn with_memory_bytes(mut self, bytes: u64) -> Self {
        self.memory_bytes = bytes;
        self
    }

    /// Where each record of a request would go, without storing anything. `hashes[i]` is the
    /// content hash of `records[i]`. Ids repeated within the request map to the first copy.
    pub fn place(&self, records: &[Record], hashes: &[u64]) -> Result<Vec<Placement>, IdConflict> {
        let mut next = self.head + 1;
        let mut batch: HashMap<&[u8], (u64, u64)> = HashMap::new();
        let mut out = Vec::with_capacity(records.len());
        for (r, &h) in records.iter().zip(hashes) {
            let id = r.record_id.as_slice();
            let seen = self.ids.get(id).copied().or_else(|| batch.get(id).copied());
            match seen {
                Some((seq, h0)) if h0 == h => out.push(Placement::Duplicate(seq)),
                Some((sequence, _)) => {
                    return Err(IdConflict {
                        id: String::from_utf8_lossy(id).into_owned(),
                        sequence,
                    })
                }
                None => {
                    batch.insert(id, (next, h));
                    out.push(Placement::New(next));
                    next += 1;
                }
            }
        }
        Ok(out)
    }

    /// Appends a record that [`Store::place`] gave sequence `head + 1` (or one loaded from disk).
    pub fn push(&mut self, record: Stored) {
        assert_eq!(
            record.sequence,
            self.head + 1,
            "records are stored in sequence order"
        );
        self.push_loaded(record);
    }

    /// Appends a record with any sequence above the head (loading from disk: evicted gaps allowed only
    /// before the first record).
    pub fn push_loaded(&mut self, record: Stored) {
        assert!(
            record.sequence > self.head,
            "sequence {} not above head {}",
            record.sequence,
            self.head
        );
        if self.records.is_empty() {
            self.first = record.sequence;
        } else {
            assert_eq!(record.sequence, self.head + 1, "gap in the record sequence");
        }
        self.head = record.sequence;
        self.tokens += record.tokens;
        if record.encoded.is_some() {
            self.hot_bytes += record.len as u64;
        } else {
            // Loaded from the data dir's index without its encoding: only ever before every
            // record held in memory (a restart reads the snapshot's records before the log's).
            assert_eq!(
                self.hot_from,
                self.records.len(),
                "a record on disk only after ones in memory"
            );
            self.hot_from += 1;
        }
        let g = record.group_key.unwrap_or_default();
        self.groups.entry(g).or_default().push_back(record.sequence);
        self.ids
            .insert(record.record_id.clone(), (record.sequence, record.hash));
        self.records.push_back(Arc::new(record));
        self.cool();
    }

    /// Drops the oldest encodings from memory (records on disk only) until the memory budget holds.
    fn cool(&mut self) {
        while self.memory_bytes > 0
            && self.hot_bytes > self.memory_bytes
            && self.hot_from < self.records.len()
        {
            let Some(cold) = self.records[self.hot_from].cold() else {
                break; // not on disk (yet): it stays in memory
            };
            self.hot_bytes -= cold.len as u64;
            self.records[self.hot_from] = Arc::new(cold);
            self.hot_from += 1;
        }
    }

    /// Reads the newest records held on disk only back into memory while the memory budget allows
    /// (all of them without one): after a restart that loaded them from the data dir's index, memory
    /// holds what it held before. Returns how many were read.
    pub fn warm(&mut self) -> std::io::Result<usize> {
        let mut n = 0;
        while self.hot_from > 0 {
            let r = &self.records[self.hot_from - 1];
            if self.memory_bytes > 0 && self.hot_bytes + r.len as u64 > self.memory_bytes {
                break;
            }
            let warm = r.warm()?;
            self.hot_bytes += warm.len as u64;
            self.hot_from -= 1;
            self.records[self.hot_from] = Arc::new(warm);
            n += 1;
        }
        Ok(n)
    }

    /// Points records at where a snapshot has put them (`locs[i]` for `records[i]`, as the
    /// snapshot was given them); records evicted since are skipped.
    pub fn relocate(&mut self, records: &[Arc<Stored>], locs: Vec<Loc>) {
        for (r, at) in records.iter().zip(locs) {
            if r.sequence < self.first || r.sequence > self.head {
                continue;
            }
            let i = (r.sequence - self.first) as usize;
            let mut moved = (*self.records[i]).clone();
            moved.at = Some(at);
            self.records[i] = Arc::new(moved);
        }
    }

    /// Encoded bytes held in memory.
    pub fn resident_bytes(&self) -> u64 {
        self.hot_bytes
    }

    /// Evicts the oldest records until the retention limits hold; returns how many.
    pub fn enforce_retention(&mut self) -> u64 {
        let Retention {
            max_tokens,
            max_records,
        } = self.retention;
        let mut n = 0;
        while let Some(front) = self.records.front() {
            let over_tokens = max_tokens > 0 && self.tokens > max_tokens;
            let over_records = max_records > 0 && self.records.len() as u64 > max_records;
            if !(over_tokens || over_records) {
                break;
            }
            self.tokens -= front.tokens;
            let g = front.group_key.unwrap_or_default();
            if let Some(seqs) = self.groups.get_mut(&g) {
                seqs.pop_front();
                if seqs.is_empty() {
                    self.groups.remove(&g);
                }
            }
            self.ids.remove(&front.record_id);
            if self.hot_from > 0 {
                self.hot_from -= 1;
            } else if front.encoded.is_some() {
                self.hot_bytes -= front.len as u64;
            }
            self.records.pop_front();
            self.first += 1;
            n += 1;
        }
        self.evicted += n;
        n
    }

    /// Oldest retained sequence (`head + 1` when empty).
    pub fn first(&self) -> u64 {
        self.first
    }
    /// Newest sequence ever assigned.
    pub fn head(&self) -> u64 {
        self.head
    }
    /// Sets the head when it is known from disk but its records were all evicted.
    pub fn set_head(&mut self, head: u64) {
        if self.records.is_empty() && head > self.head {
            self.head = head;
            self.first = head + 1;
        }
    }
    pub fn len(&self) -> usize {
        self.records.len()
    }
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Records from sequence `from` on, at most `max_records` of them and about `max_bytes` of
    /// encoded records (always at least one). `None` when `from` was evicted.
    pub fn read_from(
        &self,
        from: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Option<Vec<Arc<Stored>>> {
        let from = from.max(1);
        if from < self.first {
            return None;
        }
        let start = ((from - self.first) as usize).min(self.records.len());
        let n = batch_len(self.records.range(start..), max_records, max_bytes);
        Some(self.records.range(start..start + n).cloned().collect())
    }

    /// The retained records of `group` with sequence in `(after, before)`, oldest first, starting at
    /// the first of them and bounded as [`Store::read_from`] bounds a batch (an empty result means none
    /// remain).
    pub fn group_records(
        &self,
        group: u64,
        after: u64,
        before: u64,
        max_records: usize,
        max_bytes: usize,
    ) -> Vec<Arc<Stored>> {
        let Some(seqs) = self.groups.get(&group) else {
            return Vec::new();
        };
        let start = seqs.partition_point(|&q| q <= after);
        let records = seqs
            .range(start..)
            .take_while(|&&q| q < before)
            .map(|&q| &self.records[(q - self.first) as usize]);
        let n = batch_len(records.clone(), max_records, max_bytes);
        records.take(n).cloned().collect()
    }

    /// Every retained record (for snapshots).
    pub fn all(&self) -> Vec<Arc<Stored>> {
        self.records.iter().cloned().collect()
    }

    /// Counters for `Stats` (the service fills in subscriber counts and durability).
    pub fn stats(&self) -> StatsResponse {
        StatsResponse {
            records: self.records.len() as u64,
            tokens: self.tokens,
            groups: self.groups.len() as u64,
            first_sequence: if self.records.is_empty() {
                0
            } else {
                self.first
            },
            head_sequence: self.head,
            evicted_records: self.evicted,
            duplicates: self.duplicates,
            max_tokens: self.retention.max_tokens,
            resident_bytes: self.hot_bytes,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, seq: u64, n: usize) -> Record {
        Record {
            record_id: id.as_bytes().to_vec(),
            group_key: Some(7),
            prompt_ids: vec![1],
            response_ids: vec![2; n],
            sequence: seq,
            ..Default::default()
        }
    }

    #[test]
    fn place_dedupes_within_and_across_requests() {
        let mut s = Store::new(Retention::default());
        let rs = [rec("a", 0, 1), rec("b", 0, 1), rec("a", 0, 1)];
        let p = s.place(&rs, &[1, 2, 1]).unwrap();
        assert_eq!(
            p,
            vec![
                Placement::New(1),
                Placement::New(2),
                Placement::Duplicate(1)
            ]
        );
        s.push(Stored::new(&rec("a", 1, 1), 1));
        s.push(Stored::new(&rec("b", 2, 1), 2));
        let p = s.place(&[rec("c", 0, 1), rec("b", 0, 1)], &[3, 2]).unwrap();
        assert_eq!(p, vec![Placement::New(3), Placement::Duplicate(2)]);
        let e = s.place(&[rec("b", 0, 1)], &[99]).unwrap_err();
        assert_eq!(e.sequence, 2);
    }

    #[test]
    fn retention_evicts_oldest_and_read_from_reports_eviction() {
        let mut s = Store::new(Retention {
            max_tokens: 25,
            max_records: 0,
        });
        for i in 1..=5 {
            s.push(Stored::new(&rec(&format!("r{i}"), i, 9), i));
            s.enforce_retention();
        }
        // 10 tokens each: only two fit in 25.
        assert_eq!(s.len(), 2);
        assert_eq!(s.first(), 4);
        assert_eq!(s.evicted, 3);
        assert!(s.read_from(3, 10, 1 << 20).is_none());
        let got = s.read_from(4, 10, 1 << 20).unwrap();
        assert_eq!(
            got.iter().map(|r| r.sequence).collect::<Vec<_>>(),
            vec![4, 5]
        );
        assert!(s.read_from(6, 10, 1 << 20).unwrap().is_empty());
        // An evicted id can be published again (dedupe covers retained records).
        assert_eq!(
            s.place(&[rec("r1", 0, 9)], &[1]).unwrap(),
            vec![Placement::New(6)]
        );
    }

    #[test]
    fn group_records_follow_the_group_through_eviction() {
        let mut s = Store::new(Retention {
            max_tokens: 0,
            max_records: 4,
        });
        for i in 1..=6u64 {
            let mut r = rec(&format!("r{i}"), i, 3);
            r.group_key = Some(i % 2);
            s.push(Stored::new(&r, i));
            s.enforce_retention();
        }
        // Retained: 3..=6; group 1 holds 3 and 5, group 0 holds 4 and 6.
        let seqs = |v: Vec<Arc<Stored>>| v.iter().map(|r| r.sequence).collect::<Vec<_>>();
        assert_eq!(
            seqs(s.group_records(1, 0, u64::MAX, 10, 1 << 20)),
            vec![3, 5]
        );
        assert_eq!(seqs(s.group_records(0, 4, u64::MAX, 10, 1 << 20)), vec![6]);
        assert_eq!(seqs(s.group_records(0, 0, 6, 10, 1 << 20)), vec![4]);
        assert_eq!(seqs(s.group_records(0, 0, u64::MAX, 1, 1 << 20)), vec![4]);
        assert!(s.group_records(9, 0, u64::MAX, 10, 1 << 20).is_empty());
        assert_eq!(s.stats().groups, 2);
    }

    #[test]
    fn read_from_bounds_batches() {
        let mut s = Store::new(Retention::default());
        for i in 1..=10 {
            s.push(Stored::new(&rec(&format!("r{i}"), i, 99), i));
        }
        assert_eq!(s.read_from(1, 3, 1 << 20).unwrap().len(), 3);
        // A budget of 2.5 records takes 3 (the one that crosses it included).
        let each = s.read_from(1, 1, 1).unwrap()[0].len;
        assert_eq!(s.read_from(1, 100, each * 5 / 2).unwrap().len(), 3);
        assert_eq!(s.read_from(1, 100, 1).unwrap().len(), 1);
    }
}
