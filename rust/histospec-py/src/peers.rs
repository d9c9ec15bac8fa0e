//! `TriePeer` pyclass: the model of SGLang's NGRAM trie used by the offline replay as a peer.

use std::sync::Mutex;

use histospec_replay::peer_trie::{TrieConfig, TriePeer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::convert::{tokens as tokens_arg, tree_lists};
use crate::errors::poisoned;

/// Model of SGLang 0.5.23's NGRAM trie drafter (recency BFS), for comparisons only.
#[pyclass(frozen, name = "TriePeer", module = "histospec_sgl._core")]
pub struct PyTriePeer {
    inner: Mutex<TriePeer>,
}

fn unsigned(toks: Vec<i32>, what: &str) -> PyResult<Vec<u32>> {
    toks.into_iter()
        .map(|t| {
            u32::try_from(t).map_err(|_| {
                PyValueError::new_err(format!("{what}: token ids must be >= 0, got {t}"))
            })
        })
        .collect()
}

#[pymethods]
impl PyTriePeer {
    #[new]
    #[pyo3(signature = (max_depth=18, min_breadth=1, max_breadth=10))]
    fn new(max_depth: usize, min_breadth: usize, max_breadth: usize) -> PyResult<Self> {
        if max_depth == 0 || min_breadth == 0 || max_breadth < min_breadth {
            return Err(PyValueError::new_err(
                "need max_depth >= 1 and 1 <= min_breadth <= max_breadth",
            ));
        }
        Ok(PyTriePeer {
            inner: Mutex::new(TriePeer::new(TrieConfig {
                max_depth,
                min_breadth,
                max_breadth,
            })),
        })
    }

    /// Inserts every suffix of `tokens` truncated to `max_depth` (SGLang inserts a window per step).
    fn insert(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let toks = unsigned(tokens_arg(tokens, "tokens")?, "tokens")?;
        py.detach(|| {
            self.inner
                .lock()
                .map(|mut t| t.insert(&toks))
                .map_err(|_| ())
        })
        .map_err(|_| poisoned())
    }

    /// Draft tree for `context` (its last `max_depth` tokens are used): (tokens, parents), root
    /// first with parent -1, at most `num_nodes` nodes.
    fn draft(
        &self,
        py: Python<'_>,
        context: &Bound<'_, PyAny>,
        num_nodes: usize,
    ) -> PyResult<(Vec<i64>, Vec<i64>)> {
        let ctx = unsigned(tokens_arg(context, "context")?, "context")?;
        let nodes = py
            .detach(|| {
                self.inner
                    .lock()
                    .map(|t| t.draft(&ctx, num_nodes.max(1)))
                    .map_err(|_| ())
            })
            .map_err(|_| poisoned())?;
        Ok(tree_lists(&nodes))
    }

    fn clear(&self) -> PyResult<()> {
        self.inner.lock().map_err(|_| poisoned())?.clear();
        Ok(())
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.inner.lock().map_err(|_| poisoned())?.len())
    }
}
