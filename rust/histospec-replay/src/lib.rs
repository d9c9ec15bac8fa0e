//! A model of SGLang's NGRAM trie ([`peer_trie`]), measured beside the index on the same data by
//! `histospec-sgl replay` and `bench index`. Not on the serving path; it lives apart from the index.
//! (The replay itself, the loop that drafts against a logged continuation, is written once, in
//! Python: `histospec_sgl/replay/measure.py`, driving the engine's own drafter.)

pub mod peer_trie;
