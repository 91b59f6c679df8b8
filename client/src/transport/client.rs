//! The client loop: one device's life across its connections, the session's actions carried
//! out, the server's messages, trainings and uploads handed to the session.

mod act;
mod connect;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anchorage_shared::MetricKey;
use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::write_frame;
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Capabilities, Goodbye, Heartbeat, Message};
use anchorage_shared::rng::Rng;
use anyhow::Context;
use tokio::sync::mpsc;

use super::backoff::{Failures, human, sleep_or_stop, stopped};
use super::device_state::restore_device_state;
use super::refusal::{RefusalKind, Refused, definite_refusal, tls_error, tls_failure};
use super::streams::{Inbound, accept_broadcasts, read_control};
use super::{ClientEvent, ClientOptions, DeviceEndpoint};
use crate::eligibility::Readings;
use crate::methods::{ClientMethod, Trained};
use crate::session::{Session, UploadMeasure};

/// Runs the client until the server says goodbye (returns the reason) or refuses it for good
/// (the error is a [`Refused`]: `anchorage-client` exits with [`EXIT_REFUSED`](crate::transport::EXIT_REFUSED)). Failures a retry
/// may clear (no answer, a reset, a connection closed before the welcome) back off and retry.
pub async fn run(
    options: ClientOptions,
    method: Box<dyn ClientMethod>,
    events: Option<mpsc::UnboundedSender<ClientEvent>>,
) -> anyhow::Result<String> {
    let (trained_tx, mut trained) = mpsc::unbounded_channel();
    let (uploaded_tx, mut uploaded) = mpsc::unbounded_channel();
    let mut stop = options.stop.clone();
    let mut client = Client::new(options, method, events, trained_tx, uploaded_tx)?;
    loop {
        let (conn, control, control_recv) = match client.connect(&mut stop).await? {
            Connected::Up(conn, control, control_recv) => (conn, control, control_recv),
            Connected::Stopped => return Ok(client.stopped_unconnected()),
            Connected::Refused(refused) => return Err(client.refused(refused)),
        };
        let ended = client.serve(conn, control, control_recv, &mut stop, &mut trained, &mut uploaded).await?;
        client.options.metrics.disconnected(matches!(ended, Ended::Lost(_)));
        let reason = match ended {
            Ended::Exit(reason) => return Ok(reason),
            Ended::Refused(refused) => return Err(client.refused(refused)),
            Ended::Home => {
                client.session.disconnected();
                client.options.go_home();
                continue;
            }
            Ended::Lost(reason) => reason,
        };
        client.session.disconnected();
        client.options.fail_over();
        client.emit(ClientEvent::Disconnected { reason: reason.clone() });
        // A connection the server welcomed reset the count, so the first retry comes after the
        // initial delay; one that ended before its welcome (the server closed it at once) backs
        // off further, like a failed attempt.
        let attempt = client.failures.failed();
        let delay = client.options.backoff.delay(attempt, &mut client.rng);
        tracing::info!(
            client = %client.options.client_id,
            %reason,
            attempt,
            delay_s = delay.as_secs_f64(),
            "disconnected (transient); reconnecting in {}",
            human(delay)
        );
        if sleep_or_stop(delay, &mut stop).await {
            return Ok(client.stopped_unconnected());
        }
    }
}

/// A round's one line in the client's log, once its cost record is complete: e.g. `round 7:
/// trained 1.2 s on 750 samples, local accuracy 84.1%, uploaded 1.02 MiB in 0.3 s, acked`.
/// `trained`: the samples and local accuracy (a fraction) of an update trained in this process
/// (`None`: a saved update was resent).
fn round_line(r: &CostRecord, trained: Option<(u64, Option<f64>)>) -> String {
    let trained = match trained {
        Some((samples, accuracy)) => {
            let accuracy = accuracy.map_or_else(String::new, |a| format!(", local accuracy {:.1}%", a * 100.0));
            format!("trained {:.1} s on {samples} samples{accuracy}", r.compute_seconds)
        }
        None => "resent the saved update".to_string(),
    };
    let mib = r.wire_up as f64 / f64::from(1u32 << 20);
    let acked = if r.straggler { "acked late (after the round closed; not aggregated)" } else { "acked" };
    format!("round {}: {trained}, uploaded {mib:.2} MiB in {:.1} s, {acked}", r.round, r.transfer_seconds)
}

