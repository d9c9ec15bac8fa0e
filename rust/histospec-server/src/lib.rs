//! The histospec draft server: trainers and engines publish finished rollouts; engines follow the
//! groups they draft for, or mirror every record, in the server's order (see
//! `proto/histospec/v1/history.proto`).
//!
//! - [`cli`]: the command line (the binary's and `histospec-sgl draft-server`'s).
//! - [`store`]: the retained records in sequence order, with idempotent record ids and retention.
//! - [`disk`]: the crash-safe log and snapshots under `--data-dir`.
//! - [`service`]: the gRPC service (Publish, Subscribe, Snapshot, Stats, Follow) and auth.
//! - [`server`]: configuration, listening, health, TLS, graceful shutdown.
//! - [`validate`]: checks on untrusted records (the decoding path the fuzz tests drive).
//! - [`wire`]: records as stored and sent, encoded once.

pub mod cli;
pub mod disk;
pub mod server;
pub mod service;
pub mod store;
pub mod validate;
pub mod wire;

/// Generated protobuf and gRPC code for `histospec.v1`.
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("histospec.v1");
}

/// The generated gRPC server trait, streaming [`wire`]'s pre-encoded messages.
pub mod proto_server {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/server/histospec.v1.rs"));
}

pub use server::{serve, ServerConfig, ServerHandle};
pub use store::Store;
