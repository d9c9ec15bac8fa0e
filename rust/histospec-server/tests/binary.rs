//! The `histospec-draft-server` binary end to end, as a user runs it: a real process on loopback,
//! its ready line, gRPC from a tonic client, SIGTERM for a graceful stop, and its data dir across a
//! restart; bad flags and an unusable address exit with their own statuses.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use histospec_server::proto::history_service_client::HistoryServiceClient;
use histospec_server::proto::{PublishRequest, Record, StatsRequest};
use histospec_server::server::READY_LINE;
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_histospec-draft-server");

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(BIN)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .strip_prefix(READY_LINE)
            .unwrap_or_else(|| panic!("no ready line: {line:?}"))
            .trim()
            .to_string();
        Server { child, addr }
    }

    /// SIGTERM, then the exit status (0: a graceful stop).
    fn terminate(mut self) -> i32 {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
        for _ in 0..200 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code().unwrap_or(-1);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        panic!("the server did not stop within 10 s of SIGTERM");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rec(id: &str) -> Record {
    Record {
        record_id: id.as_bytes().to_vec(),
        prompt_ids: vec![1, 2, 3],
        response_ids: vec![4, 5, 6, 7],
        ..Default::default()
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn serves_over_grpc_stops_on_sigterm_and_keeps_its_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let data = data.to_str().unwrap();
    let srv = Server::start(&["--listen", "127.0.0.1:0", "--data-dir", data]);
    let addr = srv.addr.clone();
    let reply = rt().block_on(async {
        let mut c = HistoryServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        c.publish(PublishRequest {
            records: vec![rec("a"), rec("b")],
        })
        .await
        .unwrap()
        .into_inner()
    });
    assert_eq!(
        (reply.sequences, reply.accepted, reply.durable),
        (vec![1, 2], 2, true)
    );
    assert_eq!(srv.terminate(), 0);

    // Started again on the same data dir: both records are there, and ids stay idempotent.
    let srv = Server::start(&["--listen", "127.0.0.1:0", "--data-dir", data]);
    let addr = srv.addr.clone();
    rt().block_on(async {
        let mut c = HistoryServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let stats = c.stats(StatsRequest {}).await.unwrap().into_inner();
        assert_eq!(
            (stats.records, stats.head_sequence, stats.durable),
            (2, 2, true)
        );
        let again = c
            .publish(PublishRequest {
                records: vec![rec("b")],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((again.sequences, again.duplicates), (vec![2], 1));
    });
    assert_eq!(srv.terminate(), 0);
}

#[test]
fn auth_token_file_is_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").unwrap();
    let srv = Server::start(&[
        "--listen",
        "127.0.0.1:0",
        "--auth-token-file",
        token.to_str().unwrap(),
    ]);
    let addr = srv.addr.clone();
    rt().block_on(async {
        let mut c = HistoryServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let err = c.stats(StatsRequest {}).await.unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated);
        let mut req = tonic::Request::new(StatsRequest {});
        req.metadata_mut()
            .insert("authorization", "Bearer s3cret".parse().unwrap());
        assert_eq!(c.stats(req).await.unwrap().into_inner().records, 0);
    });
    assert_eq!(srv.terminate(), 0);
}

#[test]
fn sigterm_the_moment_it_is_ready_still_stops_it_gracefully() {
    // A parent may stop the server as soon as it has read the ready line: the handlers are in
    // place by then, so the stop is graceful (status 0), never the signal's default.
    for _ in 0..20 {
        let srv = Server::start(&["--listen", "127.0.0.1:0", "--insecure"]);
        assert_eq!(srv.terminate(), 0);
    }
}

#[test]
fn bad_flags_and_bad_addresses_exit_with_their_status() {
    let run = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, err) = run(&["--max-records", "many"]);
    assert_eq!(code, Some(2), "{err}");
    let (code, err) = run(&["--tls-cert", "only.pem"]);
    assert_eq!(code, Some(2), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "  \n").unwrap();
    let (code, err) = run(&["--auth-token-file", empty.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(err.contains("is empty"), "{err}");
    // Beyond loopback without a token: refused unless the user says so.
    let (code, err) = run(&["--listen", "0.0.0.0:0"]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("--auth-token-file") && err.contains("--insecure"),
        "{err}"
    );
    let (code, err) = run(&["--listen", "not-an-address", "--insecure"]);
    assert_eq!(code, Some(1));
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: cannot listen on not-an-address"),
        "{err}"
    );
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--listen",
        "--auth-token-file",
        "--data-dir",
        "--max-tokens",
        "--max-records",
        "--max-message-bytes",
        "--max-tokens-per-record",
        "--snapshot-every-bytes",
        "--subscriber-buffer",
        "--tls-cert",
        "--tls-key",
        "--insecure",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
}
