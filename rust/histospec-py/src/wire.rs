//! The draft-server wire format for the Python clients, and the server itself.
//!
//! The grpcio clients send and receive raw bytes; encoding and decoding happen here with the same
//! prost types the server uses, so the wheel needs no protobuf runtime (and cannot clash with the
//! trainer's protobuf pin), and a subscriber applies a message to its index without building a Python
//! object per token.

use histospec_server::proto::{
    AnnounceRequest, AnnounceResponse, FollowGroup, FollowRequest, FollowResponse, PublishRequest,
    PublishResponse, Record, SnapshotChunk, StatsResponse, SubscribeRequest, SubscribeResponse,
};
use numpy::{PyArray1, PyReadonlyArrayDyn};
use prost::Message;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::convert::{contiguous, tokens};
use crate::index::{group_or_key, PyHistoryIndex};

fn ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    tokens(obj, what)?
        .into_iter()
        .map(|t| {
            u32::try_from(t)
                .map_err(|_| PyValueError::new_err(format!("{what}: token id {t} is negative")))
        })
        .collect()
}

fn floats(obj: &Bound<'_, PyAny>) -> PyResult<Vec<f32>> {
    if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'_, f32>>() {
        return Ok(contiguous(&a, "logprobs")?.to_vec());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'_, f64>>() {
        return Ok(contiguous(&a, "logprobs")?
            .iter()
            .map(|&x| x as f32)
            .collect());
    }
    obj.extract::<Vec<f64>>()
        .map(|v| v.into_iter().map(|x| x as f32).collect())
        .map_err(|_| PyTypeError::new_err("logprobs must be a float array or a sequence of floats"))
}

/// Encodes a `PublishRequest` from tuples `(record_id, group, prompt_ids, response_ids, version,
/// sample_index, logprobs, reward)`; `group`, `logprobs` and `reward` may be None.
#[pyfunction]
pub fn encode_publish<'py>(
    py: Python<'py>,
    records: &Bound<'py, PyList>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut out = Vec::with_capacity(records.len());
    for (i, item) in records.iter().enumerate() {
        let at = |e: PyErr| PyValueError::new_err(format!("record {i}: {e}"));
        #[allow(clippy::type_complexity)]
        let (record_id, group, prompt, response, version, sample_index, logprobs, reward): (
            Vec<u8>,
            Option<Bound<'py, PyAny>>,
            Bound<'py, PyAny>,
            Bound<'py, PyAny>,
            u64,
            u32,
            Option<Bound<'py, PyAny>>,
            Option<f64>,
        ) = item.extract().map_err(at)?;
        let prompt_ids = ids(&prompt, "prompt_ids").map_err(at)?;
        let group_key = match group.as_ref() {
            Some(g) if !g.is_none() => Some(group_or_key(Some(g), &[]).map_err(at)?),
            _ => None,
        };
        out.push(Record {
            record_id,
            group_key,
            prompt_ids,
            response_ids: ids(&response, "response_ids").map_err(at)?,
            version,
            sample_index,
            logprobs: match logprobs.as_ref() {
                Some(l) if !l.is_none() => floats(l).map_err(at)?,
                _ => Vec::new(),
            },
            reward: reward.map(|r| r as f32),
            sequence: 0,
        });
    }
    let bytes = py.detach(|| PublishRequest { records: out }.encode_to_vec());
    Ok(PyBytes::new(py, &bytes))
}

fn malformed(what: &str, e: prost::DecodeError) -> PyErr {
    PyValueError::new_err(format!("malformed {what} message: {e}"))
}

/// Decodes a `PublishResponse` into a dict.
#[pyfunction]
pub fn decode_publish_response<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let r = PublishResponse::decode(data).map_err(|e| malformed("PublishResponse", e))?;
    let d = PyDict::new(py);
    d.set_item("sequences", r.sequences)?;
    d.set_item("accepted", r.accepted)?;
    d.set_item("duplicates", r.duplicates)?;
    d.set_item("durable", r.durable)?;
    Ok(d)
}

/// Encodes a `SubscribeRequest`.
#[pyfunction]
pub fn encode_subscribe<'py>(py: Python<'py>, from_sequence: u64) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &SubscribeRequest { from_sequence }.encode_to_vec())
}

/// Encodes a `FollowRequest`: `add` is `(group_key, after_sequence)` pairs, `drop` group keys.
#[pyfunction]
#[pyo3(signature = (from_sequence=0, add=Vec::new(), drop=Vec::new()))]
pub fn encode_follow<'py>(
    py: Python<'py>,
    from_sequence: u64,
    add: Vec<(u64, u64)>,
    drop: Vec<u64>,
) -> Bound<'py, PyBytes> {
    let add = add
        .into_iter()
        .map(|(group_key, after_sequence)| FollowGroup {
            group_key,
            after_sequence,
        })
        .collect();
    let m = FollowRequest {
        from_sequence,
        add,
        drop,
    };
    PyBytes::new(py, &m.encode_to_vec())
}

