//! The service over real loopback gRPC, in process: publish, subscribe, snapshot, auth, limits.

use histospec_server::proto::history_service_client::HistoryServiceClient;
use histospec_server::proto::{
    FollowGroup, FollowRequest, FollowResponse, PublishRequest, Record, SnapshotRequest,
    StatsRequest, SubscribeRequest,
};
use histospec_server::store::Retention;
use histospec_server::{serve, ServerConfig};
use tonic::transport::Channel;
use tonic::{Code, Request};

fn rec(id: &str, n: u32) -> Record {
    Record {
        record_id: id.as_bytes().to_vec(),
        prompt_ids: vec![1, 2, 3],
        response_ids: (0..n).collect(),
        ..Default::default()
    }
}

async fn client(addr: std::net::SocketAddr) -> HistoryServiceClient<Channel> {
    HistoryServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

fn cfg() -> ServerConfig {
    ServerConfig {
        listen: "127.0.0.1:0".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn publish_subscribe_snapshot_in_order() {
    let h = serve(cfg()).await.unwrap();
    let mut c = client(h.local_addr).await;
    let mut stream = c
        .subscribe(SubscribeRequest { from_sequence: 0 })
        .await
        .unwrap()
        .into_inner();
    let r = c
        .publish(PublishRequest {
            records: vec![rec("a", 4), rec("b", 5), rec("a", 4)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (r.sequences, r.accepted, r.duplicates, r.durable),
        (vec![1, 2, 1], 2, 1, false)
    );
    let msg = stream.message().await.unwrap().unwrap();
    let seqs: Vec<u64> = msg.records.iter().map(|r| r.sequence).collect();
    assert_eq!(seqs, vec![1, 2]);
    // The server resolved the group key.
    assert_eq!(
        msg.records[0].group_key,
        Some(histospec_index::prompt_key(&[1, 2, 3]))
    );
    c.publish(PublishRequest {
        records: vec![rec("c", 2)],
    })
    .await
    .unwrap();
    let msg = stream.message().await.unwrap().unwrap();
    assert_eq!(msg.records[0].sequence, 3);
    assert_eq!(msg.head_sequence, 3);
    let mut snap = c.snapshot(SnapshotRequest {}).await.unwrap().into_inner();
    let chunk = snap.message().await.unwrap().unwrap();
    assert!(
        chunk.last
            && chunk.through_sequence == 3
            && chunk.total_records == 3
            && chunk.records.len() == 3
    );
    let st = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(
        (st.records, st.duplicates, st.subscribers, st.groups),
        (3, 1, 1, 1)
    );
    h.shutdown();
    // The open stream ends on shutdown instead of holding the server up.
    assert!(stream.message().await.map(|m| m.is_none()).unwrap_or(true));
    h.wait().await.unwrap();
}

#[tokio::test]
async fn auth_retention_and_invalid_records() {
    let h = serve(ServerConfig {
        auth_token: Some("tok".into()),
        retention: Retention {
            max_tokens: 0,
            max_records: 2,
        },
        ..cfg()
    })
    .await
    .unwrap();
    let mut c = client(h.local_addr).await;
    let e = c.stats(StatsRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let authed = |m| {
        let mut r = Request::new(m);
        r.metadata_mut()
            .insert("authorization", "Bearer tok".parse().unwrap());
        r
    };
    let recs = (0..5).map(|i| rec(&format!("r{i}"), 3)).collect();
    c.publish(authed(PublishRequest { records: recs }))
        .await
        .unwrap();
    let st = c.stats(authed_stats()).await.unwrap().into_inner();
    assert_eq!(
        (st.records, st.first_sequence, st.evicted_records),
        (2, 4, 3)
    );
    let e = c.subscribe(authed_sub(2)).await.unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange);
    let e = c.subscribe(authed_sub(9)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    let bad = PublishRequest {
        records: vec![
            rec("ok", 1),
            Record {
                prompt_ids: vec![],
                ..rec("x", 1)
            },
        ],
    };
    let e = c.publish(authed(bad)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("record 1: prompt_ids is empty"),
        "{}",
        e.message()
    );
    // Nothing of a refused request was stored.
    assert_eq!(
        c.stats(authed_stats())
            .await
            .unwrap()
            .into_inner()
            .head_sequence,
        5
    );
    h.shutdown();
    h.wait().await.unwrap();

    fn authed_stats() -> Request<StatsRequest> {
        let mut r = Request::new(StatsRequest {});
        r.metadata_mut()
            .insert("authorization", "Bearer tok".parse().unwrap());
        r
    }
    fn authed_sub(from: u64) -> Request<SubscribeRequest> {
        let mut r = Request::new(SubscribeRequest {
            from_sequence: from,
        });
        r.metadata_mut()
            .insert("authorization", "Bearer tok".parse().unwrap());
        r
    }
}

fn grec(id: &str, group: u64) -> Record {
    Record {
        group_key: Some(group),
        ..rec(id, 3)
    }
}

fn add(groups: &[(u64, u64)]) -> FollowRequest {
    FollowRequest {
        add: groups
            .iter()
            .map(|&(group_key, after_sequence)| FollowGroup {
                group_key,
                after_sequence,
            })
            .collect(),
        ..Default::default()
    }
}

/// Opens a Follow stream with `first` as its first request; returns the sender of the later ones.
async fn follow(
    c: &mut HistoryServiceClient<Channel>,
    first: FollowRequest,
) -> (
    tokio::sync::mpsc::UnboundedSender<FollowRequest>,
    tonic::Streaming<FollowResponse>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let s = c
        .follow(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(first).unwrap();
    (tx, s)
}

/// Reads Follow messages until `want` records and every group of `ready` have come.
async fn collect(
    s: &mut tonic::Streaming<FollowResponse>,
    want: usize,
    ready: &[u64],
) -> (Vec<(u64, u64)>, Vec<u64>, u64) {
    let (mut got, mut seen, mut cursor) = (Vec::new(), Vec::new(), 0);
    while got.len() < want || !ready.iter().all(|g| seen.contains(g)) {
        let m = tokio::time::timeout(std::time::Duration::from_secs(10), s.message())
            .await
            .expect("follow stream stalled")
            .unwrap()
            .unwrap();
        got.extend(m.records.iter().map(|r| (r.group_key.unwrap(), r.sequence)));
        seen.extend(m.ready_groups);
        cursor = m.cursor;
    }
    (got, seen, cursor)
}

#[tokio::test]
async fn follow_sends_history_then_only_held_groups_and_resumes_without_duplicates() {
    let h = serve(cfg()).await.unwrap();
    let mut c = client(h.local_addr).await;
    // History: groups 1 and 2 interleaved, 3 records each.
    let records = (0..6).map(|i| grec(&format!("h{i}"), 1 + i % 2)).collect();
    c.publish(PublishRequest { records }).await.unwrap();
    let (tx, mut s) = follow(
        &mut c,
        FollowRequest {
            from_sequence: 0,
            ..add(&[(1, 0)])
        },
    )
    .await;
    let (got, ready, _) = collect(&mut s, 3, &[1]).await;
    assert_eq!(
        got,
        vec![(1, 1), (1, 3), (1, 5)],
        "group 1's history, in order"
    );
    assert_eq!(ready, vec![1]);
    // New records: only group 1's arrive; group 2 added later gets its history, group 3 never.
    let records = vec![grec("n1", 2), grec("n2", 1), grec("n3", 3)];
    c.publish(PublishRequest { records }).await.unwrap();
    let (got, _, _) = collect(&mut s, 1, &[]).await;
    assert_eq!(got, vec![(1, 8)]);
    tx.send(add(&[(2, 0)])).unwrap();
    let (got, ready, cursor) = collect(&mut s, 4, &[2]).await;
    assert_eq!(got, vec![(2, 2), (2, 4), (2, 6), (2, 7)]);
    assert_eq!((ready, cursor), (vec![2], 10));
    let st = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((st.followers, st.followed_groups), (1, 2));
    // Drop group 1: its next record is not sent; group 2's is.
    tx.send(FollowRequest {
        drop: vec![1],
        ..Default::default()
    })
    .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let records = vec![grec("n4", 1), grec("n5", 2)];
    c.publish(PublishRequest { records }).await.unwrap();
    let (got, _, cursor) = collect(&mut s, 1, &[]).await;
    assert_eq!((got, cursor), (vec![(2, 11)], 12));
    drop(tx);
    drop(s);
    // A reconnect from the last cursor, re-adding what it holds, receives nothing twice.
    c.publish(PublishRequest {
        records: vec![grec("n6", 2)],
    })
    .await
    .unwrap();
    let (_tx, mut s) = follow(
        &mut c,
        FollowRequest {
            from_sequence: cursor,
            ..add(&[(2, cursor - 1)])
        },
    )
    .await;
    let (got, _, _) = collect(&mut s, 1, &[2]).await;
    assert_eq!(got, vec![(2, 12)]);
    // A from_sequence past the head is refused.
    let (_tx2, mut bad) = follow(
        &mut c,
        FollowRequest {
            from_sequence: 99,
            ..Default::default()
        },
    )
    .await;
    let e = bad.message().await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    h.shutdown();
    assert!(s.message().await.map(|m| m.is_none()).unwrap_or(true));
    h.wait().await.unwrap();
}

/// Every record of the store, as a Subscribe from the start delivers them.
async fn subscribe_all(c: &mut HistoryServiceClient<Channel>, want: usize) -> Vec<Record> {
    let mut s = c
        .subscribe(SubscribeRequest { from_sequence: 1 })
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    while got.len() < want {
        let m = tokio::time::timeout(std::time::Duration::from_secs(10), s.message())
            .await
            .expect("subscribe stalled")
            .unwrap()
            .unwrap();
        got.extend(m.records);
    }
    got
}

#[tokio::test]
async fn records_past_the_memory_budget_are_served_from_the_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let conf = || ServerConfig {
        data_dir: Some(dir.path().to_path_buf()),
        memory_bytes: 4096,
        // Compaction moves records into the snapshot while some are held on disk only.
        snapshot_every_bytes: 20_000,
        ..cfg()
    };
    let h = serve(conf()).await.unwrap();
    let mut c = client(h.local_addr).await;
    let want: Vec<Record> = (0..300u32)
        .map(|i| Record {
            group_key: Some(u64::from(i % 7)),
            response_ids: (0..40).map(|t| t * 31 + i).collect(),
            ..rec(&format!("r{i}"), 0)
        })
        .collect();
    for chunk in want.chunks(25) {
        c.publish(PublishRequest {
            records: chunk.to_vec(),
        })
        .await
        .unwrap();
    }
    let st = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(st.records, 300);
    assert!(
        st.resident_bytes <= 4096 + 400,
        "{} bytes resident",
        st.resident_bytes
    );
    let same = |got: &[Record]| {
        got.iter()
            .map(|r| (r.record_id.clone(), r.response_ids.clone()))
            .collect::<Vec<_>>()
            == want
                .iter()
                .map(|r| (r.record_id.clone(), r.response_ids.clone()))
                .collect::<Vec<_>>()
    };
    assert!(same(&subscribe_all(&mut c, 300).await));
    // A group's history, most of it on disk only, through Follow.
    let (tx, mut f) = follow(
        &mut c,
        FollowRequest {
            from_sequence: 0,
            ..add(&[(3, 0)])
        },
    )
    .await;
    let (got, _, _) = collect(&mut f, 43, &[3]).await;
    assert_eq!(got.len(), 43);
    assert!(got.iter().all(|&(g, _)| g == 3));
    assert_eq!(
        got.iter().map(|&(_, q)| q).collect::<Vec<_>>(),
        (1..=300u64)
            .filter(|q| (q - 1) % 7 == 3)
            .collect::<Vec<_>>()
    );
    drop(tx);
    drop(f);
    h.shutdown();
    h.wait().await.unwrap();
    // Restarted from the data dir under the same budget: the same records, from disk.
    let h = serve(conf()).await.unwrap();
    let mut c = client(h.local_addr).await;
    let st = c.stats(StatsRequest {}).await.unwrap().into_inner();
    // The records came from the index without decoding; memory holds the newest again.
    assert!(st.records == 300 && st.resident_bytes <= 4096 && st.resident_bytes > 4096 - 400);
    assert!(same(&subscribe_all(&mut c, 300).await));
    // Their content hashes came back with them: a resend is a duplicate, a changed record refused.
    let again = c
        .publish(PublishRequest {
            records: want[..25].to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((again.accepted, again.duplicates), (0, 25));
    let changed = Record {
        response_ids: vec![7, 7, 7],
        ..want[0].clone()
    };
    let e = c
        .publish(PublishRequest {
            records: vec![changed],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::AlreadyExists, "{e}");
    h.shutdown();
    h.wait().await.unwrap();
    // Without a memory budget every record is read back into memory.
    let h = serve(ServerConfig {
        memory_bytes: 0,
        ..conf()
    })
    .await
    .unwrap();
    let mut c = client(h.local_addr).await;
    let st = c.stats(StatsRequest {}).await.unwrap().into_inner();
    // (each stored record also carries its sequence)
    let total: u64 = want
        .iter()
        .map(|r| prost::Message::encoded_len(r) as u64)
        .sum();
    assert!(
        st.records == 300 && st.resident_bytes >= total,
        "{} of {total}",
        st.resident_bytes
    );
    assert!(same(&subscribe_all(&mut c, 300).await));
    h.shutdown();
    h.wait().await.unwrap();
    // The budget needs a data dir.
    let e = serve(ServerConfig {
        memory_bytes: 1,
        ..cfg()
    })
    .await
    .err()
    .unwrap();
    assert!(e.to_string().contains("--data-dir"), "{e}");
}
