//! Fuzz tests of the decoding path: arbitrary bytes and arbitrary records through protobuf decoding,
//! validation, placement and the on-disk frame reader must never panic, and whatever validation
//! accepts must store, persist and reload unchanged.

use histospec_server::disk::Disk;
use histospec_server::proto::{PublishRequest, Record};
use histospec_server::store::{Placement, Retention, Store};
use histospec_server::validate;
use histospec_server::wire::Stored;
use proptest::prelude::*;
use prost::Message;

fn record() -> impl Strategy<Value = Record> {
    (
        proptest::collection::vec(any::<u8>(), 0..6),
        proptest::option::of(any::<u64>()),
        proptest::collection::vec(prop_oneof![0u32..50, any::<u32>()], 0..6),
        proptest::collection::vec(prop_oneof![0u32..50, any::<u32>()], 0..6),
        any::<u64>(),
        proptest::collection::vec(
            prop_oneof![
                Just(-0.5f32),
                Just(f32::NAN),
                Just(1.0f32),
                Just(f32::NEG_INFINITY)
            ],
            0..4,
        ),
        proptest::option::of(prop_oneof![Just(1.0f32), Just(f32::NAN)]),
    )
        .prop_map(
            |(id, group_key, prompt_ids, response_ids, version, logprobs, reward)| Record {
                record_id: id,
                group_key,
                prompt_ids,
                response_ids,
                version,
                sample_index: 0,
                logprobs,
                reward,
                sequence: 0,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(req) = PublishRequest::decode(data.as_slice()) {
            for (i, r) in req.records.iter().enumerate() {
                let _ = validate::check(i, r, 1 << 20);
                let _ = validate::content_hash(r);
            }
        }
    }

    #[test]
    fn accepted_records_store_persist_and_reload(records in proptest::collection::vec(record(), 1..8)) {
        let req = PublishRequest { records };
        // Through the wire and back.
        let req = PublishRequest::decode(req.encode_to_vec().as_slice()).unwrap();
        let mut ok: Vec<Record> = req
            .records
            .iter()
            .enumerate()
            .filter(|(i, r)| validate::check(*i, r, 1 << 20).is_ok())
            .map(|(_, r)| r.clone())
            .collect();
        for r in &ok {
            prop_assert!(!r.prompt_ids.is_empty() && !r.response_ids.is_empty());
            prop_assert!(r.prompt_ids.iter().chain(&r.response_ids).all(|&t| t < validate::TOKEN_LIMIT));
            prop_assert!(r.logprobs.is_empty() || r.logprobs.len() == r.response_ids.len());
        }
        let mut store = Store::new(Retention::default());
        let hashes = validate::resolve(&mut ok);
        let Ok(places) = store.place(&ok, &hashes) else { return Ok(()) };
        let dir = tempfile::tempdir().unwrap();
        let (mut disk, _) = Disk::open(dir.path(), u64::MAX, &mut |_| {}).unwrap();
        let mut fresh = Vec::new();
        for ((r, p), h) in ok.iter().zip(&places).zip(&hashes) {
            if let Placement::New(seq) = p {
                let mut r = r.clone();
                r.sequence = *seq;
                fresh.push(r.clone());
                store.push(Stored::new(&r, *h));
            }
        }
        disk.append(&mut fresh.iter().map(|r| Stored::new(r, 0)).collect::<Vec<_>>()).unwrap();
        drop(disk);
        let mut loaded = Vec::new();
        let (_d, _) = Disk::open(dir.path(), u64::MAX, &mut |f| loaded.push(f.record())).unwrap();
        prop_assert_eq!(loaded, fresh);
    }
}
