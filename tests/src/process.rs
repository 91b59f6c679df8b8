//! The server program as a process the tests can `kill -9`: a project CA, the server's
//! certificate, a server.toml, and the process running on them (the tests package builds
//! `server/src/main.rs` as its `server-process` binary).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anchorage_client::methods::ClientMethod;
use anchorage_pki::{Kind, ProjectCa};
use rustls::pki_types::CertificateDer;

/// How a server process ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Ending {
    Kill,
    Term,
}

/// One server's state folder and config, and the process now running on it.
pub struct ServerProcess {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub addr: SocketAddr,
    /// The project CA's certificate, which the devices trust.
    pub cert: CertificateDer<'static>,
    pub ca: ProjectCa,
    pub log: PathBuf,
    pub child: Option<Child>,
    bin: PathBuf,
}

impl ServerProcess {
    /// A project CA, the server's certificate from it, and a server.toml in `dir` for the server
    /// program `bin` (the tests' `server-process`), waiting for `devices` before a round opens.
    pub fn new(dir: &Path, bin: &Path, devices: usize) -> Self {
        let addr = free_udp_port();
        // The field set-up: a project CA, the server's certificate from it, mutual TLS.
        let tls_dir = dir.join("tls");
        let mut ca = ProjectCa::init(&dir.join("ca"), "crash-test", 30).unwrap();
        let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
        anchorage_pki::save_identity(&tls_dir, &identity).unwrap();
        std::fs::write(tls_dir.join(anchorage_pki::CA_CERT), ca.cert().as_ref()).unwrap();
        // The CA's revocation list: a CA-mode server does not start without it.
        std::fs::write(tls_dir.join(anchorage_pki::CRL), ca.crl().unwrap().as_ref()).unwrap();
        // The operator's initial model: the devices' own (the tests' FedAvg device).
        let model = dir.join("initial-model.bin");
        let blocks = crate::fedavg_client(0).initial_blocks().expect("the device's model");
        anchorage_server::model_file::save(&model, &blocks).unwrap();
        let config = dir.join("server.toml");
        std::fs::write(
            &config,
            format!(
                r#"
bind = "{addr}"
method = "fedavg"
state_dir = "{state}"
tls_dir = "{tls}"
initial_model = "{model}"

[engine]
rounds = 0
min_available = {devices}
min_fit = {devices}
fraction = 1.0
over_selection = 0.0
round_deadline = 60000

[engine.round]
local_epochs = 1
batch_size = 32
learning_rate = 0.001
deadline_ms = 0
"#,
                state = dir.join("state").display(),
                tls = tls_dir.display(),
                model = model.display(),
            ),
        )
        .unwrap();
        let cert = ca.cert().clone();
        Self { dir: dir.into(), config, addr, cert, ca, log: dir.join("server.log"), child: None, bin: bin.into() }
    }

    /// Turns on the metrics port (`metrics_bind` in server.toml) on a free loopback port, for a
    /// process not yet spawned; returns its address.
    pub fn with_metrics(&mut self) -> SocketAddr {
        let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let text = std::fs::read_to_string(&self.config).unwrap();
        std::fs::write(&self.config, format!("metrics_bind = \"{addr}\"\n{text}")).unwrap();
        addr
    }

    /// The server's copy of the revocation list (`tls_dir/revoked.crl`).
    pub fn crl(&self) -> PathBuf {
        self.dir.join("tls").join(anchorage_pki::CRL)
    }

    /// Appends `text` (a TOML table, e.g. `[metrics]\ndevice_ids = true`) to server.toml.
    pub fn append_config(&self, text: &str) {
        let old = std::fs::read_to_string(&self.config).unwrap();
        std::fs::write(&self.config, format!("{old}\n{text}\n")).unwrap();
    }

    pub fn db(&self) -> PathBuf {
        self.dir.join("state").join(anchorage_server::store::DB_FILE)
    }

