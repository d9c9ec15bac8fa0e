//! The `histospec.v1.HistoryService` implementation.
//!
//! Publishes are serialized: validate the whole request, place each record (new sequence or
//! duplicate), append the new ones to the log and fsync, then make them visible and acknowledge.
//! Subscribers pull from the shared store at their own pace, each through a bounded buffer, so a slow
//! one never holds up the others or the publishers; one whose next record was evicted by retention is
//! cut off with OUT_OF_RANGE and catches up through `Snapshot`. A follower (`Follow`) reads the same
//! store through its own cursor, keeping only the records of the groups it holds, and is sent a group's
//! retained history (from the store's per-group index) when it adds the group.

use std::collections::{HashSet, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::disk::Disk;
use crate::proto::{
    AnnounceRequest, AnnounceResponse, FollowRequest, PublishRequest, PublishResponse, Record,
    SnapshotRequest, StatsRequest, StatsResponse, SubscribeRequest,
};
use crate::proto_server::history_service_server::HistoryService;
use crate::store::{batch_len, Placement, Store};
use crate::validate;
use crate::wire::{EncodedFollowResponse, EncodedSnapshotChunk, EncodedSubscribeResponse, Stored};

/// Per-message and per-stream limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest prompt + response of one record.
    pub max_tokens_per_record: usize,
    /// Target size of one Subscribe / Snapshot message (token bytes).
    pub batch_bytes: usize,
    /// Records per Subscribe / Snapshot message at most.
    pub batch_records: usize,
    /// Messages buffered per subscriber before it is left to catch up on its own.
    pub subscriber_buffer: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_tokens_per_record: 1 << 20,
            batch_bytes: 1 << 20,
            batch_records: 1024,
            subscriber_buffer: 8,
        }
    }
}

/// The persistence side of publishing: the open data dir, or none; once a write fails the server
/// refuses publishes (a half-written log must not be appended to) until it is restarted.
pub(crate) struct Writer {
    pub disk: Option<Disk>,
    pub failed: Option<String>,
}

/// State shared by every handler.
pub struct Shared {
    pub(crate) store: RwLock<Store>,
    pub(crate) writer: Mutex<Writer>,
    head_tx: watch::Sender<u64>,
    /// Announced groups, to every Follow stream.
    announce_tx: tokio::sync::broadcast::Sender<Arc<Vec<u64>>>,
    shutdown: watch::Receiver<bool>,
    subscribers: AtomicU64,
    followers: AtomicU64,
    followed_groups: AtomicU64,
    cut_off: AtomicU64,
    durable: bool,
    limits: Limits,
}

/// Announcements a Follow stream may fall behind by before it misses some.
const ANNOUNCE_BUFFER: usize = 64;
/// Most groups in one Announce.
pub const MAX_ANNOUNCED: usize = 1 << 16;

fn poisoned() -> Status {
    Status::internal("draft server state poisoned by an earlier panic; restart it")
}

impl Shared {
    pub(crate) fn new(
        store: Store,
        disk: Option<Disk>,
        limits: Limits,
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        let (head_tx, _) = watch::channel(store.head());
        let (announce_tx, _) = tokio::sync::broadcast::channel(ANNOUNCE_BUFFER);
        Shared {
            announce_tx,
            durable: disk.is_some(),
            store: RwLock::new(store),
            writer: Mutex::new(Writer { disk, failed: None }),
            head_tx,
            shutdown,
            subscribers: AtomicU64::new(0),
            followers: AtomicU64::new(0),
            followed_groups: AtomicU64::new(0),
            cut_off: AtomicU64::new(0),
            limits,
        }
    }

