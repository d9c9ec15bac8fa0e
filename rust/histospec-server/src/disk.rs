//! Crash-safe persistence under `--data-dir`.
//!
//! - `log-<first sequence>.bin`: an 8-byte magic, then frames `[u32 len][u32 crc32][Record]`
//!   (little-endian). A publish appends its new records and fsyncs before anything is visible or
//!   acknowledged, so every acknowledged record survives SIGKILL or power loss. A torn frame at the
//!   end of the newest log (a crash mid-write, never acknowledged) is cut off on load.
//! - `snapshot.bin`: a magic, the covered head sequence, the record count, then the same frames. It is
//!   written to a temporary file, fsynced, renamed over the old one and the directory fsynced; then a
//!   new log starts and the logs it covers are deleted. It holds only retained records, so it also
//!   compacts what retention evicted.
//! - `<file>.idx` beside each log and the snapshot: for each frame, what the store keeps of its
//!   record (sequence, group, id, token count, content hash) with the frame's offset, length and
//!   CRC-32, so that a restart reads the frames' bytes (checking each CRC) without decoding a record.
//!   An index is a cache: a log's is written after the log is fsynced and is not itself fsynced; a
//!   frame whose entry is missing, damaged or does not match it (offset, length, CRC) is decoded.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use prost::Message;

use crate::proto::Record;
use crate::wire::{Loc, Segment, Stored};

const LOG_MAGIC: &[u8; 8] = b"HSLOG\x00\x01\x00";
const SNAP_MAGIC: &[u8; 8] = b"HSSNP\x00\x01\x00";
const IDX_MAGIC: &[u8; 8] = b"HSIDX\x00\x01\x00";
/// Largest frame accepted on load (a corrupt length must not allocate gigabytes).
const MAX_FRAME: usize = 1 << 30;

/// A persistence failure, with the file it concerns.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("{path}: {reason}")]
    Corrupt { path: String, reason: String },
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> DiskError + '_ {
    move |source| DiskError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A record as [`Disk::open`] hands it over.
pub enum Found {
    /// Decoded from its frame (no index entry for it).
    Decoded(Record, Loc),
    /// From the index: what the store keeps, its encoding left on disk (`encoded` is None).
    Indexed(Stored),
}

impl Found {
    pub fn sequence(&self) -> u64 {
        match self {
            Found::Decoded(r, _) => r.sequence,
            Found::Indexed(s) => s.sequence,
        }
    }

    /// The record itself (read back and decoded when it came from the index).
    pub fn record(&self) -> Record {
        match self {
            Found::Decoded(r, _) => r.clone(),
            Found::Indexed(s) => s.decode(),
        }
    }
}

/// What [`Disk::open`] found (its records went to the caller one by one).
pub struct Loaded {
    /// Records handed over.
    pub records: usize,
    /// Of them, taken from an index without decoding.
    pub indexed: usize,
    /// Highest sequence ever assigned, even if its record was compacted away.
    pub head: u64,
    /// Bytes of torn tail cut from the newest log.
    pub truncated_bytes: u64,
}

/// The open data directory: the current log, and when to snapshot.
pub struct Disk {
    dir: PathBuf,
    log: BufWriter<File>,
    log_path: PathBuf,
    /// The current log's index.
    log_idx: BufWriter<File>,
    /// The current log, open for reading, and its length (where the next frame goes).
    log_segment: Arc<Segment>,
    log_len: u64,
    log_bytes: u64,
    /// Snapshot (compact) once the logs since the last snapshot exceed this.
    pub snapshot_every_bytes: u64,
}

/// Appends a frame; returns its CRC-32.
fn frame_into(buf: &mut Vec<u8>, payload: &[u8]) -> u32 {
    let crc = crc32fast::hash(payload);
    buf.reserve(8 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(&crc.to_le_bytes());
    buf.extend_from_slice(payload);
    crc
}

fn idx_path(segment: &Path) -> PathBuf {
    let mut p = segment.as_os_str().to_owned();
    p.push(".idx");
    PathBuf::from(p)
}

/// One index entry: what the store keeps of the record whose frame payload is at `offset`.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    offset: u64,
    len: u32,
    crc: u32,
    sequence: u64,
    group_key: Option<u64>,
    tokens: u64,
    hash: u64,
    record_id: Vec<u8>,
}

