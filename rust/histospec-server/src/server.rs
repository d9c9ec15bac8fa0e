//! Configuration, start-up (load the data dir, bind, health), graceful shutdown (stop accepting, end
//! subscriber streams, drain, final snapshot).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Status};

use crate::disk::{Disk, Found};
use crate::proto_server::history_service_server::HistoryServiceServer;
use crate::service::{Limits, Service, Shared};
use crate::store::{Retention, Store};

/// Everything `histospec-sgl draft-server` can set.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on; port 0 picks a free one.
    pub listen: String,
    /// Clients must send `authorization: Bearer <token>` (health checks excepted).
    pub auth_token: Option<String>,
    /// Persist the log and snapshots here and reload them on start.
    pub data_dir: Option<PathBuf>,
    pub retention: Retention,
    /// Largest gRPC message accepted or sent.
    pub max_message_bytes: usize,
    pub limits: Limits,
    /// Compact the log into a snapshot once it grows past this.
    pub snapshot_every_bytes: u64,
    /// Hold at most this many bytes of encoded records in memory (0: all); older ones are read back
    /// from the data dir when a client asks for them. Needs `data_dir`.
    pub memory_bytes: u64,
    /// PEM certificate chain and key: serve TLS.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// How long a graceful shutdown waits for open calls.
    pub drain_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:50061".into(),
            auth_token: None,
            data_dir: None,
            retention: Retention::default(),
            max_message_bytes: 64 << 20,
            limits: Limits::default(),
            snapshot_every_bytes: 256 << 20,
            memory_bytes: 0,
            tls: None,
            drain_timeout: Duration::from_secs(10),
        }
    }
}

impl ServerConfig {
    /// Sets the largest gRPC message, and a Subscribe batch's size under it (1 MiB of headroom for
    /// the batch's framing).
    pub fn with_max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self.limits.batch_bytes = self
            .limits
            .batch_bytes
            .min(bytes.saturating_sub(1 << 20).max(1 << 16));
        self
    }
}

/// A start-up failure.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("data dir: {0}")]
    Disk(#[from] crate::disk::DiskError),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("{0}")]
    Config(String),
    #[error("server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// A running server.
pub struct ServerHandle {
    pub local_addr: SocketAddr,
    /// Records loaded from the data dir at start.
    pub loaded_records: usize,
    shutdown_tx: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), ServerError>>,
    shared: Arc<Shared>,
}

impl ServerHandle {
    /// Starts a graceful shutdown.
    pub fn shutdown(&self) {
        self.shutdown_tx.send_replace(true);
    }
    /// Waits for the server to stop, then writes the final snapshot.
    pub async fn wait(self) -> Result<(), ServerError> {
        let r = self
            .task
            .await
            .unwrap_or_else(|e| panic!("server task panicked: {e}"));
        let shared = self.shared;
        tokio::task::spawn_blocking(move || {
            if let Err(e) = shared.final_snapshot() {
                tracing::warn!("final snapshot failed (the log keeps everything): {e}");
            }
        })
        .await
        .ok();
        r
    }
    /// Counters, as `Stats` returns them.
    pub fn stats(&self) -> crate::proto::StatsResponse {
        self.shared.stats().unwrap_or_default()
    }
}

fn auth_check(
    token: Option<Arc<str>>,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| {
        let Some(want) = token.as_deref() else {
            return Ok(req);
        };
        let got = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let got = got.strip_prefix("Bearer ").unwrap_or("");
        if constant_time_eq::constant_time_eq(got.as_bytes(), want.as_bytes()) {
            Ok(req)
        } else {
            Err(Status::unauthenticated(
                "missing or wrong bearer token (metadata `authorization: Bearer <token>`)",
            ))
        }
    }
}

