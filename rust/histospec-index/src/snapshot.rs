//! Saving and loading the index's history as bytes or a file.
//!
//! Layout (little endian): magic `HSPX\r\n\x1a\n` (8 bytes), format version (u32), payload length
//! (u64), payload, XXH3-64 of the payload (u64). The payload holds the current version and every
//! group (in least- to most-recently-used order): key, prompts, and kept responses with their
//! versions. Automata are not stored: loading re-ingests the tokens, which is as fast as reading
//! a serialized automaton and keeps the format independent of the automaton's layout. In-flight
//! requests are not part of a snapshot.

use std::io::Write;
use std::path::Path;

use xxhash_rust::xxh3::xxh3_64;

use crate::error::{CoreError, Result};
use crate::sam::NONE;
use crate::store::{HistoryIndex, IndexConfig};

const MAGIC: &[u8; 8] = b"HSPX\r\n\x1a\n";
/// The snapshot format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

struct Writer(Vec<u8>);
impl Writer {
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn toks(&mut self, t: &[u32]) {
        self.u32(t.len() as u32);
        self.0.reserve(t.len() * 4);
        for &x in t {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}
impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.b.len() - self.at < n {
            return Err(CoreError::CorruptSnapshot(format!(
                "truncated at byte {}",
                self.at
            )));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn toks(&mut self) -> Result<Vec<u32>> {
        let n = self.u32()? as usize;
        let raw = self.take(
            n.checked_mul(4)
                .ok_or_else(|| CoreError::CorruptSnapshot("length overflow".into()))?,
        )?;
        Ok(raw
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
}

impl HistoryIndex {
    /// Serializes the history (not the in-flight requests) to bytes: the groups that keep a
    /// response, each with the prompts its responses name. A group known only from requests in
    /// flight, and prompts seen only in requests, are not history, so loading the bytes and
    /// serializing again gives the same bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer(Vec::new());
        w.u64(self.version());
        let mut order: Vec<(u64, u64)> = self
            .groups
            .iter()
            .filter(|(_, g)| !g.responses.is_empty())
            .map(|(&k, g)| (g.last_used, k))
            .collect();
        order.sort_unstable();
        w.u64(order.len() as u64);
        let (mut remap, mut named) = (Vec::new(), Vec::new());
        for (_, key) in order {
            let g = &self.groups[&key];
            w.u64(key);
            // The prompts the responses name, numbered in order of first use: the order in
            // which loading the responses stores them again.
            remap.clear();
            remap.resize(g.prompts.len(), NONE);
            named.clear();
            for r in &g.responses {
                let slot = &mut remap[r.prompt as usize];
                if *slot == NONE {
                    *slot = named.len() as u32;
                    named.push(r.prompt);
                }
            }
            w.u32(named.len() as u32);
            for &p in &named {
                w.toks(&g.prompts[p as usize]);
            }
            w.u32(g.responses.len() as u32);
            for r in &g.responses {
                w.u32(remap[r.prompt as usize]);
                w.u64(r.version);
                w.toks(&r.tokens);
            }
        }
        let payload = w.0;
        let mut out = Vec::with_capacity(payload.len() + 28);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&payload);
        out.extend_from_slice(&xxh3_64(&payload).to_le_bytes());
        out
    }

    /// Rebuilds an index with configuration `cfg` from [`HistoryIndex::to_bytes`] output.
    /// Retention and the vocabulary of `cfg` apply to the loaded history.
    pub fn from_bytes(bytes: &[u8], cfg: IndexConfig) -> Result<Self> {
        if bytes.len() < 20 || &bytes[..8] != MAGIC {
            return Err(CoreError::CorruptSnapshot(
                "not a histospec snapshot (bad magic bytes)".into(),
            ));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != FORMAT_VERSION {
            return Err(CoreError::SnapshotVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes")) as usize;
        if bytes.len() - 20 < 8 || bytes.len() - 20 - 8 != len {
            return Err(CoreError::CorruptSnapshot(format!(
                "expected {} payload bytes, file has {}",
                len,
                bytes.len().saturating_sub(28)
            )));
        }
        let payload = &bytes[20..20 + len];
        let sum = u64::from_le_bytes(bytes[20 + len..].try_into().expect("8 bytes"));
        if xxh3_64(payload) != sum {
            return Err(CoreError::CorruptSnapshot("checksum mismatch".into()));
        }
        let limit = cfg.vocab_size;
        let mut idx = HistoryIndex::new(cfg)?;
        let mut r = Reader { b: payload, at: 0 };
        idx.set_version(r.u64()?);
        let ngroups = r.u64()?;
        for _ in 0..ngroups {
            let key = r.u64()?;
            let np = r.u32()? as usize;
            let mut prompts = Vec::with_capacity(np.min(1024));
            for _ in 0..np {
                prompts.push(r.toks()?);
            }
            let nr = r.u32()?;
            for _ in 0..nr {
                let pi = r.u32()? as usize;
                let v = r.u64()?;
                let toks = r.toks()?;
                let prompt = prompts.get(pi).ok_or_else(|| {
                    CoreError::CorruptSnapshot(format!("response names prompt {pi} of {np}"))
                })?;
                if let Some(vs) = limit {
                    if let Some(&bad) = prompt.iter().chain(&toks).find(|&&t| t >= vs) {
                        return Err(CoreError::InvalidToken {
                            token: bad as i64,
                            limit: vs as u64,
                        });
                    }
                }
                idx.add_response_checked(key, prompt, toks, v);
            }
        }
        if r.at != payload.len() {
            return Err(CoreError::CorruptSnapshot(
                "trailing bytes after the last group".into(),
            ));
        }
        Ok(idx)
    }

    /// Writes a snapshot to `path` crash-safely (temporary file, fsync, rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |e: std::io::Error| CoreError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&self.to_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io)?;
        Ok(())
    }

    /// Loads a snapshot file written by [`HistoryIndex::save`].
    pub fn load(path: &Path, cfg: IndexConfig) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| CoreError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_bytes(&bytes, cfg)
    }
}