/// Appends `s`'s index entry, framed as the records are (`[u32 len][u32 crc32][body]`).
fn entry_into(buf: &mut Vec<u8>, s: &Stored, offset: u64, crc: u32) {
    let mut body = Vec::with_capacity(49 + s.record_id.len());
    body.extend_from_slice(&offset.to_le_bytes());
    body.extend_from_slice(&(s.len as u32).to_le_bytes());
    body.extend_from_slice(&crc.to_le_bytes());
    body.extend_from_slice(&s.sequence.to_le_bytes());
    body.push(s.group_key.is_some() as u8);
    body.extend_from_slice(&s.group_key.unwrap_or(0).to_le_bytes());
    body.extend_from_slice(&s.tokens.to_le_bytes());
    body.extend_from_slice(&s.hash.to_le_bytes());
    body.extend_from_slice(&s.record_id);
    frame_into(buf, &body);
}

fn parse_entry(b: &[u8]) -> Option<Entry> {
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    if b.len() < 49 {
        return None;
    }
    Some(Entry {
        offset: u64_at(0),
        len: u32_at(8),
        crc: u32_at(12),
        sequence: u64_at(16),
        group_key: (b[24] != 0).then(|| u64_at(25)),
        tokens: u64_at(33),
        hash: u64_at(41),
        record_id: b[49..].to_vec(),
    })
}

