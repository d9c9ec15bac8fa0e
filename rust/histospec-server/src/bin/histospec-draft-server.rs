//! `histospec-draft-server`: the draft server as a program, with the flags of
//! `histospec-sgl draft-server` (one definition: `histospec_server::cli`;
//! `cargo install --path rust/histospec-server`).
//!
//! Trainers and engines publish finished rollouts; engines follow the groups they draft for, or
//! mirror every record (`proto/histospec/v1/history.proto`). Prints `histospec draft-server listening
//! on HOST:PORT` on stdout once it accepts connections; stops gracefully on SIGTERM/SIGINT (drain,
//! final snapshot). Exit status: 0 after a graceful stop, 1 when it cannot start, 2 for bad flags.

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(histospec_server::cli::run(std::env::args_os()))
}