    /// Stores a validated request (blocking: it fsyncs).
    pub fn publish(&self, mut records: Vec<Record>) -> Result<PublishResponse, Status> {
        let hashes = validate::resolve(&mut records);
        let mut w = self.writer.lock().map_err(|_| poisoned())?;
        if let Some(why) = &w.failed {
            return Err(Status::unavailable(format!(
                "the data dir failed earlier ({why}); publishes are refused until the server restarts"
            )));
        }
        let placements = self
            .store
            .read()
            .map_err(|_| poisoned())?
            .place(&records, &hashes)
            .map_err(|e| Status::already_exists(e.to_string()))?;
        let mut sequences = Vec::with_capacity(records.len());
        let mut fresh: Vec<Stored> = Vec::new();
        for ((mut r, p), h) in records.into_iter().zip(placements).zip(hashes) {
            match p {
                Placement::New(seq) => {
                    r.sequence = seq;
                    fresh.push(Stored::new(&r, h));
                    sequences.push(seq);
                }
                Placement::Duplicate(seq) => sequences.push(seq),
            }
        }
        let accepted = fresh.len() as u64;
        let duplicates = sequences.len() as u64 - accepted;
        if let Some(d) = w.disk.as_mut() {
            if let Err(e) = d.append(&mut fresh) {
                tracing::error!("log append failed, refusing publishes from now on: {e}");
                w.failed = Some(e.to_string());
                return Err(Status::unavailable(format!(
                    "could not persist the records: {e}"
                )));
            }
        }
        let head = {
            let mut s = self.store.write().map_err(|_| poisoned())?;
            for r in fresh {
                s.push(r);
            }
            s.duplicates += duplicates;
            s.enforce_retention();
            s.head()
        };
        self.head_tx.send_replace(head);
        if let Some(d) = w.disk.as_mut().filter(|d| d.wants_snapshot()) {
            let all = self.store.read().map_err(|_| poisoned())?.all();
            // The records are already durable in the log: a failed compaction only costs disk space.
            match d.snapshot(&all, head) {
                Ok(locs) => self
                    .store
                    .write()
                    .map_err(|_| poisoned())?
                    .relocate(&all, locs),
                Err(e) => tracing::warn!("snapshot failed (the log keeps everything): {e}"),
            }
        }
        Ok(PublishResponse {
            sequences,
            accepted,
            duplicates,
            durable: self.durable,
        })
    }

    /// Writes a final snapshot (graceful shutdown).
    pub fn final_snapshot(&self) -> Result<(), String> {
        let mut w = self.writer.lock().map_err(|_| "poisoned".to_string())?;
        if w.failed.is_some() {
            return Ok(());
        }
        if let Some(d) = w.disk.as_mut() {
            let (all, head) = {
                let s = self.store.read().map_err(|_| "poisoned".to_string())?;
                (s.all(), s.head())
            };
            let locs = d.snapshot(&all, head).map_err(|e| e.to_string())?;
            self.store
                .write()
                .map_err(|_| "poisoned".to_string())?
                .relocate(&all, locs);
        }
        Ok(())
    }

    /// Counters for `Stats`.
    pub fn stats(&self) -> Result<StatsResponse, Status> {
        let mut st = self.store.read().map_err(|_| poisoned())?.stats();
        st.subscribers = self.subscribers.load(Ordering::Relaxed);
        st.followers = self.followers.load(Ordering::Relaxed);
        st.followed_groups = self.followed_groups.load(Ordering::Relaxed);
        st.cut_off_subscribers = self.cut_off.load(Ordering::Relaxed);
        st.durable = self.durable;
        Ok(st)
    }
}

/// The gRPC service.
#[derive(Clone)]
pub struct Service {
    pub(crate) shared: Arc<Shared>,
}

type Stream_<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