/// Loads the data dir, binds and starts serving in the current tokio runtime.
pub async fn serve(cfg: ServerConfig) -> Result<ServerHandle, ServerError> {
    if cfg.memory_bytes > 0 && cfg.data_dir.is_none() {
        return Err(ServerError::Config(
            "--memory-bytes needs --data-dir: records past the memory budget are read back from it"
                .into(),
        ));
    }
    let mut store = Store::new(cfg.retention).with_memory_bytes(cfg.memory_bytes);
    let mut loaded_records = 0;
    let disk = match &cfg.data_dir {
        Some(dir) => {
            // One record at a time: the store keeps `memory_bytes` of them in memory as they come.
            // A record from a segment's index arrives without its encoding, which stays on disk.
            let started = std::time::Instant::now();
            let mut load = |found: Found| {
                match found {
                    Found::Decoded(r, at) => {
                        let h = crate::validate::content_hash(&r);
                        let mut stored = crate::wire::Stored::new(&r, h);
                        stored.at = Some(at);
                        store.push_loaded(stored);
                    }
                    Found::Indexed(stored) => store.push_loaded(stored),
                }
                store.enforce_retention();
            };
            let (disk, loaded) = Disk::open(dir, cfg.snapshot_every_bytes, &mut load)?;
            // Memory holds the newest records' encodings again, as before the restart.
            store.warm().map_err(|e| {
                ServerError::Config(format!("reading records back from {}: {e}", dir.display()))
            })?;
            if loaded.truncated_bytes > 0 {
                tracing::warn!(
                    "cut a torn tail of {} bytes from the newest log (never acknowledged)",
                    loaded.truncated_bytes
                );
            }
            loaded_records = loaded.records;
            store.set_head(loaded.head);
            store.enforce_retention();
            store.evicted = 0;
            tracing::info!(
                "loaded {loaded_records} records from {} in {:.3} s ({} from the index without decoding; head sequence {})",
                dir.display(),
                started.elapsed().as_secs_f64(),
                loaded.indexed,
                store.head()
            );
            Some(disk)
        }
        None => None,
    };
    let listener = TcpListener::bind(&cfg.listen)
        .await
        .map_err(|source| ServerError::Bind {
            addr: cfg.listen.clone(),
            source,
        })?;
    let local_addr = listener.local_addr().map_err(|source| ServerError::Bind {
        addr: cfg.listen.clone(),
        source,
    })?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let shared = Arc::new(Shared::new(store, disk, cfg.limits, shutdown_rx.clone()));
    let svc = HistoryServiceServer::new(Service {
        shared: Arc::clone(&shared),
    })
    .max_decoding_message_size(cfg.max_message_bytes)
    .max_encoding_message_size(cfg.max_message_bytes);
    let svc = InterceptedService::new(svc, auth_check(cfg.auth_token.as_deref().map(Arc::from)));
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<HistoryServiceServer<Service>>()
        .await;

    let mut builder = Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)));
    if let Some((cert, key)) = &cfg.tls {
        let read = |p: &PathBuf| {
            std::fs::read(p).map_err(|e| ServerError::Tls(format!("{}: {e}", p.display())))
        };
        let identity = Identity::from_pem(read(cert)?, read(key)?);
        builder = builder.tls_config(ServerTlsConfig::new().identity(identity))?;
    }
    let router = builder.add_service(health).add_service(svc);
    let mut stop = shutdown_rx;
    let drain = cfg.drain_timeout;
    let task = tokio::spawn(async move {
        let mut stop_signal = stop.clone();
        let signal = async move {
            let _ = stop_signal.wait_for(|&s| s).await;
            reporter
                .set_not_serving::<HistoryServiceServer<Service>>()
                .await;
        };
        let serving = router.serve_with_incoming_shutdown(TcpListenerStream::new(listener), signal);
        tokio::pin!(serving);
        tokio::select! {
            r = &mut serving => return r.map_err(ServerError::from),
            _ = stop.wait_for(|&s| s) => {}
        }
        match tokio::time::timeout(drain, serving).await {
            Ok(r) => r.map_err(ServerError::from),
            Err(_) => {
                tracing::warn!("calls still open after {drain:?}; closing them");
                Ok(())
            }
        }
    });
    Ok(ServerHandle {
        local_addr,
        loaded_records,
        shutdown_tx,
        task,
        shared,
    })
}

/// What a server started by `histospec-sgl draft-server` or the `histospec-draft-server` binary
/// prints on stdout, followed by the bound address, once it accepts connections.
pub const READY_LINE: &str = "histospec draft-server listening on ";

/// Prints [`READY_LINE`] and the address on stdout (flushed: a parent process waits for it).
pub fn announce(addr: SocketAddr) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    #[allow(clippy::print_stdout)]
    let _ = writeln!(out, "{READY_LINE}{addr}");
    let _ = out.flush();
}

/// Runs a server until SIGTERM or SIGINT (a blocking call that owns its runtime); `on_ready` gets the
/// bound address once it accepts connections.
pub fn run_until_signal(
    cfg: ServerConfig,
    on_ready: impl FnOnce(SocketAddr),
) -> Result<(), ServerError> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HISTOSPEC_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("histospec-server")
        .build()
        .map_err(|source| ServerError::Bind {
            addr: cfg.listen.clone(),
            source,
        })?;
    rt.block_on(async move {
        use tokio::signal::unix::{signal, SignalKind};
        // The handlers are in place before the server says it is ready: a parent that stops it
        // right after gets a graceful shutdown, not the signal's default (death mid-write).
        let handler = |kind: SignalKind, name: &str| {
            signal(kind).map_err(|source| ServerError::Bind {
                addr: format!("{name} handler"),
                source,
            })
        };
        let mut term = handler(SignalKind::terminate(), "SIGTERM")?;
        let mut int = handler(SignalKind::interrupt(), "SIGINT")?;
        let handle = serve(cfg).await?;
        on_ready(handle.local_addr);
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        handle.shutdown();
        handle.wait().await
    })
}