/// What [`Client::connect`] came to.
enum Connected {
    /// A connection and its control stream.
    Up(quinn::Connection, quinn::SendStream, quinn::RecvStream),
    /// The stop signal came first.
    Stopped,
    /// The server refused this device for good.
    Refused(Refused),
}

/// A trained round's result, the device's compute time and what it read of itself right after
/// (the condition its cost record carries), from the training thread.
pub(super) type TrainingDone = (u64, Result<(Trained, Duration, Option<Readings>), String>);
/// An upload's round and what it took, from its task.
pub(super) type Uploaded = (u64, UploadMeasure);

/// How a connection ended: lost (reconnect), closed to go back to the device's own address
/// from a fallback, the client's exit with its reason, or the server's refusal for good.
enum Ended {
    Lost(String),
    Home,
    Exit(String),
    Refused(Refused),
}

/// One client's life across its connections: the session, the method, and where trainings and
/// uploads report back.
pub(super) struct Client {
    options: ClientOptions,
    session: Session,
    /// The session's clock: times passed to it are since this instant.
    epoch: Instant,
    method: Arc<Mutex<Box<dyn ClientMethod>>>,
    endpoint: DeviceEndpoint,
    rng: Rng,
    trained: mpsc::UnboundedSender<TrainingDone>,
    uploaded: mpsc::UnboundedSender<Uploaded>,
    /// Rounds trained in this process, for their log line: the samples and the local accuracy.
    trained_here: HashMap<u64, (u64, Option<f64>)>,
    /// The upload task of each round on the current connection: the session asks to resend a
    /// pending update after a reconnect and again when the round's broadcast comes back, and a
    /// second transfer of the same update while the first is still going would send it twice.
    uploading: HashMap<u64, tokio::task::AbortHandle>,
    /// The part of a broadcast that a lost connection left, for the next one to resume.
    held_broadcast: Arc<Mutex<crate::broadcasts::HeldBroadcast>>,
    failures: Failures,
    events: Option<mpsc::UnboundedSender<ClientEvent>>,
}

