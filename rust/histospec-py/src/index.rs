//! `HistoryIndex` pyclass: glue over `histospec_index::HistoryIndex`, no logic of its own.

use std::cell::RefCell;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use histospec_index::{
    CoreError, DraftConfig, Drafter, Finish, HistoryIndex, IndexConfig, KnobValue,
};
use numpy::{PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::convert::{rids as rids_arg, tokens as tokens_arg, tree_lists};
use crate::errors::{poisoned, to_py};

/// (prompt_ids, response_ids, version) as returned to Python.
type ResponseTuple = (Vec<u32>, Vec<u32>, u64);

thread_local! {
    // One scratch drafter per thread: concurrent drafts share the index under a read lock.
    static DRAFTER: RefCell<Drafter> = RefCell::new(Drafter::default());
}

/// Per-prompt history of earlier responses that drafts speculative-decoding trees.
#[pyclass(frozen, name = "HistoryIndex", module = "histospec_sgl._core")]
pub struct PyHistoryIndex {
    inner: RwLock<HistoryIndex>,
}

/// Why a call failed while the GIL was released (converted to a Python exception afterwards).
enum Fail {
    Core(CoreError),
    Poisoned,
}

fn lift_val<T>(r: Result<T, Fail>) -> PyResult<T> {
    r.map_err(|f| match f {
        Fail::Core(e) => to_py(e),
        Fail::Poisoned => poisoned(),
    })
}

impl PyHistoryIndex {
    fn read(&self) -> PyResult<RwLockReadGuard<'_, HistoryIndex>> {
        self.inner.read().map_err(|_| poisoned())
    }
    fn write(&self) -> PyResult<RwLockWriteGuard<'_, HistoryIndex>> {
        self.inner.write().map_err(|_| poisoned())
    }
    /// Runs `f` under the write lock with the GIL released. The lock is taken without the GIL, so
    /// a thread blocked on it never holds the GIL that the lock holder needs to return.
    pub(crate) fn mutate<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut HistoryIndex) -> Result<T, CoreError> + Send,
    ) -> PyResult<T> {
        lift_val(py.detach(|| {
            let mut g = self.inner.write().map_err(|_| Fail::Poisoned)?;
            f(&mut g).map_err(Fail::Core)
        }))
    }
    /// Runs `f` under the read lock with the GIL released (drafts from many threads at once).
    fn inspect<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&HistoryIndex) -> Result<T, CoreError> + Send,
    ) -> PyResult<T> {
        lift_val(py.detach(|| {
            let g = self.inner.read().map_err(|_| Fail::Poisoned)?;
            f(&g).map_err(Fail::Core)
        }))
    }
}

#[allow(clippy::too_many_arguments)]
fn make_config(
    vocab_size: Option<i64>,
    max_responses: usize,
    max_versions: usize,
    max_bytes: usize,
    version_decay: f32,
    draft: DraftConfig,
) -> PyResult<IndexConfig> {
    let vocab_size = match vocab_size {
        None => None,
        Some(v) if v >= 1 && v <= i32::MAX as i64 + 1 => Some(v as u32),
        Some(v) => {
            return Err(PyValueError::new_err(format!(
                "vocab_size must be in 1..=2^31, got {v}"
            )))
        }
    };
    let cfg = IndexConfig {
        vocab_size,
        max_responses,
        max_versions,
        max_bytes,
        version_decay,
        draft,
    };
    cfg.validate().map_err(to_py)?;
    Ok(cfg)
}

fn draft_dict<'py>(py: Python<'py>, d: &DraftConfig) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for &name in DraftConfig::KNOBS {
        match d.get(name) {
            Some(KnobValue::Int(v)) => out.set_item(name, v)?,
            Some(KnobValue::Float(v)) => out.set_item(name, v)?,
            None => unreachable!("every listed knob has a value"),
        }
    }
    Ok(out)
}

