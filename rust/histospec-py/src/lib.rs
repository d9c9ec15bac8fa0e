//! `histospec_sgl._core`: the native module. Glue only; the logic lives in `histospec-index`.

mod convert;
mod errors;
mod index;
mod peers;
mod wire;

use pyo3::prelude::*;

/// XXH3-64 of the prompt's token ids as little-endian int32 bytes: the group key every component uses.
#[pyfunction]
fn prompt_key(prompt_ids: &Bound<'_, PyAny>) -> PyResult<u64> {
    let toks = convert::tokens(prompt_ids, "prompt_ids")?;
    Ok(histospec_index::prompt_key(&toks))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<index::PyHistoryIndex>()?;
    m.add_class::<peers::PyTriePeer>()?;
    m.add_function(wrap_pyfunction!(prompt_key, m)?)?;
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