/// The intact entries of `segment`'s index, in frame order (none when it is missing or not an
/// index): parsing stops at the first damaged entry, and the frames after it are decoded instead.
fn read_index(segment: &Path) -> std::collections::VecDeque<Entry> {
    let mut out = std::collections::VecDeque::new();
    let Ok(data) = fs::read(idx_path(segment)) else {
        return out;
    };
    if data.len() < 8 || &data[..8] != IDX_MAGIC {
        return out;
    }
    let mut at = 8;
    while at + 8 <= data.len() {
        let len = u32::from_le_bytes(data[at..at + 4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(data[at + 4..at + 8].try_into().unwrap());
        let Some(body) = data.get(at + 8..at + 8 + len) else {
            break;
        };
        match (crc32fast::hash(body) == crc)
            .then(|| parse_entry(body))
            .flatten()
        {
            Some(e) => out.push_back(e),
            None => break,
        }
        at += 8 + len;
    }
    out
}

/// Creates (truncating) an index with its magic.
fn new_index(path: &Path) -> Result<BufWriter<File>, DiskError> {
    let mut f = File::create(path).map_err(io_err(path))?;
    f.write_all(IDX_MAGIC).map_err(io_err(path))?;
    Ok(BufWriter::with_capacity(1 << 16, f))
}

/// Hands over the frames of one segment: from its index entry where one matches the frame (offset,
/// length, CRC), else decoded. Returns (frames read, offset after the last good one).
fn load_segment(
    r: &mut impl Read,
    at: u64,
    seg: &Arc<Segment>,
    give: &mut dyn FnMut(Found),
    indexed: &mut usize,
) -> io::Result<(u64, u64)> {
    let mut entries = read_index(&seg.path);
    read_frames(r, at, &mut |payload, offset, crc| {
        while entries.front().is_some_and(|e| e.offset < offset) {
            entries.pop_front();
        }
        let loc = Loc {
            segment: Arc::clone(seg),
            offset,
        };
        match entries.front() {
            Some(e) if e.offset == offset && e.len as usize == payload.len() && e.crc == crc => {
                let e = entries.pop_front().unwrap();
                *indexed += 1;
                give(Found::Indexed(Stored {
                    sequence: e.sequence,
                    group_key: e.group_key,
                    record_id: e.record_id,
                    tokens: e.tokens,
                    len: payload.len(),
                    encoded: None,
                    at: Some(loc),
                    hash: e.hash,
                }));
                true
            }
            _ => match Record::decode(payload) {
                Ok(rec) => {
                    give(Found::Decoded(rec, loc));
                    true
                }
                Err(_) => false,
            },
        }
    })
}

/// Reads frames from `r` (at byte `at` of its file), handing each intact payload with its offset
/// and CRC-32 to `each` (which returns false to stop there); returns how many, and the offset after
/// the last good frame. One frame is in memory at a time, so a data dir of any size loads in the
/// memory of its largest record.
fn read_frames(
    r: &mut impl Read,
    mut at: u64,
    each: &mut dyn FnMut(&[u8], u64, u32) -> bool,
) -> io::Result<(u64, u64)> {
    let (mut n, mut head, mut payload) = (0u64, [0u8; 8], Vec::new());
    loop {
        if fill(r, &mut head)? < 8 {
            break;
        }
        let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(head[4..].try_into().unwrap());
        if len > MAX_FRAME {
            break;
        }
        payload.resize(len, 0);
        if fill(r, &mut payload)? < len || crc32fast::hash(&payload) != crc {
            break;
        }
        if !each(&payload, at + 8, crc) {
            break;
        }
        n += 1;
        at += 8 + len as u64;
    }
    Ok((n, at))
}

/// Reads into `buf` until it is full or the input ends; returns how many bytes.
fn fill(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

fn fsync_dir(dir: &Path) -> Result<(), DiskError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

fn log_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>, DiskError> {
    let mut logs = Vec::new();
    for e in fs::read_dir(dir).map_err(io_err(dir))? {
        let p = e.map_err(io_err(dir))?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if let Some(n) = name
            .strip_prefix("log-")
            .and_then(|n| n.strip_suffix(".bin"))
        {
            if let Ok(seq) = n.parse::<u64>() {
                logs.push((seq, p));
            }
        }
    }
    logs.sort();
    Ok(logs)
}

impl Disk {
    /// Opens (creating) `dir`, hands every record of the snapshot and the logs to `each` in
    /// sequence order (nothing at or below the snapshot's head twice) with where it lies, cuts a torn
    /// tail, and starts a new log.
    pub fn open(
        dir: &Path,
        snapshot_every_bytes: u64,
        each: &mut dyn FnMut(Found),
    ) -> Result<(Disk, Loaded), DiskError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut records = 0usize;
        let mut indexed = 0usize;
        let mut head = 0u64;
        let snap = dir.join("snapshot.bin");
        if snap.exists() {
            let corrupt = |reason: &str| DiskError::Corrupt {
                path: snap.display().to_string(),
                reason: reason.to_string(),
            };
            let f = File::open(&snap).map_err(io_err(&snap))?;
            let size = f.metadata().map_err(io_err(&snap))?.len();
            let mut r = BufReader::with_capacity(1 << 20, f);
            let mut header = [0u8; 24];
            if fill(&mut r, &mut header).map_err(io_err(&snap))? < 24 || &header[..8] != SNAP_MAGIC
            {
                return Err(corrupt("not a histospec draft-server snapshot (bad magic)"));
            }
            head = u64::from_le_bytes(header[8..16].try_into().unwrap());
            let count = u64::from_le_bytes(header[16..24].try_into().unwrap());
            let seg = Segment::open(snap.clone()).map_err(io_err(&snap))?;
            let (n, end) =
                load_segment(&mut r, 24, &seg, each, &mut indexed).map_err(io_err(&snap))?;
            if n != count || end != size {
                return Err(corrupt(&format!(
                    "holds {n} intact records of {count} (snapshots are renamed into place whole: \
                     this file was damaged after it was written)"
                )));
            }
            records += n as usize;
        }
        let logs = log_files(dir)?;
        let mut truncated_bytes = 0;
        let mut old_bytes = 0u64;
        for (i, (_, path)) in logs.iter().enumerate() {
            let f = File::open(path).map_err(io_err(path))?;
            let size = f.metadata().map_err(io_err(path))?.len();
            old_bytes += size;
            let mut r = BufReader::with_capacity(1 << 20, f);
            let mut magic = [0u8; 8];
            if fill(&mut r, &mut magic).map_err(io_err(path))? < 8 || &magic != LOG_MAGIC {
                if i + 1 == logs.len() && size < 8 {
                    // Created but the magic never reached the disk: nothing in it was acknowledged.
                    fs::remove_file(path).map_err(io_err(path))?;
                    continue;
                }
                return Err(DiskError::Corrupt {
                    path: path.display().to_string(),
                    reason: "not a histospec draft-server log (bad magic)".into(),
                });
            }
            let seg = Segment::open(path.clone()).map_err(io_err(path))?;
            let mut give = |found: Found| {
                if found.sequence() > head {
                    head = found.sequence();
                    records += 1;
                    each(found);
                }
            };
            let mut idx = 0;
            let (_, end) =
                load_segment(&mut r, 8, &seg, &mut give, &mut idx).map_err(io_err(path))?;
            indexed += idx;
            if end != size {
                if i + 1 != logs.len() {
                    return Err(DiskError::Corrupt {
                        path: path.display().to_string(),
                        reason: format!(
                            "damaged frame at byte {end} of an older log (not a torn tail)"
                        ),
                    });
                }
                let f = OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(io_err(path))?;
                f.set_len(end)
                    .and_then(|_| f.sync_all())
                    .map_err(io_err(path))?;
                truncated_bytes = size - end;
            }
        }
        let (log, log_path, log_idx, log_segment, log_len) = Self::new_log(dir, head + 1)?;
        let disk = Disk {
            dir: dir.to_path_buf(),
            log,
            log_path,
            log_idx,
            log_segment,
            log_len,
            log_bytes: old_bytes,
            snapshot_every_bytes,
        };
        Ok((
            disk,
            Loaded {
                records,
                indexed,
                head,
                truncated_bytes,
            },
        ))
    }

    /// A log starting at sequence `first`: its writer, path, index writer, reading segment and
    /// length.
    #[allow(clippy::type_complexity)]
    fn new_log(
        dir: &Path,
        first: u64,
    ) -> Result<(BufWriter<File>, PathBuf, BufWriter<File>, Arc<Segment>, u64), DiskError> {
        let path = dir.join(format!("log-{first:020}.bin"));
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io_err(&path))?;
        let mut len = f.metadata().map_err(io_err(&path))?.len();
        if len == 0 {
            f.write_all(LOG_MAGIC)
                .and_then(|_| f.sync_all())
                .map_err(io_err(&path))?;
            fsync_dir(dir)?;
            len = LOG_MAGIC.len() as u64;
        }
        let seg = Segment::open(path.clone()).map_err(io_err(&path))?;
        // The frames already in a reopened log keep no index entries: they are decoded next time.
        let idx = new_index(&idx_path(&path))?;
        Ok((BufWriter::with_capacity(1 << 20, f), path, idx, seg, len))
    }

    /// Appends records and fsyncs: when this returns Ok they survive a crash. Each record learns
    /// where it lies (`Stored::at`).
    pub fn append(&mut self, records: &mut [Stored]) -> Result<(), DiskError> {
        let mut buf = Vec::new();
        let mut index = Vec::new();
        let mut offsets = Vec::with_capacity(records.len());
        for r in records.iter() {
            let payload = r.bytes().map_err(io_err(&self.log_path))?;
            let offset = self.log_len + buf.len() as u64 + 8;
            offsets.push(offset);
            let crc = frame_into(&mut buf, &payload);
            entry_into(&mut index, r, offset, crc);
        }
        let path = self.log_path.clone();
        self.log.write_all(&buf).map_err(io_err(&path))?;
        self.log.flush().map_err(io_err(&path))?;
        self.log.get_ref().sync_data().map_err(io_err(&path))?;
        // The index after the log is durable, never fsynced: an entry lost is a frame decoded.
        let ip = idx_path(&path);
        self.log_idx.write_all(&index).map_err(io_err(&ip))?;
        self.log_idx.flush().map_err(io_err(&ip))?;
        self.log_bytes += buf.len() as u64;
        self.log_len += buf.len() as u64;
        for (r, offset) in records.iter_mut().zip(offsets) {
            r.at = Some(Loc {
                segment: Arc::clone(&self.log_segment),
                offset,
            });
        }
        Ok(())
    }

    /// Whether enough log has accumulated to compact into a snapshot.
    pub fn wants_snapshot(&self) -> bool {
        self.log_bytes > self.snapshot_every_bytes
    }

    /// Writes `records` (every retained record, through `head`) as the snapshot, starts a new log at
    /// `head + 1` and deletes the logs it covers. Returns where each record now lies (records held
    /// on disk only are read from where they were, which stays readable until they are moved).
    pub fn snapshot(&mut self, records: &[Arc<Stored>], head: u64) -> Result<Vec<Loc>, DiskError> {
        let path = self.dir.join("snapshot.bin");
        let tmp = self.dir.join("snapshot.bin.tmp");
        let idx_tmp = self.dir.join("snapshot.idx.tmp");
        let mut offsets = Vec::with_capacity(records.len());
        {
            let mut idx = new_index(&idx_tmp)?;
            let mut ibuf = Vec::with_capacity(1 << 16);
            let f = File::create(&tmp).map_err(io_err(&tmp))?;
            let mut w = BufWriter::with_capacity(1 << 20, f);
            let mut buf = Vec::with_capacity(1 << 20);
            let mut written = 0u64;
            buf.extend_from_slice(SNAP_MAGIC);
            buf.extend_from_slice(&head.to_le_bytes());
            buf.extend_from_slice(&(records.len() as u64).to_le_bytes());
            for r in records {
                let payload = r.bytes().map_err(io_err(&tmp))?;
                let offset = written + buf.len() as u64 + 8;
                offsets.push(offset);
                let crc = frame_into(&mut buf, &payload);
                entry_into(&mut ibuf, r, offset, crc);
                if buf.len() >= 1 << 20 {
                    w.write_all(&buf).map_err(io_err(&tmp))?;
                    written += buf.len() as u64;
                    buf.clear();
                }
                if ibuf.len() >= 1 << 16 {
                    idx.write_all(&ibuf).map_err(io_err(&idx_tmp))?;
                    ibuf.clear();
                }
            }
            w.write_all(&buf).map_err(io_err(&tmp))?;
            let f = w.into_inner().map_err(|e| io_err(&tmp)(e.into_error()))?;
            f.sync_all().map_err(io_err(&tmp))?;
            idx.write_all(&ibuf).map_err(io_err(&idx_tmp))?;
            let f = idx
                .into_inner()
                .map_err(|e| io_err(&idx_tmp)(e.into_error()))?;
            f.sync_all().map_err(io_err(&idx_tmp))?;
        }
        // The index first: a crash between the renames leaves a new index beside the old
        // snapshot, whose frames then do not match it and are decoded.
        fs::rename(&idx_tmp, idx_path(&path)).map_err(io_err(&idx_tmp))?;
        fs::rename(&tmp, &path).map_err(io_err(&path))?;
        fsync_dir(&self.dir)?;
        let seg = Segment::open(path.clone()).map_err(io_err(&path))?;
        let locs = offsets
            .into_iter()
            .map(|offset| Loc {
                segment: Arc::clone(&seg),
                offset,
            })
            .collect();
        // Everything through `head` is in the snapshot: start a fresh log, drop the old ones.
        let (log, log_path, log_idx, log_segment, log_len) = Self::new_log(&self.dir, head + 1)?;
        self.log = log;
        self.log_idx = log_idx;
        self.log_path = log_path.clone();
        self.log_segment = log_segment;
        self.log_len = log_len;
        for (_, p) in log_files(&self.dir)? {
            if p != log_path {
                fs::remove_file(&p).map_err(io_err(&p))?;
                let ip = idx_path(&p);
                if let Err(e) = fs::remove_file(&ip) {
                    if e.kind() != io::ErrorKind::NotFound {
                        return Err(io_err(&ip)(e));
                    }
                }
            }
        }
        fsync_dir(&self.dir)?;
        self.log_bytes = 0;
        Ok(locs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens `dir`, collecting the sequences it loads.
    fn open(dir: &Path) -> Result<(Disk, Loaded, Vec<u64>), DiskError> {
        let mut seqs = Vec::new();
        let (d, l) = Disk::open(dir, u64::MAX, &mut |f: Found| seqs.push(f.sequence()))?;
        Ok((d, l, seqs))
    }

    fn st(seq: u64) -> Stored {
        Stored::new(&rec(seq), 0)
    }

    fn rec(seq: u64) -> Record {
        Record {
            record_id: format!("id{seq}").into_bytes(),
            group_key: Some(seq % 3),
            prompt_ids: vec![1, 2],
            response_ids: vec![seq as u32; 5],
            sequence: seq,
            ..Default::default()
        }
    }

    #[test]
    fn log_survives_reopen_and_torn_tail_is_cut() {
        let dir = tempfile::tempdir().unwrap();
        let (mut d, l, _) = open(dir.path()).unwrap();
        assert_eq!(l.records, 0);
        d.append(&mut [st(1), st(2)]).unwrap();
        d.append(&mut [st(3)]).unwrap();
        let log = d.log_path.clone();
        drop(d);
        // A torn write: half a frame at the end.
        let mut f = OpenOptions::new().append(true).open(&log).unwrap();
        f.write_all(&[40, 0, 0, 0, 1, 2]).unwrap();
        drop(f);
        let (_d, l, seqs) = open(dir.path()).unwrap();
        assert_eq!(seqs, vec![1, 2, 3]);
        assert_eq!(l.head, 3);
        assert_eq!(l.truncated_bytes, 6);
    }

    #[test]
    fn snapshot_compacts_and_keeps_head() {
        let dir = tempfile::tempdir().unwrap();
        let (mut d, _, _) = open(dir.path()).unwrap();
        d.append(&mut (1..=5).map(st).collect::<Vec<_>>()).unwrap();
        // Retention kept only 4 and 5.
        let kept: Vec<Arc<Stored>> = [4, 5].into_iter().map(|s| Arc::new(st(s))).collect();
        d.snapshot(&kept, 5).unwrap();
        d.append(&mut [st(6)]).unwrap();
        drop(d);
        assert_eq!(log_files(dir.path()).unwrap().len(), 1);
        let (_d, l, seqs) = open(dir.path()).unwrap();
        assert_eq!(seqs, vec![4, 5, 6]);
        assert_eq!(l.head, 6);
        // All records evicted: the head still survives in the snapshot.
        let dir2 = tempfile::tempdir().unwrap();
        let (mut d, _, _) = open(dir2.path()).unwrap();
        d.append(&mut [st(1)]).unwrap();
        d.snapshot(&[], 1).unwrap();
        drop(d);
        let (_d, l, seqs) = open(dir2.path()).unwrap();
        assert!(seqs.is_empty() && l.records == 0);
        assert_eq!(l.head, 1);
    }

    /// Opens `dir`, collecting what it hands over.
    fn open_found(dir: &Path) -> (Disk, Loaded, Vec<Found>) {
        let mut found = Vec::new();
        let (d, l) = Disk::open(dir, u64::MAX, &mut |f: Found| found.push(f)).unwrap();
        (d, l, found)
    }

    fn hashed(seq: u64) -> Stored {
        Stored::new(&rec(seq), 1000 + seq)
    }

    #[test]
    fn a_restart_takes_records_from_the_index_without_decoding_them() {
        let dir = tempfile::tempdir().unwrap();
        let (mut d, _, _) = open(dir.path()).unwrap();
        d.append(&mut (1..=4).map(hashed).collect::<Vec<_>>())
            .unwrap();
        drop(d);
        let (mut d, l, found) = open_found(dir.path());
        assert_eq!((l.records, l.indexed, l.head), (4, 4, 4));
        for (f, seq) in found.iter().zip(1..) {
            let Found::Indexed(s) = f else {
                panic!("record {seq} was decoded")
            };
            let want = hashed(seq);
            assert_eq!(
                (
                    s.sequence,
                    s.group_key,
                    &s.record_id,
                    s.tokens,
                    s.len,
                    s.hash
                ),
                (
                    seq,
                    want.group_key,
                    &want.record_id,
                    want.tokens,
                    want.len,
                    want.hash
                )
            );
            assert!(s.encoded.is_none());
            assert_eq!(f.record(), rec(seq)); // read back from its frame
        }
        // The snapshot's records come from its own index; the log's after it from the new log's.
        let kept: Vec<Arc<Stored>> = (2..=4).map(|s| Arc::new(hashed(s))).collect();
        d.snapshot(&kept, 4).unwrap();
        d.append(&mut [hashed(5)]).unwrap();
        drop(d);
        assert!(dir.path().join("snapshot.bin.idx").exists());
        let idx_files = fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .to_string_lossy()
                    .ends_with(".idx")
            })
            .count();
        assert_eq!(idx_files, 2, "the compacted log's index is deleted with it");
        let (_d, l, found) = open_found(dir.path());
        assert_eq!((l.records, l.indexed), (4, 4));
        let seqs: Vec<u64> = found.iter().map(Found::sequence).collect();
        assert_eq!(seqs, vec![2, 3, 4, 5]);
    }

    #[test]
    fn frames_without_a_matching_index_entry_are_decoded() {
        let dir = tempfile::tempdir().unwrap();
        let (mut d, _, _) = open(dir.path()).unwrap();
        d.append(&mut (1..=6).map(hashed).collect::<Vec<_>>())
            .unwrap();
        let log = d.log_path.clone();
        drop(d);
        let ip = idx_path(&log);
        let whole = fs::read(&ip).unwrap();
        // A damaged third entry: the first two are used, the rest decoded.
        let mut data = whole.clone();
        let first = 8 + 8 + u32::from_le_bytes(data[8..12].try_into().unwrap()) as usize;
        let third = 2 * (first - 8) + 8;
        data[third + 12] ^= 0xff;
        fs::write(&ip, &data).unwrap();
        let (_d, l, found) = open_found(dir.path());
        assert_eq!((l.records, l.indexed), (6, 2));
        assert!(matches!(found[2], Found::Decoded(..)));
        let decoded: Vec<Record> = found.iter().map(Found::record).collect();
        assert_eq!(decoded, (1..=6).map(rec).collect::<Vec<_>>());
        // An index whose entries do not match the frames (another file's): nothing taken from it.
        let dir2 = tempfile::tempdir().unwrap();
        let (mut d2, _, _) = open(dir2.path()).unwrap();
        let mut other: Vec<Stored> = (1..=6)
            .map(|seq| {
                let mut r = rec(seq);
                r.record_id.push(b'x'); // another payload, at shifted offsets
                Stored::new(&r, 0)
            })
            .collect();
        d2.append(&mut other).unwrap();
        let other_idx = idx_path(&d2.log_path);
        drop(d2);
        fs::copy(&other_idx, &ip).unwrap();
        let (_d, l, found) = open_found(dir.path());
        assert_eq!((l.records, l.indexed), (6, 0));
        assert_eq!(
            found.iter().map(Found::record).collect::<Vec<_>>(),
            (1..=6).map(rec).collect::<Vec<_>>()
        );
        // No index at all: every frame decoded.
        fs::remove_file(&ip).unwrap();
        let (_d, l, _) = open_found(dir.path());
        assert_eq!((l.records, l.indexed), (6, 0));
    }

    #[test]
    fn damaged_snapshot_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let (mut d, _, _) = open(dir.path()).unwrap();
        d.snapshot(&[Arc::new(st(1)), Arc::new(st(2))], 2).unwrap();
        drop(d);
        let p = dir.path().join("snapshot.bin");
        let mut data = fs::read(&p).unwrap();
        let n = data.len();
        data[n - 3] ^= 0xff;
        fs::write(&p, data).unwrap();
        let err = open(dir.path()).err().unwrap().to_string();
        assert!(
            err.contains("snapshot.bin") && err.contains("1 intact records of 2"),
            "{err}"
        );
    }
}