impl Client {
    /// The session from the store's unacknowledged update and the method's saved device state.
    pub(super) fn new(
        options: ClientOptions,
        mut method: Box<dyn ClientMethod>,
        events: Option<mpsc::UnboundedSender<ClientEvent>>,
        trained: mpsc::UnboundedSender<TrainingDone>,
        uploaded: mpsc::UnboundedSender<Uploaded>,
    ) -> anyhow::Result<Self> {
        let capabilities = Capabilities {
            backend: options.backend.clone(),
            memory_mb: options.memory_mb,
            methods: [method.name()].iter().filter_map(|m| heapless::String::try_from(*m).ok()).collect(),
        };
        // A corrupt file is set aside by the store and reads as none: not resent, no crash loop.
        let pending = match &options.store {
            Some(store) => store.load_pending().context("loading the unacknowledged update")?,
            None => None,
        };
        if let Some(store) = &options.store {
            restore_device_state(store, method.as_mut(), &options.client_id)?;
        }
        let mut session =
            Session::new(options.client_id.clone(), capabilities, method.num_samples(), pending).reporting_costs();
        if options.secure_aggregation {
            let mut entropy = [0u8; 32];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut entropy)
                .map_err(|_| anyhow::anyhow!("the operating system gave no entropy for secure aggregation"))?;
            session = session.with_secure_aggregation(entropy);
        }
        Ok(Self {
            endpoint: DeviceEndpoint::new(&options)?,
            rng: Rng::derive(options.seed, 0xBAC0FF),
            options,
            session,
            epoch: Instant::now(),
            method: Arc::new(Mutex::new(method)),
            trained,
            uploaded,
            trained_here: HashMap::new(),
            uploading: HashMap::new(),
            held_broadcast: Arc::default(),
            failures: Failures::default(),
            events,
        })
    }

    /// Now on the session's clock.
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn emit(&self, e: ClientEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(e);
        }
    }

    /// The server refused this device for good: the events hear that it finished, the endpoint
    /// closes, and the refusal becomes the client's error.
    fn refused(&self, refused: Refused) -> anyhow::Error {
        self.endpoint.close(b"refused");
        self.emit(ClientEvent::Finished { reason: format!("refused: {:?}: {}", refused.kind, refused.detail) });
        anyhow::Error::new(refused)
    }

    fn refusal(&self, kind: RefusalKind, detail: String) -> Refused {
        Refused { client: self.options.client_id.clone(), server: self.options.server, kind, detail }
    }

    /// Leaving on the stop signal with no connection to say goodbye on.
    fn stopped_unconnected(&self) -> String {
        self.endpoint.close(b"stopping");
        tracing::info!(client = %self.options.client_id, "stopped while not connected");
        self.emit(ClientEvent::Finished { reason: "stopped".into() });
        "stopped".to_string()
    }

    /// One connection: the session's actions out, the server's messages, trainings and uploads
    /// in, heartbeats, until the connection ends.
    async fn serve(
        &mut self,
        conn: quinn::Connection,
        mut control: quinn::SendStream,
        control_recv: quinn::RecvStream,
        stop: &mut Option<tokio::sync::watch::Receiver<bool>>,
        trained: &mut mpsc::UnboundedReceiver<TrainingDone>,
        uploaded: &mut mpsc::UnboundedReceiver<Uploaded>,
    ) -> anyhow::Result<Ended> {
        let max_frame = self.options.max_frame_bytes;
        let (in_tx, mut inbound) = mpsc::unbounded_channel();
        // Tasks of this connection die with it (and with this future, if it is aborted).
        let mut tasks = tokio::task::JoinSet::new();
        let mark = self.read(&conn, control_recv, in_tx, &mut tasks);
        self.uploading.clear();
        self.session.connected();
        let mut heartbeat = tokio::time::interval(self.options.keep_alive);
        let mut seq = 0u64;
        let ended = 'conn: loop {
            while let Some(action) = self.session.poll_action() {
                if let Some(ended) = self.act(action, &conn, &mut control, &mut tasks).await? {
                    break 'conn ended;
                }
            }
            if self.options.due_home() && self.session.at_rest() {
                conn.close(quinn::VarInt::from_u32(0), b"back to its own server");
                break 'conn Ended::Home;
            }
            tokio::select! {
                message = inbound.recv() => match message {
                    Some(Inbound::Message { msg, wire_bytes }) => self.on_message(msg, wire_bytes),
                    Some(Inbound::Closed(reason)) => break 'conn Ended::Lost(reason),
                    None => break 'conn Ended::Lost("connection readers ended".into()),
                },
                Some((round, result)) = trained.recv() => self.on_trained(round, result),
                Some((round, measure)) = uploaded.recv() => self.session.uploaded(self.now(), round, measure),
                _ = heartbeat.tick() => {
                    seq += 1;
                    let frame = encode_frame(&Message::Heartbeat(Heartbeat { seq }), max_frame)?;
                    if let Err(e) = write_frame(&mut control, &frame).await {
                        break 'conn Ended::Lost(format!("control stream: {e}"));
                    }
                }
                reason = conn.closed() => {
                    if tls_failure(&reason) && definite_refusal(&reason).is_none() {
                        tls_error(&self.options, &reason);
                    }
                    break 'conn Ended::Lost(reason.to_string())
                }
                _ = stopped(stop) => {
                    let frame = encode_frame(&Message::Goodbye(Goodbye { reason: "client stopping".into() }), max_frame)?;
                    let _ = write_frame(&mut control, &frame).await;
                    let _ = control.finish();
                    conn.close(quinn::VarInt::from_u32(0), b"stopping");
                    self.endpoint.wait_idle(Duration::from_secs(2)).await;
                    self.emit(ClientEvent::Finished { reason: "stopped".into() });
                    break 'conn Ended::Exit("stopped".into());
                }
            }
        };
        tasks.abort_all();
        self.held_broadcast.lock().unwrap_or_else(|p| p.into_inner()).connection_lost(mark.since(&conn));
        // However the loss showed first (a failed read or write, or the close itself), a close
        // with the server's TLS alert about this device's certificate is a refusal for good: the
        // server accepts the handshake's last flight only after checking the certificate.
        if let Ended::Lost(_) = &ended
            && let Some((kind, detail)) = conn.close_reason().as_ref().and_then(definite_refusal)
        {
            return Ok(Ended::Refused(self.refusal(kind, detail)));
        }
        Ok(ended)
    }

    /// A training's result, from its thread: kept for the round's log line, and handed to the
    /// session with what the device read of itself right after (the round's cost record carries it).
    fn on_trained(&mut self, round: u64, result: Result<(Trained, Duration, Option<Readings>), String>) {
        match result {
            Ok((trained, compute, readings)) => {
                self.options.metrics.trained();
                let accuracy = trained.metrics.iter().find(|m| m.key() == MetricKey::LocalAccuracy).map(|m| m.value);
                self.trained_here.insert(round, (trained.num_samples, accuracy));
                if let Some(readings) = readings {
                    self.options.metrics.readings_refused(readings.errors.len());
                    self.session.condition(round, &readings);
                }
                self.session.trained(round, trained, compute);
            }
            Err(e) => {
                self.options.metrics.training_failed();
                self.session.training_failed(round, &e);
            }
        }
    }

    /// Starts the readers of a connection, in `tasks`: its control stream, its broadcasts on uni
    /// streams, and its broadcast transfers when the device takes them. Returns the mark the
    /// broadcasts' wire bytes are counted from: when the connection ends, what it received since
    /// counts toward the broadcast it leaves held, if any.
    fn read(
        &self,
        conn: &quinn::Connection,
        control_recv: quinn::RecvStream,
        tx: mpsc::UnboundedSender<Inbound>,
        tasks: &mut tokio::task::JoinSet<()>,
    ) -> crate::broadcasts::WireMark {
        let (max_frame, mark) = (self.options.max_frame_bytes, crate::broadcasts::WireMark::new(conn));
        tasks.spawn(read_control(control_recv, tx.clone(), max_frame));
        let metrics = self.options.metrics.clone();
        if self.options.resume_broadcasts {
            let (held, priorities) = (self.held_broadcast.clone(), self.options.stream_priorities);
            let (conn, mark, metrics) = (conn.clone(), mark.clone(), metrics.clone());
            let receiver = crate::broadcasts::Receiver { conn, held, mark, max_frame, priorities, metrics };
            tasks.spawn(receiver.accept(tx.clone()));
        }
        tasks.spawn(accept_broadcasts(conn.clone(), tx, max_frame, mark.clone(), metrics));
        mark
    }

    /// A message from the server, `wire_bytes` on the wire: told to the events; then the session
    /// handles it (a broadcast opens its round's cost record, an ack may complete it, a welcome
    /// sends the unconfirmed records again).
    fn on_message(&mut self, msg: Message, wire_bytes: u64) {
        match &msg {
            Message::Broadcast(b) => {
                self.options.metrics.broadcast(b.round);
                self.emit(ClientEvent::RoundStarted { round: b.round });
            }
            Message::Ack(ack) => self.emit(ClientEvent::Acked { round: ack.round, aggregated: ack.aggregated }),
            // The server took this device: the backoff starts again from its initial delay.
            Message::Welcome(_) => self.failures.connected(),
            _ => {}
        }
        if let Err(e) = self.session.handle_message(self.now(), msg, wire_bytes) {
            if let crate::session::SessionError::SecAgg { reason, .. } = &e {
                self.options.metrics.secagg_refused(reason);
            }
            tracing::warn!(client = %self.options.client_id, error = %e, "ignored a message");
        }
    }

    /// A round's cost record, complete: counted, logged and told to the events (the session
    /// sends it to the server's ledger next).
    fn report(&mut self, record: CostRecord) {
        let (round, aggregated) = (record.round, !record.straggler);
        self.options.metrics.recorded(&record);
        let line = round_line(&record, self.trained_here.remove(&round));
        tracing::info!(client = %self.options.client_id, round, aggregated, "{line}");
        self.emit(ClientEvent::RoundDone { cost: record, aggregated });
    }
}
