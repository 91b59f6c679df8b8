//! Helpers shared by the cross-crate integration tests in `tests/`: raw QUIC peers that speak
//! (or mangle) the protocol, to test the server the way a hostile or broken client would; and
//! the real data folder with the FedTA scenario's data table, for the tests that need them; and
//! the small FedAvg device that the restart and crash tests run.

pub mod process;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::frame::{DEFAULT_MAX_FRAME, encode_frame};
use anchorage_shared::io::{read_frame, write_frame};
use anchorage_shared::protocol::{Capabilities, Hello, Message};
use quinn::crypto::rustls::QuicClientConfig;
use rustls::pki_types::CertificateDer;

/// A bare QUIC connection to the server, trusting its pinned certificate.
pub async fn raw_connect(
    server: SocketAddr,
    cert: &CertificateDer<'static>,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    raw_connect_as(server, cert, None).await
}

/// A bare QUIC connection that trusts `root` and shows `client_cert` (mutual TLS) if given.
pub async fn raw_connect_as(
    server: SocketAddr,
    root: &CertificateDer<'static>,
    client_cert: Option<&anchorage_client::transport::ClientCert>,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    let crypto = anchorage_client::transport::client_crypto(root, client_cert)?;
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(crypto)?)));
    let conn = endpoint.connect(server, "localhost")?.await?;
    Ok((endpoint, conn))
}

/// A well-formed hello for `client_id` running FedAvg.
pub fn hello(client_id: &str) -> Message {
    Message::Hello(Box::new(Hello {
        client_id: client_id.into(),
        capabilities: Capabilities {
            backend: "test".into(),
            memory_mb: 64,
            methods: [heapless::String::try_from("fedavg").unwrap()].into_iter().collect(),
        },
        num_samples: 10,
        last_round: None,
    }))
}

/// Writes `bytes` on a fresh control stream and returns the first message the server answers
/// with (a refusal, for bad input), or `None` if the stream ended without one.
pub async fn send_raw_and_read_reply(conn: &quinn::Connection, bytes: &[u8]) -> anyhow::Result<Option<Message>> {
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(bytes).await?;
    let reply = tokio::time::timeout(Duration::from_secs(10), read_frame(&mut recv, DEFAULT_MAX_FRAME)).await??;
    Ok(reply.map(|(m, _)| m))
}

/// Encodes one message as a frame.
pub fn frame(msg: &Message) -> Vec<u8> {
    encode_frame(msg, DEFAULT_MAX_FRAME).expect("test frames fit")
}

/// Writes a frame on a stream.
pub async fn write(send: &mut quinn::SendStream, msg: &Message) -> anyhow::Result<()> {
    write_frame(send, &frame(msg)).await?;
    Ok(())
}

/// The real data folder (`$ANCHORAGE_DATA`), or `None` after a loud SKIPPED line.
pub fn data_dir() -> Option<std::path::PathBuf> {
    match std::env::var_os("ANCHORAGE_DATA") {
        Some(d) => Some(std::path::PathBuf::from(d)),
        None => {
            anchorage_shared::skip::skipped(
                "a real-data check: ANCHORAGE_DATA not set (ANCHORAGE_DATA=../shared/data)",
            );
            None
        }
    }
}

/// `scenarios/fedta_tiny_imagenet.toml`'s `[data]` table at data scale 0.05 with one surrogate
/// image per class, under `prefix` (`sikf.data` in server.toml, `data.spec` in client.toml).
pub fn fedta_data_table(prefix: &str) -> String {
    let scenario =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/fedta_tiny_imagenet.toml")).unwrap();
    scenario[scenario.find("[data]").unwrap()..]
        .replace("[data]", &format!("[{prefix}]"))
        .replace("[data.partition]", &format!("[{prefix}.partition]"))
        .replace("scale = 1.0", "scale = 0.05")
        .replace("surrogate_per_class = 20", "surrogate_per_class = 1")
}

/// A FedAvg device on its own seeded share of the embedded synthetic set (30 training and 10
/// test images per class): small enough that a round takes a fraction of a second.
pub fn fedavg_client(index: u64) -> anchorage_client::methods::FedAvgClient {
    use anchorage_client::methods::{FedAvgClient, MethodContext};
    use anchorage_data::{SyntheticConfig, synthetic};
    let (train, test) = synthetic::generate(&SyntheticConfig {
        train_per_class: 30,
        test_per_class: 10,
        seed: 3 + index,
        ..Default::default()
    });
    let context = MethodContext::embedded(
        &train,
        &test,
        burn::tensor::Device::flex().autodiff(),
        anchorage_model::train::OptimizerKind::Adam,
        anchorage_shared::tensor::Encoding::F32,
        index,
    );
    FedAvgClient::new(context, &anchorage_shared::method::MethodConfig::default()).expect("fedavg is a baseline")
}

/// Says hello on a new control stream and waits for the welcome; returns the stream.
pub async fn join(conn: &quinn::Connection, id: &str) -> (quinn::SendStream, quinn::RecvStream) {
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    write(&mut send, &hello(id)).await.unwrap();
    let (welcome, _) = read_frame(&mut recv, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
    assert!(matches!(welcome, Message::Welcome(_)), "{welcome:?}");
    (send, recv)
}

/// The value of one series (name and labels, as printed) in a Prometheus text exposition.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
