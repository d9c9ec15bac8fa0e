//! The one error type of the index core. Messages are written for the user who made the call.

use thiserror::Error;

/// Every way a call into the index can fail because of its input (never because of a bug).
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A token id outside `0..vocab_size` (or negative, or above `i32::MAX`).
    #[error("token id {token} is out of range (valid ids are 0..{limit})")]
    InvalidToken { token: i64, limit: u64 },
    /// A request id that `begin_request` never opened, or that was already finished.
    #[error("unknown request id {0}: call begin_request first (or it was already finished)")]
    UnknownRequest(u64),
    /// `begin_request` with an id that is still in flight.
    #[error("request id {0} is already in flight: finish it before reusing the id")]
    DuplicateRequest(u64),
    /// A numeric argument outside its domain (a budget of 0, a decay outside (0, 1], ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A caller-provided buffer of the wrong length.
    #[error("buffer `{name}` has {got} elements, expected {expected}")]
    BufferShape {
        name: &'static str,
        got: usize,
        expected: usize,
    },
    /// A snapshot that is truncated, fails its checksum, or is not a snapshot at all.
    #[error("corrupt snapshot: {0}")]
    CorruptSnapshot(String),
    /// A snapshot written by a newer (or unknown) format version.
    #[error("unsupported snapshot format version {found} (this build reads version {supported})")]
    SnapshotVersion { found: u32, supported: u32 },
    /// A file-system error while saving or loading a snapshot.
    #[error("I/O error on {path}: {message}")]
    Io { path: String, message: String },
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, CoreError>;