/// Encodes an `AnnounceRequest` of these group keys.
#[pyfunction]
pub fn encode_announce(py: Python<'_>, group_keys: Vec<u64>) -> Bound<'_, PyBytes> {
    PyBytes::new(py, &AnnounceRequest { group_keys }.encode_to_vec())
}

/// An `AnnounceResponse`'s `followers` (the Follow streams told).
#[pyfunction]
pub fn decode_announce(data: &[u8]) -> PyResult<u64> {
    Ok(AnnounceResponse::decode(data)
        .map_err(|e| malformed("AnnounceResponse", e))?
        .followers)
}

/// Decodes a `StatsResponse` into a dict.
#[pyfunction]
pub fn decode_stats<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let s = StatsResponse::decode(data).map_err(|e| malformed("StatsResponse", e))?;
    let d = PyDict::new(py);
    for (k, v) in [
        ("records", s.records),
        ("tokens", s.tokens),
        ("groups", s.groups),
        ("first_sequence", s.first_sequence),
        ("head_sequence", s.head_sequence),
        ("evicted_records", s.evicted_records),
        ("duplicates", s.duplicates),
        ("subscribers", s.subscribers),
        ("cut_off_subscribers", s.cut_off_subscribers),
        ("max_tokens", s.max_tokens),
        ("followers", s.followers),
        ("followed_groups", s.followed_groups),
        ("resident_bytes", s.resident_bytes),
    ] {
        d.set_item(k, v)?;
    }
    d.set_item("durable", s.durable)?;
    Ok(d)
}

/// A decoded Subscribe, Snapshot or Follow message.
struct Batch {
    records: Vec<Record>,
    /// head_sequence (subscribe, follow) or through_sequence (snapshot).
    mark: u64,
    last: bool,
    total: u64,
    /// Follow only.
    ready_groups: Vec<u64>,
    cursor: u64,
    announced_groups: Vec<u64>,
}

fn decode_batch(data: &[u8], kind: &str) -> PyResult<Batch> {
    match kind {
        "subscribe" => {
            let m =
                SubscribeResponse::decode(data).map_err(|e| malformed("SubscribeResponse", e))?;
            Ok(Batch {
                records: m.records,
                mark: m.head_sequence,
                last: false,
                total: 0,
                ready_groups: Vec::new(),
                cursor: 0,
                announced_groups: Vec::new(),
            })
        }
        "follow" => {
            let m = FollowResponse::decode(data).map_err(|e| malformed("FollowResponse", e))?;
            Ok(Batch {
                records: m.records,
                mark: m.head_sequence,
                last: false,
                total: 0,
                ready_groups: m.ready_groups,
                cursor: m.cursor,
                announced_groups: m.announced_groups,
            })
        }
        "snapshot" => {
            let m = SnapshotChunk::decode(data).map_err(|e| malformed("SnapshotChunk", e))?;
            Ok(Batch {
                records: m.records,
                mark: m.through_sequence,
                last: m.last,
                total: m.total_records,
                ready_groups: Vec::new(),
                cursor: 0,
                announced_groups: Vec::new(),
            })
        }
        other => Err(PyValueError::new_err(format!(
            "kind must be 'subscribe', 'snapshot' or 'follow', got {other:?}"
        ))),
    }
}

fn batch_header<'py>(py: Python<'py>, b: &Batch, kind: &str) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    if kind == "snapshot" {
        d.set_item("through_sequence", b.mark)?;
        d.set_item("total_records", b.total)?;
        d.set_item("last", b.last)?;
    } else {
        d.set_item("head_sequence", b.mark)?;
    }
    if kind == "follow" {
        d.set_item("ready_groups", &b.ready_groups)?;
        d.set_item("cursor", b.cursor)?;
        d.set_item("announced_groups", &b.announced_groups)?;
    }
    Ok(d)
}

/// Decodes a Subscribe (`kind="subscribe"`) or Snapshot (`"snapshot"`) message into a dict with its
/// records as dicts (token ids as int32 arrays).
#[pyfunction]
pub fn decode_records<'py>(
    py: Python<'py>,
    data: &[u8],
    kind: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let b = decode_batch(data, kind)?;
    let d = batch_header(py, &b, kind)?;
    let list = PyList::empty(py);
    for r in &b.records {
        let rd = PyDict::new(py);
        let i32s = |v: &[u32]| v.iter().map(|&t| t as i32).collect::<Vec<_>>();
        rd.set_item("record_id", PyBytes::new(py, &r.record_id))?;
        rd.set_item("group_key", r.group_key)?;
        rd.set_item("prompt_ids", PyArray1::from_vec(py, i32s(&r.prompt_ids)))?;
        rd.set_item(
            "response_ids",
            PyArray1::from_vec(py, i32s(&r.response_ids)),
        )?;
        rd.set_item("version", r.version)?;
        rd.set_item("sample_index", r.sample_index)?;
        if r.logprobs.is_empty() {
            rd.set_item("logprobs", py.None())?;
        } else {
            rd.set_item("logprobs", PyArray1::from_slice(py, &r.logprobs))?;
        }
        rd.set_item("reward", r.reward)?;
        rd.set_item("sequence", r.sequence)?;
        list.append(rd)?;
    }
    d.set_item("records", list)?;
    Ok(d)
}

