//! A minimal client of the draft server: publishes one finished response, reads it back from a
//! subscription, and prints the server's counters.
//!
//! ```text
//! histospec-draft-server --listen 127.0.0.1:50061 &
//! cargo run -p histospec-server --example client -- 127.0.0.1:50061
//! ```
//! Pass a bearer token as the second argument when the server has `--auth-token-file`.
#![allow(clippy::print_stdout)] // a command-line example: it prints what it got

use histospec_server::proto::history_service_client::HistoryServiceClient;
use histospec_server::proto::{PublishRequest, Record, StatsRequest, SubscribeRequest};
use tonic::metadata::MetadataValue;
use tonic::Request;

fn with_token<T>(msg: T, token: Option<&str>) -> Result<Request<T>, Box<dyn std::error::Error>> {
    let mut req = Request::new(msg);
    if let Some(t) = token {
        let value: MetadataValue<_> = format!("Bearer {t}").parse()?;
        req.metadata_mut().insert("authorization", value);
    }
    Ok(req)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut argv = std::env::args().skip(1);
    let address = argv.next().unwrap_or_else(|| "127.0.0.1:50061".into());
    let token = argv.next();
    let token = token.as_deref();
    let mut client = HistoryServiceClient::connect(format!("http://{address}")).await?;

    // One finished response of a prompt; the record id makes a resend idempotent.
    let record = Record {
        record_id: b"example:0".to_vec(),
        prompt_ids: vec![101, 102, 103],
        response_ids: vec![7, 8, 9, 10],
        version: 1,
        ..Default::default()
    };
    let reply = client
        .publish(with_token(
            PublishRequest {
                records: vec![record],
            },
            token,
        )?)
        .await?
        .into_inner();
    println!(
        "published: sequences {:?}, accepted {}, duplicates {}, durable {}",
        reply.sequences, reply.accepted, reply.duplicates, reply.durable
    );

    // Every record from the start, in the server's order (a replica applies them to its index).
    let mut stream = client
        .subscribe(with_token(SubscribeRequest { from_sequence: 0 }, token)?)
        .await?
        .into_inner();
    if let Some(batch) = stream.message().await? {
        for r in &batch.records {
            println!(
                "record {}: group {:?}, {} prompt + {} response tokens",
                r.sequence,
                r.group_key,
                r.prompt_ids.len(),
                r.response_ids.len()
            );
        }
    }

    let stats = client
        .stats(with_token(StatsRequest {}, token)?)
        .await?
        .into_inner();
    println!(
        "server: {} records, {} tokens, {} groups, head sequence {}",
        stats.records, stats.tokens, stats.groups, stats.head_sequence
    );
    Ok(())
}