    pub fn spawn(&mut self) {
        assert!(self.child.is_none());
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(&self.bin)
            .arg("--config")
            .arg(&self.config)
            .env("ANCHORAGE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("the server process starts");
        self.child = Some(child);
    }

    /// Ends the process the given way and waits for it; returns its exit status.
    pub fn stop(&mut self, how: Ending) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("a running server");
        match how {
            Ending::Kill => child.kill().unwrap(),
            Ending::Term => {
                let ok = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap().success();
                assert!(ok, "kill -TERM");
                // A graceful stop that hangs is a bug; bound it, then kill.
                let deadline = Instant::now() + Duration::from_secs(15);
                while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        let _ = child.kill();
        child.wait().unwrap()
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `GET path` on a loopback HTTP port (the server's metrics port): the status code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    Ok((status, body))
}

/// A UDP port on loopback that was free a moment ago.
pub fn free_udp_port() -> SocketAddr {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.local_addr().unwrap()
}

impl ServerProcess {
    /// Waits until the server logs that it listens (bounded).
    pub fn wait_listening(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if std::fs::read_to_string(&self.log).unwrap_or_default().contains("listening") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Resident memory of the running server, from /proc.
    /// The server's resident memory split as /proc reports it: anonymous (heaps, stacks) and
    /// file-backed (the program's own pages as it runs them).
    pub fn rss_parts(&self) -> String {
        let Some(pid) = self.child.as_ref().map(|c| c.id()) else { return String::new() };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status.lines().filter(|l| l.starts_with("RssAnon:") || l.starts_with("RssFile:")).collect::<Vec<_>>().join(", ")
    }

    /// Where the server's resident memory lives, from /proc/PID/smaps: the `n` largest mappings
    /// (kB resident, kB size, the file or `[anon]`), and the threads. For tracing what stays
    /// resident after a fleet has left.
    pub fn largest_mappings(&self, n: usize) -> String {
        let Some(pid) = self.child.as_ref().map(|c| c.id()) else { return String::new() };
        let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
        // (kB resident, the mapping's header line) for each mapping.
        let mut maps: Vec<(u64, &str)> = Vec::new();
        let mut header = "";
        for line in smaps.lines() {
            if let Some(kb) = line.strip_prefix("Rss:") {
                maps.push((kb.trim().trim_end_matches("kB").trim().parse().unwrap_or(0), header));
            } else if !line.split_whitespace().next().unwrap_or(":").ends_with(':') {
                header = line;
            }
        }
        maps.sort_by_key(|m| std::cmp::Reverse(m.0));
        let describe = |header: &str| {
            let mut words = header.split_whitespace();
            let size = words.next().and_then(|r| r.split_once('-')).map_or(0, |(a, b)| {
                u64::from_str_radix(b, 16).unwrap_or(0).saturating_sub(u64::from_str_radix(a, 16).unwrap_or(0)) / 1024
            });
            format!("{size} kB {}", words.nth(4).unwrap_or("[anon]"))
        };
        let top: Vec<String> = maps.iter().take(n).map(|(rss, h)| format!("{rss} kB of {}", describe(h))).collect();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let threads = status.lines().find(|l| l.starts_with("Threads:")).unwrap_or("");
        format!("{threads}; {} mappings; largest: {}", maps.len(), top.join("; "))
    }

    pub fn rss_bytes(&self) -> Option<u64> {
        let pid = self.child.as_ref()?.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    }
}

/// A raw device connection held open: its endpoint, connection and control stream.
pub type Peer = (quinn::Endpoint, quinn::Connection, (quinn::SendStream, quinn::RecvStream));

impl ServerProcess {
    /// `n` devices with their own certificates (ids `prefix-0000`, …) connect and say hello.
    pub async fn connect_peers(&mut self, prefix: &str, n: usize) -> Vec<Peer> {
        // Every certificate first, then the connections (the tests beside this one in a binary
        // read the process's memory early on: 1,000 connections should not be opening then).
        // From a copy of the CA without its folder: the folder's CA rewrites its whole index and
        // CRL at each issue, which would take most of a 10,000-device run's time.
        let mut ca = ProjectCa::open(&self.dir.join("ca")).unwrap().detached();
        let certs: Vec<(String, anchorage_client::transport::ClientCert)> = (0..n)
            .map(|i| {
                let id = format!("{prefix}-{i:04}");
                let identity = ca.issue(Kind::Client, &id, &[], 30).unwrap();
                (id, anchorage_client::transport::ClientCert { chain: vec![identity.cert], key: identity.key })
            })
            .collect();
        let mut peers = Vec::with_capacity(n);
        for (id, cert) in &certs {
            let (endpoint, conn) = crate::raw_connect_as(self.addr, &self.cert, Some(cert)).await.unwrap();
            let control = crate::join(&conn, id).await;
            peers.push((endpoint, conn, control));
        }
        peers
    }
}

/// Closes every peer's connection and endpoint and waits (5 s at most each) until they are idle.
pub async fn close_peers(peers: Vec<Peer>) {
    for (endpoint, conn, _) in &peers {
        conn.close(0u32.into(), b"bye");
        endpoint.close(0u32.into(), b"bye");
    }
    for (endpoint, _, _) in &peers {
        let _ = tokio::time::timeout(Duration::from_secs(5), endpoint.wait_idle()).await;
    }
}