/// Applies the records of a Subscribe or Snapshot message with sequence in
/// `(after_sequence, through_sequence]` to `index` (as `add_response(group, prompt, response,
/// version)`), in order, with the GIL released; `more` tells whether records past
/// `through_sequence` remain in the message.
/// A record the index refuses (a token id at or above its `vocab_size`) is counted and skipped, so
/// the replica's position in the global order still advances. Returns a dict with `applied`,
/// `rejected`, `last_sequence` (the highest sequence seen, or `after_sequence`) and the message's
/// header (`head_sequence`, or `through_sequence` / `total_records` / `last`).
#[pyfunction]
#[pyo3(signature = (index, data, kind, after_sequence=0, through_sequence=None))]
pub fn apply_records<'py>(
    py: Python<'py>,
    index: &Bound<'py, PyHistoryIndex>,
    data: &[u8],
    kind: &str,
    after_sequence: u64,
    through_sequence: Option<u64>,
) -> PyResult<Bound<'py, PyDict>> {
    let b = py.detach(|| decode_batch(data, kind))?;
    let through = through_sequence.unwrap_or(u64::MAX);
    let more = b.records.iter().any(|r| r.sequence > through);
    let (applied, rejected, last_seq) = index.get().mutate(py, |g| {
        let (mut applied, mut rejected, mut last) = (0u64, 0u64, after_sequence);
        for r in b
            .records
            .iter()
            .filter(|r| r.sequence > after_sequence && r.sequence <= through)
        {
            let prompt: Vec<i32> = r.prompt_ids.iter().map(|&t| t as i32).collect();
            let resp: Vec<i32> = r.response_ids.iter().map(|&t| t as i32).collect();
            let key = histospec_index::group_key(match r.group_key {
                Some(k) => histospec_index::Group::Key(k),
                None => histospec_index::Group::Prompt(&prompt),
            });
            match g.add_response(key, &prompt, &resp, r.version) {
                Ok(()) => applied += 1,
                Err(histospec_index::CoreError::InvalidToken { .. }) => rejected += 1,
                Err(e) => return Err(e),
            }
            last = last.max(r.sequence);
        }
        Ok((applied, rejected, last))
    })?;
    let d = batch_header(py, &b, kind)?;
    d.set_item("applied", applied)?;
    d.set_item("rejected", rejected)?;
    d.set_item("last_sequence", last_seq)?;
    d.set_item("more", more)?;
    Ok(d)
}

/// `(last record sequence or 0, head_sequence / through_sequence)` of a Subscribe or Snapshot message.
#[pyfunction]
pub fn wire_span(py: Python<'_>, data: &[u8], kind: &str) -> PyResult<(u64, u64)> {
    let b = py.detach(|| decode_batch(data, kind))?;
    Ok((b.records.last().map_or(0, |r| r.sequence), b.mark))
}

/// A Follow message's `cursor`, `head_sequence`, `ready_groups`, `announced_groups`, `records` (how
/// many) and `last` (each group's highest sequence in it).
#[pyfunction]
pub fn follow_span<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let b = py.detach(|| decode_batch(data, "follow"))?;
    let d = batch_header(py, &b, "follow")?;
    let last = PyDict::new(py);
    let mut seen: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    for r in &b.records {
        let g = r.group_key.unwrap_or_default();
        let e = seen.entry(g).or_default();
        *e = (*e).max(r.sequence);
    }
    for (g, s) in seen {
        last.set_item(g, s)?;
    }
    d.set_item("records", b.records.len())?;
    d.set_item("last", last)?;
    Ok(d)
}

/// Runs the draft server from its command line (`argv[0]` is the program's name, the rest are the
/// flags of `histospec-draft-server`, parsed by the same definition) until SIGTERM/SIGINT, with the
/// GIL released. Prints `histospec draft-server listening on HOST:PORT` on stdout once it accepts
/// connections. Returns the exit status: 0 after a graceful stop or `--help`, 1 when it cannot start,
/// 2 for bad flags.
#[pyfunction]
pub fn draft_server_main(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(|| histospec_server::cli::run(argv))
}

/// The draft server's `--help`, under the program name `name`.
#[pyfunction]
pub fn draft_server_help(name: &str) -> String {
    histospec_server::cli::help(name)
}
