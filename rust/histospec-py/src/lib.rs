//! `histospec_sgl._core`: the native module. Glue only; the logic lives in `histospec-index`.

mod convert;
mod errors;
mod index;
mod peers;
mod wire;

use pyo3::prelude::*;

/// Large buffers (the automata) on transparent huge pages when `HISTOSPEC_HUGE_PAGES=1`; see
/// `histospec_index::huge`.
#[global_allocator]
static ALLOC: histospec_index::huge::HugePageAlloc = histospec_index::huge::HugePageAlloc;

/// XXH3-64 of the prompt's token ids as little-endian int32 bytes: the group key every component uses.
#[pyfunction]
fn prompt_key(prompt_ids: &Bound<'_, PyAny>) -> PyResult<u64> {
    let toks = convert::tokens(prompt_ids, "prompt_ids")?;
    Ok(histospec_index::prompt_key(&toks))
}

/// Whether this process keeps the index's large buffers on transparent huge pages. Decided once
/// per process: by `on` when given before the first large buffer is allocated, otherwise by
/// `HISTOSPEC_HUGE_PAGES=1` in the environment at that moment. Returns the decision in force.
#[pyfunction]
#[pyo3(signature = (on=None))]
fn huge_pages(on: Option<bool>) -> bool {
    match on {
        Some(on) => histospec_index::huge::set_enabled(on),
        None => histospec_index::huge::enabled(),
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<index::PyHistoryIndex>()?;
    m.add_class::<peers::PyTriePeer>()?;
    m.add_function(wrap_pyfunction!(prompt_key, m)?)?;
    m.add_function(wrap_pyfunction!(huge_pages, m)?)?;
    m.add_function(wrap_pyfunction!(wire::encode_publish, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_publish_response, m)?)?;
    m.add_function(wrap_pyfunction!(wire::encode_subscribe, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_stats, m)?)?;
    m.add_function(wrap_pyfunction!(wire::decode_records, m)?)?;
    m.add_function(wrap_pyfunction!(wire::apply_records, m)?)?;
    m.add_function(wrap_pyfunction!(wire::wire_span, m)?)?;
    m.add_function(wrap_pyfunction!(wire::run_draft_server, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SNAPSHOT_FORMAT_VERSION", histospec_index::FORMAT_VERSION)?;
    Ok(())
}
