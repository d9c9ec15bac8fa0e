//! Compiles `proto/histospec/v1/history.proto` with protox (a protobuf compiler in Rust), so that no
//! system `protoc` is needed to build the wheel.
//!
//! Two outputs: the messages and the client (`proto`, what every reader of the wire uses), and the
//! server trait (`proto_server`), whose streamed responses are `crate::wire`'s pre-encoded twins of
//! `SubscribeResponse` and `SnapshotChunk` (the same bytes on the wire: each record is encoded once
//! when it is stored, not once per subscriber).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("histospec/v1/history.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds.clone())?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("server");
    std::fs::create_dir_all(&out)?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .out_dir(&out)
        .extern_path(".histospec.v1", "crate::proto")
        .extern_path(
            ".histospec.v1.SubscribeResponse",
            "crate::wire::EncodedSubscribeResponse",
        )
        .extern_path(
            ".histospec.v1.SnapshotChunk",
            "crate::wire::EncodedSnapshotChunk",
        )
        .extern_path(
            ".histospec.v1.FollowResponse",
            "crate::wire::EncodedFollowResponse",
        )
        .compile_fds(fds)?;
    Ok(())
}