/// `base` with the draft knobs of `kwargs` set (unknown names, wrong types and bad values are a
/// `ValueError` naming the knob).
fn draft_from_kwargs(
    mut base: DraftConfig,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<DraftConfig> {
    for (k, v) in kwargs.into_iter().flat_map(|d| d.iter()) {
        let name: String = k.extract()?;
        if v.is_instance_of::<pyo3::types::PyBool>() {
            return Err(PyValueError::new_err(format!(
                "{name} must be a number, got {v}"
            )));
        }
        let value: f64 = v
            .extract()
            .map_err(|_| PyValueError::new_err(format!("{name} must be a number, got {v}")))?;
        base.set(&name, value).map_err(PyValueError::new_err)?;
    }
    base.validate().map_err(PyValueError::new_err)?;
    Ok(base)
}

/// The group key of a request (`histospec_index::group_key`, the one rule): `group` None, the
/// prompt's key; an int in [-2^63, 2^64), the key itself (negative ones modulo 2^64, so signed
/// 64-bit keys from other systems work); a str, the named group's key. Anything else (a bool, a
/// float, an int out of range) is a ValueError naming the rule.
pub(crate) fn group_or_key(group: Option<&Bound<'_, PyAny>>, prompt: &[i32]) -> PyResult<u64> {
    use histospec_index::{group_key, Group};
    let Some(g) = group.filter(|g| !g.is_none()) else {
        return Ok(group_key(Group::Prompt(prompt)));
    };
    if g.is_instance_of::<pyo3::types::PyBool>() {
        return Err(group_error(g));
    }
    if let Ok(name) = g.cast::<pyo3::types::PyString>() {
        return Ok(group_key(Group::Name(name.to_str()?)));
    }
    if let Ok(k) = g.extract::<u64>() {
        return Ok(group_key(Group::Key(k)));
    }
    g.extract::<i64>()
        .map(|k| group_key(Group::Key(k as u64)))
        .map_err(|_| group_error(g))
}

fn group_error(g: &Bound<'_, PyAny>) -> PyErr {
    PyValueError::new_err(format!(
        "a group is an int in [-2**63, 2**64), a str (a named group) or None (the prompt's key), got {} {g}",
        g.get_type().name().map(|n| n.to_string()).unwrap_or_default()
    ))
}

/// Puts a loaded index in place of `g`, keeping `g`'s thread count (not part of a snapshot).
fn replace(g: &mut HistoryIndex, mut loaded: HistoryIndex) -> Result<(), CoreError> {
    loaded.set_threads(g.threads())?;
    *g = loaded;
    Ok(())
}

fn rid_arg(rid: i64) -> PyResult<u64> {
    u64::try_from(rid)
        .map_err(|_| PyValueError::new_err(format!("request ids must be >= 0, got {rid}")))
}

#[pymethods]
impl PyHistoryIndex {
    /// `**draft`: draft-policy knobs by name (`draft_knobs()` lists them; defaults otherwise).
    #[new]
    #[pyo3(signature = (*, vocab_size=None, max_responses=0, max_versions=0, max_bytes=0, version_decay=1.0,
                        threads=1, **draft))]
    fn new(
        vocab_size: Option<i64>,
        max_responses: usize,
        max_versions: usize,
        max_bytes: usize,
        version_decay: f32,
        threads: usize,
        draft: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let draft = draft_from_kwargs(DraftConfig::default(), draft)?;
        let cfg = make_config(
            vocab_size,
            max_responses,
            max_versions,
            max_bytes,
            version_decay,
            draft,
        )?;
        let mut ix = HistoryIndex::new(cfg).map_err(to_py)?;
        ix.set_threads(threads).map_err(to_py)?;
        Ok(PyHistoryIndex {
            inner: RwLock::new(ix),
        })
    }

    /// Starts request `rid` in `group` (None: the prompt's key) with context `prompt_ids`.
    #[pyo3(signature = (rid, group, prompt_ids, version=None))]
    fn begin_request(
        &self,
        py: Python<'_>,
        rid: i64,
        group: Option<&Bound<'_, PyAny>>,
        prompt_ids: &Bound<'_, PyAny>,
        version: Option<u64>,
    ) -> PyResult<u64> {
        let rid = rid_arg(rid)?;
        let prompt = tokens_arg(prompt_ids, "prompt_ids")?;
        let key = group_or_key(group, &prompt)?;
        self.mutate(py, |g| g.begin_request(rid, key, &prompt, version))?;
        Ok(key)
    }

    /// Appends accepted tokens to request `rid`.
    fn extend_request(&self, py: Python<'_>, rid: i64, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let rid = rid_arg(rid)?;
        let toks = tokens_arg(tokens, "tokens")?;
        self.mutate(py, |g| g.extend_request(rid, &toks))
    }

    /// Appends `lens[i]` tokens of the flat `tokens` to `rids[i]`, for a whole batch.
    fn extend_batch(
        &self,
        py: Python<'_>,
        rids: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        lens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let rids = rids_arg(rids)?;
        let toks = tokens_arg(tokens, "tokens")?;
        let lens: Vec<i64> = tokens_arg(lens, "lens")?
            .into_iter()
            .map(i64::from)
            .collect();
        self.mutate(py, |g| g.extend_batch(&rids, &toks, &lens))
    }

    /// Ends request `rid`; with `keep` its response becomes history of its group. Unkept, it
    /// leaves the group's automaton now (a rebuild of the group), or with `defer_removal` at the
    /// group's next rebuild: when its last in-flight request finishes, or once such tokens are
    /// more than half of what the group holds (in-flight siblings may draft from them till then).
    #[pyo3(signature = (rid, keep=true, *, defer_removal=false))]
    fn finish_request(
        &self,
        py: Python<'_>,
        rid: i64,
        keep: bool,
        defer_removal: bool,
    ) -> PyResult<()> {
        let rid = rid_arg(rid)?;
        let how = match (keep, defer_removal) {
            (true, _) => Finish::Keep,
            (false, false) => Finish::Drop,
            (false, true) => Finish::DropLater,
        };
        self.mutate(py, |g| g.finish_request_as(rid, how))
    }

    /// Adds a finished response to `group`'s history (None: the prompt's key); returns the key.
    #[pyo3(signature = (group, prompt_ids, response_ids, version=0))]
    fn add_response(
        &self,
        py: Python<'_>,
        group: Option<&Bound<'_, PyAny>>,
        prompt_ids: &Bound<'_, PyAny>,
        response_ids: &Bound<'_, PyAny>,
        version: u64,
    ) -> PyResult<u64> {
        let prompt = tokens_arg(prompt_ids, "prompt_ids")?;
        let resp = tokens_arg(response_ids, "response_ids")?;
        let key = group_or_key(group, &prompt)?;
        self.mutate(py, |g| g.add_response(key, &prompt, &resp, version))?;
        Ok(key)
    }

    /// The draft for one request: (tokens, parents, probs) in BFS order, root first, unpadded.
    #[pyo3(signature = (rid, num_nodes=16, chain=false))]
    fn draft(
        &self,
        py: Python<'_>,
        rid: i64,
        num_nodes: usize,
        chain: bool,
    ) -> PyResult<(Vec<i64>, Vec<i64>, Vec<f32>)> {
        let rid = rid_arg(rid)?;
        let nodes = self.inspect(py, |g| {
            DRAFTER.with(|d| g.draft_nodes(rid, num_nodes, chain, &mut d.borrow_mut()))
        })?;
        let (toks, parents) = tree_lists(&nodes);
        let probs = nodes.iter().map(|n| n.prob).collect();
        Ok((toks, parents, probs))
    }

    /// Drafts `num_nodes`-node trees for a batch into caller buffers, GIL released.
    ///
    /// `tokens`: int64 `[bs*num_nodes]`; `mask`: int64/int32/uint8/bool `[bs*num_nodes*num_nodes]`;
    /// `probs`: optional float32 `[bs*num_nodes]`. Returns (requests with a draft, draft nodes).
    /// `interleave=False` grows the requests one after the other instead of several at once (the
    /// same drafts; for paired timing).
    #[pyo3(signature = (rids, num_nodes, tokens, mask, probs=None, counts=None, interleave=true))]
    #[allow(clippy::too_many_arguments)]
    fn draft_batch(
        &self,
        py: Python<'_>,
        rids: &Bound<'_, PyAny>,
        num_nodes: usize,
        tokens: &Bound<'_, PyAny>,
        mask: &Bound<'_, PyAny>,
        probs: Option<&Bound<'_, PyAny>>,
        counts: Option<&Bound<'_, PyAny>>,
        interleave: bool,
    ) -> PyResult<(usize, usize)> {
        let rids = rids_arg(rids)?;
        let mut toks = writable::<i64>(tokens, "tokens", "int64")?;
        let mut probs = probs
            .map(|p| writable::<f32>(p, "probs", "float32"))
            .transpose()?;
        let mut counts = counts
            .map(|c| writable::<i64>(c, "counts", "int64"))
            .transpose()?;
        let mut mask = MaskArg::extract(mask)?;
        let toks_s = slice_mut(&mut toks, "tokens")?;
        let probs_s = match probs.as_mut() {
            Some(p) => Some(slice_mut(p, "probs")?),
            None => None,
        };
        let counts_s = match counts.as_mut() {
            Some(c) => Some(slice_mut(c, "counts")?),
            None => None,
        };
        let mask_s = mask.slice()?;
        let st = self.inspect(py, |g| {
            DRAFTER.with(|d| {
                let d = &mut d.borrow_mut();
                d.interleave = interleave;
                let r = match mask_s {
                    MaskElemAny::I64(m) => {
                        g.draft_tree_batch(&rids, num_nodes, toks_s, m, probs_s, counts_s, d)
                    }
                    MaskElemAny::I32(m) => {
                        g.draft_tree_batch(&rids, num_nodes, toks_s, m, probs_s, counts_s, d)
                    }
                    MaskElemAny::U8(m) => {
                        g.draft_tree_batch(&rids, num_nodes, toks_s, m, probs_s, counts_s, d)
                    }
                    MaskElemAny::Bool(m) => {
                        g.draft_tree_batch(&rids, num_nodes, toks_s, m, probs_s, counts_s, d)
                    }
                };
                d.interleave = true;
                r
            })
        })?;
        Ok((st.nonempty, st.nodes))
    }

    /// Drafts chains of up to `k` tokens for a batch: `tokens` int64 `[bs*k]` (0-padded),
    /// `lens` int64 `[bs]`, optional `probs` float32 `[bs*k]`. Returns (requests with a draft, tokens).
    #[pyo3(signature = (rids, k, tokens, lens, probs=None))]
    fn draft_chain_batch(
        &self,
        py: Python<'_>,
        rids: &Bound<'_, PyAny>,
        k: usize,
        tokens: &Bound<'_, PyAny>,
        lens: &Bound<'_, PyAny>,
        probs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(usize, usize)> {
        let rids = rids_arg(rids)?;
        let mut toks = writable::<i64>(tokens, "tokens", "int64")?;
        let mut lens = writable::<i64>(lens, "lens", "int64")?;
        let mut probs = probs
            .map(|p| writable::<f32>(p, "probs", "float32"))
            .transpose()?;
        let toks_s = slice_mut(&mut toks, "tokens")?;
        let lens_s = slice_mut(&mut lens, "lens")?;
        let probs_s = match probs.as_mut() {
            Some(p) => Some(slice_mut(p, "probs")?),
            None => None,
        };
        let st = self.inspect(py, |g| {
            DRAFTER.with(|d| {
                g.draft_chain_batch(&rids, k, toks_s, lens_s, probs_s, &mut d.borrow_mut())
            })
        })?;
        Ok((st.nonempty, st.nodes))
    }

    /// The version new requests are tagged with.
    #[getter]
    fn version(&self) -> PyResult<u64> {
        Ok(self.read()?.version())
    }

    #[setter]
    fn set_version(&self, v: u64) -> PyResult<()> {
        self.write()?.set_version(v);
        Ok(())
    }

    /// Threads that batch calls (`draft_batch`, `draft_chain_batch`, `extend_batch`) may use, the
    /// calling thread included; results do not depend on it.
    #[getter]
    fn threads(&self) -> PyResult<usize> {
        Ok(self.read()?.threads())
    }

    #[setter]
    fn set_threads(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        self.mutate(py, |g| g.set_threads(n))
    }

    /// The draft policy as a dict.
    fn draft_config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        draft_dict(py, &self.read()?.config().draft)
    }

    /// Changes some draft-policy knobs by name (the others keep their values).
    #[pyo3(signature = (**draft))]
    fn set_draft_config(&self, draft: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        let mut g = self.write()?;
        let d = draft_from_kwargs(g.config().draft.clone(), draft)?;
        g.set_draft_config(d).map_err(to_py)
    }

    /// The names of the draft-policy knobs (`HistoryIndex(**knobs)`, `set_draft_config`).
    #[staticmethod]
    fn draft_knobs() -> Vec<&'static str> {
        DraftConfig::KNOBS.to_vec()
    }

    /// Every draft-policy knob's value: the defaults, with those given by name set, checked as
    /// `HistoryIndex(**draft)` checks them (`ValueError` naming the knob), without building an index.
    #[staticmethod]
    #[pyo3(signature = (**draft))]
    fn draft_defaults<'py>(
        py: Python<'py>,
        draft: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        draft_dict(py, &draft_from_kwargs(DraftConfig::default(), draft)?)
    }

    /// The index configuration (retention, memory, vocabulary, draft policy) as a dict.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = self.read()?;
        let c = g.config();
        let out = PyDict::new(py);
        out.set_item("vocab_size", c.vocab_size)?;
        out.set_item("max_responses", c.max_responses)?;
        out.set_item("max_versions", c.max_versions)?;
        out.set_item("max_bytes", c.max_bytes)?;
        out.set_item("version_decay", c.version_decay)?;
        for (k, v) in draft_dict(py, &c.draft)?.iter() {
            out.set_item(k, v)?;
        }
        Ok(out)
    }

    /// Counters: groups, requests, responses, tokens, prompt_tokens, states, edges, bytes, rebuilds, evictions.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.read()?.stats();
        let out = PyDict::new(py);
        out.set_item("groups", s.groups)?;
        out.set_item("requests", s.requests)?;
        out.set_item("responses", s.responses)?;
        out.set_item("tokens", s.tokens)?;
        out.set_item("prompt_tokens", s.prompt_tokens)?;
        out.set_item("states", s.states)?;
        out.set_item("edges", s.edges)?;
        out.set_item("bytes", s.bytes)?;
        out.set_item("rebuilds", s.rebuilds)?;
        out.set_item("evictions", s.evictions)?;
        Ok(out)
    }

    /// Whether request `rid` is in flight.
    fn has_request(&self, rid: i64) -> PyResult<bool> {
        Ok(rid >= 0 && self.read()?.has_request(rid as u64))
    }

    /// The group key of in-flight request `rid`.
    fn request_group(&self, rid: i64) -> PyResult<u64> {
        self.read()?.request_group(rid_arg(rid)?).map_err(to_py)
    }

    /// Group keys held, ascending.
    fn group_keys(&self) -> PyResult<Vec<u64>> {
        Ok(self.read()?.group_keys())
    }

    /// How many finished responses a group holds (0: none, or not held).
    fn group_len(&self, group: u64) -> PyResult<usize> {
        Ok(self.read()?.group_len(group))
    }

    /// The kept responses of a group, oldest first, as (prompt_ids, response_ids, version).
    fn responses(&self, group: u64) -> PyResult<Vec<ResponseTuple>> {
        let g = self.read()?;
        Ok(g.responses(group)
            .into_iter()
            .map(|(p, r)| (p, r.tokens.clone(), r.version))
            .collect())
    }

    /// The lengths of a group's kept responses, oldest first (what `responses` holds, without
    /// copying the tokens).
    fn response_lengths(&self, group: u64) -> PyResult<Vec<usize>> {
        let g = self.read()?;
        Ok(g.responses(group).into_iter().map(|(_, r)| r.tokens.len()).collect())
    }

    /// Forgets a group and its in-flight requests; True if it existed.
    fn remove_group(&self, group: u64) -> PyResult<bool> {
        Ok(self.write()?.remove_group(group))
    }

    /// Forgets everything.
    fn clear(&self) -> PyResult<()> {
        self.write()?.clear();
        Ok(())
    }

    /// The history as snapshot bytes (in-flight requests are not included).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.inspect(py, |g| Ok(g.to_bytes()))?;
        Ok(PyBytes::new(py, &b))
    }

    /// Replaces this index's history with the snapshot in `data` (configuration kept).
    fn load_bytes(&self, py: Python<'_>, data: &[u8]) -> PyResult<()> {
        self.mutate(py, |g| {
            replace(g, HistoryIndex::from_bytes(data, g.config().clone())?)
        })
    }

    /// Saves a snapshot to `path` (written to a temporary file, fsynced, renamed).
    fn save(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        self.inspect(py, |g| g.save(&path))
    }

    /// Replaces this index's history with the snapshot file at `path` (configuration kept).
    fn load(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<()> {
        self.mutate(py, |g| {
            replace(g, HistoryIndex::load(&path, g.config().clone())?)
        })
    }

    fn __repr__(&self) -> PyResult<String> {
        let s = self.read()?.stats();
        Ok(format!(
            "HistoryIndex(groups={}, requests={}, responses={}, tokens={}, bytes={})",
            s.groups, s.requests, s.responses, s.tokens, s.bytes
        ))
    }
}

