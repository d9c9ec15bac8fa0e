//! `histospec-draft-server`: the draft server as a program, with the flags of
//! `histospec-sgl draft-server` (`cargo install --path rust/histospec-server`).
//!
//! Trainers and engines publish finished rollouts; index replicas subscribe and converge to the same
//! history (`proto/histospec/v1/history.proto`). Prints `histospec draft-server listening on
//! HOST:PORT` on stdout once it accepts connections; stops gracefully on SIGTERM/SIGINT (drain, final
//! snapshot). Exit status: 0 after a graceful stop, 1 when it cannot start, 2 for bad flags.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use histospec_server::server::{announce, run_until_signal};
use histospec_server::store::Retention;
use histospec_server::ServerConfig;

/// Serve history to index replicas over gRPC (histospec.v1).
#[derive(Debug, Parser)]
#[command(name = "histospec-draft-server", version)]
struct Args {
    /// host:port (default loopback; port 0: any free)
    #[arg(long, default_value = "127.0.0.1:50061")]
    listen: String,
    /// require `authorization: Bearer <token in F>`
    #[arg(long, value_name = "F")]
    auth_token_file: Option<PathBuf>,
    /// persist the log and snapshots here (fsync before ack)
    #[arg(long, value_name = "D")]
    data_dir: Option<PathBuf>,
    /// retain at most N prompt+response tokens, evicting the oldest records (0: no limit)
    #[arg(long, default_value_t = 0, value_name = "N")]
    max_tokens: u64,
    /// retain at most N records (0: no limit)
    #[arg(long, default_value_t = 0, value_name = "N")]
    max_records: u64,
    /// largest gRPC message
    #[arg(long, default_value_t = 64 << 20)]
    max_message_bytes: usize,
    /// largest record, in tokens
    #[arg(long, default_value_t = 1 << 20)]
    max_tokens_per_record: usize,
    /// compact the log into a snapshot after this much log
    #[arg(long, default_value_t = 256 << 20)]
    snapshot_every_bytes: u64,
    /// messages buffered per subscriber
    #[arg(long, default_value_t = 8)]
    subscriber_buffer: usize,
    /// serve TLS with this certificate chain
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// and this private key
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// allow listening beyond loopback without a token (a network you trust)
    #[arg(long)]
    insecure: bool,
}

fn loopback(listen: &str) -> bool {
    let host = listen
        .rsplit_once(':')
        .map_or(listen, |(h, _)| h)
        .trim_matches(|c| c == '[' || c == ']');
    host.parse::<IpAddr>()
        .map_or(host == "localhost", |ip| ip.is_loopback())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let token = match &args.auth_token_file {
        None => None,
        Some(path) => match std::fs::read_to_string(path) {
            Ok(t) if !t.trim().is_empty() => Some(t.trim().to_string()),
            Ok(_) => {
                eprintln!("error: --auth-token-file {} is empty", path.display());
                return ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("error: --auth-token-file: {e}");
                return ExitCode::from(2);
            }
        },
    };
    if !loopback(&args.listen) && token.is_none() {
        if !args.insecure {
            eprintln!(
                "error: --listen {} reaches beyond this machine and no --auth-token-file is given: anyone who \
                 can reach the port could read every prompt and response of the job and fill the server's \
                 memory. Give a token (clients: HISTOSPEC_DRAFT_SERVER_TOKEN_FILE), or pass --insecure on a \
                 network you trust",
                args.listen
            );
            return ExitCode::from(2);
        }
        eprintln!(
            "warning: listening on {} without a token (--insecure)",
            args.listen
        );
    }
    let mut cfg = ServerConfig {
        listen: args.listen,
        auth_token: token,
        data_dir: args.data_dir,
        retention: Retention {
            max_tokens: args.max_tokens,
            max_records: args.max_records,
        },
        snapshot_every_bytes: args.snapshot_every_bytes,
        tls: args.tls_cert.zip(args.tls_key),
        ..Default::default()
    }
    .with_max_message_bytes(args.max_message_bytes);
    cfg.limits.max_tokens_per_record = args.max_tokens_per_record;
    cfg.limits.subscriber_buffer = args.subscriber_buffer;
    match run_until_signal(cfg, announce) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts() {
        assert!(loopback("127.0.0.1:0"));
        assert!(loopback("[::1]:50061"));
        assert!(loopback("localhost:1"));
        assert!(!loopback("0.0.0.0:50061"));
        assert!(!loopback("10.1.2.3:5"));
    }

    #[test]
    fn flags_parse_like_the_python_cli() {
        let a = Args::try_parse_from([
            "histospec-draft-server",
            "--listen",
            "127.0.0.1:0",
            "--max-records",
            "5",
        ])
        .unwrap();
        assert_eq!((a.listen.as_str(), a.max_records), ("127.0.0.1:0", 5));
        assert_eq!(a.max_message_bytes, 64 << 20);
        assert!(Args::try_parse_from(["x", "--tls-cert", "a.pem"]).is_err());
        assert!(Args::try_parse_from(["x", "--max-records", "many"]).is_err());
    }
}