struct SubscriberCount(Arc<Shared>);
impl Drop for SubscriberCount {
    fn drop(&mut self) {
        self.0.subscribers.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn subscribe_loop(
    shared: Arc<Shared>,
    mut cursor: u64,
    tx: mpsc::Sender<Result<EncodedSubscribeResponse, Status>>,
) {
    shared.subscribers.fetch_add(1, Ordering::Relaxed);
    let _count = SubscriberCount(Arc::clone(&shared));
    let mut head_rx = shared.head_tx.subscribe();
    let mut shutdown = shared.shutdown.clone();
    let lim = shared.limits;
    loop {
        if *shutdown.borrow_and_update() {
            return;
        }
        head_rx.borrow_and_update();
        let read = shared
            .store
            .read()
            .map(|s| {
                (
                    s.read_from(cursor, lim.batch_records, lim.batch_bytes),
                    s.head(),
                )
            })
            .ok();
        let Some((batch, head)) = read else {
            let _ = tx.send(Err(poisoned())).await;
            return;
        };
        let Some(batch) = batch else {
            shared.cut_off.fetch_add(1, Ordering::Relaxed);
            let msg = format!(
                "sequence {cursor} was evicted by retention before this subscriber read it; \
                 catch up with Snapshot and subscribe after its through_sequence"
            );
            let _ = tx.send(Err(Status::out_of_range(msg))).await;
            return;
        };
        if batch.is_empty() {
            tokio::select! {
                r = head_rx.changed() => if r.is_err() { return },
                _ = shutdown.changed() => return,
                _ = tx.closed() => return,
            }
            continue;
        }
        cursor = batch.last().map_or(cursor, |r| r.sequence + 1);
        let records = match read_bytes(&batch) {
            Ok(b) => b,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
        };
        tokio::select! {
            r = tx.send(Ok(EncodedSubscribeResponse { records, head_sequence: head })) => if r.is_err() { return },
            _ = shutdown.changed() => return,
        }
    }
}

/// The encodings of `records`, reading those held on disk only.
fn read_bytes(records: &[Arc<Stored>]) -> Result<Vec<bytes::Bytes>, Status> {
    records
        .iter()
        .map(|r| {
            r.bytes().map_err(|e| {
                tracing::error!("reading a record from the data dir failed: {e}");
                Status::internal(format!("reading a record from the data dir failed: {e}"))
            })
        })
        .collect()
}

/// One Follow stream's state: the groups it holds, the histories still to send, its live cursor.
struct Follower {
    shared: Arc<Shared>,
    held: HashSet<u64>,
    /// Groups added whose history is not all sent: (group, sent through this sequence, history bound).
    pending: VecDeque<(u64, u64, u64)>,
    cursor: u64,
}

impl Follower {
    fn apply(&mut self, req: FollowRequest) {
        for g in req.drop {
            if self.held.remove(&g) {
                self.shared.followed_groups.fetch_sub(1, Ordering::Relaxed);
            }
            self.pending.retain(|p| p.0 != g);
        }
        for a in req.add {
            if self.held.insert(a.group_key) {
                self.shared.followed_groups.fetch_add(1, Ordering::Relaxed);
                self.pending
                    .push_back((a.group_key, a.after_sequence, self.cursor));
            }
        }
    }

    /// The next message: pending histories first (a group is ready once its history is all sent),
    /// then live records of held groups from the cursor on. None when there is nothing to send yet.
    fn next(&mut self) -> Result<Option<EncodedFollowResponse>, Status> {
        let lim = self.shared.limits;
        let store = self.shared.store.read().map_err(|_| poisoned())?;
        let head = store.head();
        let mut msg = EncodedFollowResponse {
            head_sequence: head,
            ..Default::default()
        };
        let mut send: Vec<Arc<Stored>> = Vec::new();
        let mut bytes = 0usize;
        while let Some(&(g, after, before)) = self.pending.front() {
            let room = lim.batch_records.saturating_sub(send.len());
            if room == 0 || bytes >= lim.batch_bytes {
                break;
            }
            let batch = store.group_records(g, after, before, room, lim.batch_bytes - bytes);
            match batch.last() {
                Some(last) => {
                    self.pending[0].1 = last.sequence;
                    bytes += batch.iter().map(|r| r.len).sum::<usize>();
                    send.extend(batch);
                }
                None => {
                    msg.ready_groups.push(g);
                    self.pending.pop_front();
                }
            }
        }
        if self.pending.is_empty() && bytes < lim.batch_bytes {
            // Live records: every new record is looked at once, only held groups' are sent.
            let from = self.cursor.max(store.first());
            let scan = store
                .read_from(from, lim.batch_records * 8, usize::MAX)
                .unwrap_or_default();
            for r in scan {
                let seq = r.sequence;
                if self.held.contains(&r.group_key.unwrap_or_default()) {
                    if !send.is_empty()
                        && (bytes >= lim.batch_bytes || send.len() >= lim.batch_records)
                    {
                        break; // the message is full: this record goes in the next
                    }
                    bytes += r.len;
                    send.push(r);
                }
                self.cursor = seq + 1;
            }
        }
        drop(store); // records on disk only are read without holding up publishers
        msg.records = read_bytes(&send)?;
        msg.cursor = self.cursor;
        let moved = !msg.records.is_empty() || !msg.ready_groups.is_empty();
        Ok(moved.then_some(msg))
    }

    fn caught_up(&self) -> bool {
        self.pending.is_empty()
            && self
                .shared
                .store
                .read()
                .map(|s| self.cursor > s.head())
                .unwrap_or(true)
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.shared.followers.fetch_sub(1, Ordering::Relaxed);
        self.shared
            .followed_groups
            .fetch_sub(self.held.len() as u64, Ordering::Relaxed);
    }
}

async fn follow_loop(
    shared: Arc<Shared>,
    mut requests: Streaming<FollowRequest>,
    tx: mpsc::Sender<Result<EncodedFollowResponse, Status>>,
) {
    let mut shutdown = shared.shutdown.clone();
    let first = tokio::select! {
        m = requests.message() => m,
        _ = shutdown.changed() => return,
        _ = tx.closed() => return,
    };
    let first = match first {
        Ok(Some(m)) => m,
        Ok(None) => return,
        Err(e) => {
            let _ = tx.send(Err(e)).await;
            return;
        }
    };
    let head = shared.store.read().map(|s| s.head()).ok();
    let head = match head {
        Some(h) => h,
        None => {
            let _ = tx.send(Err(poisoned())).await;
            return;
        }
    };
    if first.from_sequence > head + 1 {
        let msg = format!(
            "from_sequence {} is past the server's head {head} (was it restarted without \
             --data-dir?); follow again from 0",
            first.from_sequence
        );
        let _ = tx.send(Err(Status::failed_precondition(msg))).await;
        return;
    }
    shared.followers.fetch_add(1, Ordering::Relaxed);
    let mut f = Follower {
        cursor: if first.from_sequence == 0 {
            head + 1
        } else {
            first.from_sequence
        },
        shared: Arc::clone(&shared),
        held: HashSet::new(),
        pending: VecDeque::new(),
    };
    f.apply(first);
    // Requests are read by their own task so that a burst of adds never waits behind a send.
    let (req_tx, mut req_rx) = mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        while let Ok(Some(m)) = requests.message().await {
            if req_tx.send(m).is_err() {
                return;
            }
        }
    });
    let _reader = AbortOnDrop(reader);
    let mut head_rx = shared.head_tx.subscribe();
    let mut announce_rx = shared.announce_tx.subscribe();
    let mut announced: Vec<u64> = Vec::new();
    loop {
        if *shutdown.borrow_and_update() {
            return;
        }
        head_rx.borrow_and_update();
        while let Ok(m) = req_rx.try_recv() {
            f.apply(m);
        }
        loop {
            match announce_rx.try_recv() {
                Ok(gs) => announced.extend(gs.iter()),
                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => continue,
                Err(_) => break,
            }
        }
        if !announced.is_empty() {
            // Ahead of any records: the engine asks for these while the records go out.
            let m = EncodedFollowResponse {
                announced_groups: std::mem::take(&mut announced),
                ..Default::default()
            };
            tokio::select! {
                r = tx.send(Ok(m)) => if r.is_err() { return },
                _ = shutdown.changed() => return,
            }
        }
        let msg = match f.next() {
            Ok(m) => m,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
        };
        match msg {
            Some(m) => tokio::select! {
                r = tx.send(Ok(m)) => if r.is_err() { return },
                _ = shutdown.changed() => return,
            },
            None if f.caught_up() => tokio::select! {
                r = head_rx.changed() => if r.is_err() { return },
                m = req_rx.recv() => match m {
                    Some(m) => f.apply(m),
                    None => return, // the client closed its side
                },
                a = announce_rx.recv() => match a {
                    Ok(gs) => announced.extend(gs.iter()),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(_) => return,
                },
                _ = shutdown.changed() => return,
                _ = tx.closed() => return,
            },
            None => {}
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[tonic::async_trait]
impl HistoryService for Service {
    async fn publish(
        &self,
        request: Request<PublishRequest>,
    ) -> Result<Response<PublishResponse>, Status> {
        let records = request.into_inner().records;
        let lim = self.shared.limits.max_tokens_per_record;
        for (i, r) in records.iter().enumerate() {
            validate::check(i, r, lim).map_err(|e| Status::invalid_argument(e.to_string()))?;
        }
        let shared = Arc::clone(&self.shared);
        let reply = tokio::task::spawn_blocking(move || shared.publish(records))
            .await
            .map_err(|e| Status::internal(format!("publish task failed: {e}")))??;
        Ok(Response::new(reply))
    }

    type SubscribeStream = Stream_<EncodedSubscribeResponse>;

    async fn subscribe(
        &self,
        request: Request<SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let from = request.into_inner().from_sequence;
        let cursor = {
            let s = self.shared.store.read().map_err(|_| poisoned())?;
            if from > s.head() + 1 {
                return Err(Status::failed_precondition(format!(
                    "from_sequence {from} is past the server's head {} (was it restarted without \
                     --data-dir?); rebuild this replica from a Snapshot",
                    s.head()
                )));
            }
            if from > 1 && from < s.first() {
                return Err(Status::out_of_range(format!(
                    "from_sequence {from} was evicted (oldest retained: {}); catch up with Snapshot",
                    s.first()
                )));
            }
            if from <= 1 {
                s.first()
            } else {
                from
            }
        };
        let (tx, rx) = mpsc::channel(self.shared.limits.subscriber_buffer.max(1));
        tokio::spawn(subscribe_loop(Arc::clone(&self.shared), cursor, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type SnapshotStream = Stream_<EncodedSnapshotChunk>;

    async fn snapshot(
        &self,
        _request: Request<SnapshotRequest>,
    ) -> Result<Response<Self::SnapshotStream>, Status> {
        let (all, through) = {
            let s = self.shared.store.read().map_err(|_| poisoned())?;
            (s.all(), s.head())
        };
        let lim = self.shared.limits;
        let (tx, rx) = mpsc::channel(lim.subscriber_buffer.max(1));
        tokio::spawn(async move {
            let total = all.len() as u64;
            let mut at = 0;
            loop {
                let n = batch_len(&all[at..], lim.batch_records, lim.batch_bytes);
                let records = match read_bytes(&all[at..at + n]) {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                };
                at += n;
                let last = at >= all.len();
                let chunk = EncodedSnapshotChunk {
                    records,
                    through_sequence: through,
                    total_records: total,
                    last,
                };
                if tx.send(Ok(chunk)).await.is_err() || last {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type FollowStream = Stream_<EncodedFollowResponse>;

    async fn follow(
        &self,
        request: Request<Streaming<FollowRequest>>,
    ) -> Result<Response<Self::FollowStream>, Status> {
        let (tx, rx) = mpsc::channel(self.shared.limits.subscriber_buffer.max(1));
        tokio::spawn(follow_loop(
            Arc::clone(&self.shared),
            request.into_inner(),
            tx,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn announce(
        &self,
        request: Request<AnnounceRequest>,
    ) -> Result<Response<AnnounceResponse>, Status> {
        let groups = request.into_inner().group_keys;
        if groups.len() > MAX_ANNOUNCED {
            return Err(Status::invalid_argument(format!(
                "{} groups in one Announce (at most {MAX_ANNOUNCED}); send them in parts",
                groups.len()
            )));
        }
        // No receiver (no Follow stream open) is not an error: nobody to tell.
        let followers = self.shared.announce_tx.send(Arc::new(groups)).unwrap_or(0);
        Ok(Response::new(AnnounceResponse {
            followers: followers as u64,
        }))
    }

    async fn stats(
        &self,
        _request: Request<StatsRequest>,
    ) -> Result<Response<StatsResponse>, Status> {
        Ok(Response::new(self.shared.stats()?))
    }
}
