//! What `histospec-sgl replay` runs in Rust: speculative decoding simulated against a logged
//! continuation ([`replay()`]), and a model of SGLang's NGRAM trie ([`peer_trie`]) measured beside
//! the index on the same data. Neither is on the serving path; they live apart from the index.

pub mod peer_trie;
mod replay;

pub use replay::{accept_greedy, replay, ReplayTrace};
