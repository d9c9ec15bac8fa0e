//! The draft server's command line, defined once: the `histospec-draft-server` binary and
//! `histospec-sgl draft-server` (through the Python extension) both parse their arguments here.

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::PathBuf;

use clap::{CommandFactory, Parser};

use crate::server::{announce, run_until_signal};
use crate::store::Retention;
use crate::ServerConfig;

/// Serve history to index replicas over gRPC (histospec.v1).
#[derive(Debug, Parser)]
#[command(name = "histospec-draft-server", version)]
pub struct Args {
    /// host:port (default loopback; port 0: any free)
    #[arg(long, default_value = "127.0.0.1:50061")]
    pub listen: String,
    /// require `authorization: Bearer <token in F>`
    #[arg(long, value_name = "F")]
    pub auth_token_file: Option<PathBuf>,
    /// persist the log and snapshots here (fsync before ack)
    #[arg(long, value_name = "D")]
    pub data_dir: Option<PathBuf>,
    /// retain at most N prompt+response tokens, evicting the oldest records (0: no limit)
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub max_tokens: u64,
    /// retain at most N records (0: no limit)
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub max_records: u64,
    /// largest gRPC message (a size: bytes, or 64M, 1G; binary units)
    #[arg(long, default_value_t = 64 << 20, value_name = "SIZE", value_parser = size::<usize>)]
    pub max_message_bytes: usize,
    /// largest record, in tokens
    #[arg(long, default_value_t = 1 << 20)]
    pub max_tokens_per_record: usize,
    /// hold at most SIZE of encoded records in memory (bytes, or 256M, 1G; binary units), reading
    /// older ones back from --data-dir when a client asks for them (0: all in memory)
    #[arg(long, default_value_t = 0, value_name = "SIZE", value_parser = size::<u64>)]
    pub memory_bytes: u64,
    /// compact the log into a snapshot after this much log (a size, as --memory-bytes)
    #[arg(long, default_value_t = 256 << 20, value_name = "SIZE", value_parser = size::<u64>)]
    pub snapshot_every_bytes: u64,
    /// messages buffered per subscriber
    #[arg(long, default_value_t = 8)]
    pub subscriber_buffer: usize,
    /// serve TLS with this certificate chain
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// and this private key
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// allow listening beyond loopback without a token (a network you trust)
    #[arg(long)]
    pub insecure: bool,
}

/// A size as every histospec command takes one: bytes (`1000000`), or a number with a binary unit
/// (`256M`, `1G`, `512MiB`, `1.5k`), the same values as the Python side's `parse_size`.
fn size<T: TryFrom<u64>>(text: &str) -> Result<T, String> {
    let bytes = parse_size::Config::new()
        .with_binary()
        .parse_size(text)
        .map_err(|e| format!("{e} (examples: 256M, 1G, 1000000)"))?;
    T::try_from(bytes).map_err(|_| format!("{bytes} bytes is too large on this machine"))
}

pub fn loopback(listen: &str) -> bool {
    let host = listen
        .rsplit_once(':')
        .map_or(listen, |(h, _)| h)
        .trim_matches(|c| c == '[' || c == ']');
    host.parse::<IpAddr>()
        .map_or(host == "localhost", |ip| ip.is_loopback())
}

/// The help text, as `name --help` prints it (for generated documentation).
pub fn help(name: &str) -> String {
    Args::command()
        .bin_name(name.to_string())
        .render_help()
        .to_string()
}

/// Parses `argv` (its first item is the program's name) and runs the server until SIGTERM/SIGINT.
/// Returns the exit status: 0 after a graceful stop (or `--help`, `--version`), 1 when it cannot
/// start, 2 for bad flags.
pub fn run<I, T>(argv: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = match Args::try_parse_from(argv) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    serve(args)
}

fn serve(args: Args) -> u8 {
    let token = match &args.auth_token_file {
        None => None,
        Some(path) => match std::fs::read_to_string(path) {
            Ok(t) if !t.trim().is_empty() => Some(t.trim().to_string()),
            Ok(_) => {
                eprintln!("error: --auth-token-file {} is empty", path.display());
                return 2;
            }
            Err(e) => {
                eprintln!("error: --auth-token-file: {e}");
                return 2;
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
            return 2;
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
        memory_bytes: args.memory_bytes,
        tls: args.tls_cert.zip(args.tls_key),
        ..Default::default()
    }
    .with_max_message_bytes(args.max_message_bytes);
    cfg.limits.max_tokens_per_record = args.max_tokens_per_record;
    cfg.limits.subscriber_buffer = args.subscriber_buffer;
    match run_until_signal(cfg, announce) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
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
    fn flags_parse() {
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

    #[test]
    fn sizes_take_the_values_every_histospec_command_takes() {
        for (text, bytes) in [
            ("256M", 256u64 << 20),
            ("1G", 1 << 30),
            ("512MiB", 512 << 20),
            ("4k", 4096),
            ("1000000", 1_000_000),
            ("0", 0),
        ] {
            let a =
                Args::try_parse_from(["x", "--memory-bytes", text, "--snapshot-every-bytes", text])
                    .unwrap();
            assert_eq!(
                (a.memory_bytes, a.snapshot_every_bytes),
                (bytes, bytes),
                "{text}"
            );
        }
        let a = Args::try_parse_from(["x", "--max-message-bytes", "16M"]).unwrap();
        assert_eq!(a.max_message_bytes, 16 << 20);
        for bad in ["lots", "-1", "12Q"] {
            assert!(
                Args::try_parse_from(["x", "--memory-bytes", bad]).is_err(),
                "{bad}"
            );
        }
    }
}