fn writable<'py, T: numpy::Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    dtype: &str,
) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    obj.extract::<PyReadwriteArrayDyn<'py, T>>()
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a writable {dtype} numpy array")))
}

fn slice_mut<'a, T: numpy::Element>(
    a: &'a mut PyReadwriteArrayDyn<'_, T>,
    what: &str,
) -> PyResult<&'a mut [T]> {
    let shape = a.shape().to_vec();
    a.as_slice_mut().map_err(|_| {
        PyValueError::new_err(format!("{what} must be C-contiguous (shape {shape:?})"))
    })
}

/// A borrowed mask buffer of one of the accepted element types.
enum MaskElemAny<'a> {
    I64(&'a mut [i64]),
    I32(&'a mut [i32]),
    U8(&'a mut [u8]),
    Bool(&'a mut [bool]),
}

enum MaskArg<'py> {
    I64(PyReadwriteArrayDyn<'py, i64>),
    I32(PyReadwriteArrayDyn<'py, i32>),
    U8(PyReadwriteArrayDyn<'py, u8>),
    Bool(PyReadwriteArrayDyn<'py, bool>),
}

impl<'py> MaskArg<'py> {
    fn extract(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(a) = obj.extract() {
            return Ok(MaskArg::I64(a));
        }
        if let Ok(a) = obj.extract() {
            return Ok(MaskArg::I32(a));
        }
        if let Ok(a) = obj.extract() {
            return Ok(MaskArg::U8(a));
        }
        if let Ok(a) = obj.extract() {
            return Ok(MaskArg::Bool(a));
        }
        Err(PyTypeError::new_err(
            "mask must be a writable int64, int32, uint8 or bool numpy array",
        ))
    }

    fn slice(&mut self) -> PyResult<MaskElemAny<'_>> {
        Ok(match self {
            MaskArg::I64(a) => MaskElemAny::I64(slice_mut(a, "mask")?),
            MaskArg::I32(a) => MaskElemAny::I32(slice_mut(a, "mask")?),
            MaskArg::U8(a) => MaskElemAny::U8(slice_mut(a, "mask")?),
            MaskArg::Bool(a) => MaskElemAny::Bool(slice_mut(a, "mask")?),
        })
    }
}
