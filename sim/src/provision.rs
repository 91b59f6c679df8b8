//! `anchorage ca …` and `anchorage provision project.toml`: the project CA's chores and one
//! ready folder per site.
//!
//! A site folder holds the site's certificate (`cert.der`), its private key (`key.der`, mode
//! 0600), the project CA's certificate (`ca.der`) and a complete config (`server.toml` or
//! `client.toml`) whose paths are relative to the folder itself, so the folder works wherever
//! it is copied. Provisioning again keeps the CA and every site's key and certificate (a key is
//! never made again silently), rewrites the configs from `project.toml`, and adds the devices
//! that are new.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anchorage_client::config::ClientConfig;
use anchorage_server::ca::{self, Issued, Kind, ProjectCa};
use anchorage_server::config::ServerConfig;
use anchorage_server::tls::{self, Identity};
use anyhow::Context;
use serde::Deserialize;

/// Validity of a new CA, in days.
pub const DEFAULT_CA_DAYS: u32 = 3650;
/// Validity of a site's certificate, in days.
pub const DEFAULT_DAYS: u32 = 365;
/// The server's id (its certificate's first name) unless `project.toml` names another.
pub const DEFAULT_SERVER_ID: &str = "server";

fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// `YYYY-MM-DD` (UTC) of a unix time.
pub fn date(unix: i64) -> String {
    // Days to civil date (Howard Hinnant's algorithm).
    let z = unix.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

// ---------------------------------------------------------------------------------------------
// `anchorage ca …`
// ---------------------------------------------------------------------------------------------

/// Writes `identity` and the CA's certificate into the site folder `out`: `cert.der`, `key.der`
/// (mode 0600) and `ca.der`.
pub fn write_site_identity(out: &Path, identity: &Identity, ca_cert: &[u8]) -> anyhow::Result<()> {
    tls::save_identity(out, identity)?;
    let path = out.join(ca::CA_CERT);
    std::fs::write(&path, ca_cert).with_context(|| format!("writing {}", path.display()))
}

/// `anchorage ca issue`: signs a certificate for `id` and writes it, its key and `ca.der` into
/// `out`. Refuses a folder that already holds a key or certificate (`renew` replaces them).
pub fn issue(
    ca: &mut ProjectCa,
    kind: Kind,
    id: &str,
    names: &[String],
    days: u32,
    out: &Path,
) -> anyhow::Result<Issued> {
    for file in [tls::CERT_FILE, tls::KEY_FILE] {
        anyhow::ensure!(
            !out.join(file).exists(),
            "{} already exists: `anchorage ca renew {id}` replaces a site's certificate and key on purpose",
            out.join(file).display()
        );
    }
    let identity = ca.issue(kind, id, names, days)?;
    write_site_identity(out, &identity, ca.cert().as_ref())?;
    if kind == Kind::Server {
        write_server_crl(ca, out)?;
    }
    Ok(ca.issued().last().cloned().expect("just issued"))
}

/// A server's folder gets the CA's revocation list as it is now (even an empty one): a CA-mode
/// server does not start without it.
fn write_server_crl(ca: &ProjectCa, out: &Path) -> anyhow::Result<()> {
    let path = out.join(ca::CRL);
    anchorage_shared::io::write_atomic(&path, ca.crl()?.as_ref()).with_context(|| format!("writing {}", path.display()))
}

/// `anchorage ca renew`: a new certificate and key for an id the CA issued before (same kind),
/// valid for `days` from now, written into `out` over the old pair. A server's DNS names are
/// `names`, or when none are given those of the certificate now in `out`. The old certificate
/// stays valid until it expires (revoke it to end it sooner).
pub fn renew(ca: &mut ProjectCa, id: &str, names: &[String], days: u32, out: &Path) -> anyhow::Result<Issued> {
    let previous = ca
        .issued()
        .iter()
        .rev()
        .find(|i| i.id == id)
        .cloned()
        .with_context(|| format!("the CA never issued a certificate to `{id}` (see `anchorage ca list`)"))?;
    let names = if names.is_empty() {
        match std::fs::read(out.join(tls::CERT_FILE)) {
            Ok(der) => cert_names(&der)?.into_iter().filter(|n| n != id).collect(),
            Err(_) => Vec::new(),
        }
    } else {
        names.to_vec()
    };
    let identity = ca.issue(previous.kind, id, &names, days)?;
    write_site_identity(out, &identity, ca.cert().as_ref())?;
    if previous.kind == Kind::Server {
        write_server_crl(ca, out)?;
    }
    Ok(ca.issued().last().cloned().expect("just issued"))
}

/// The DNS names and IP addresses a certificate is issued for.
pub fn cert_names(der: &[u8]) -> anyhow::Result<Vec<String>> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der).context("the certificate does not parse")?;
    let Some(san) = cert.subject_alternative_name().context("the certificate's names")? else {
        return Ok(Vec::new());
    };
    Ok(san
        .value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(s) => Some(s.to_string()),
            GeneralName::IPAddress(b) => match b.len() {
                4 => Some(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).ok()?).to_string()),
                16 => Some(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).ok()?).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect())
}

/// Whether the certificate `der` was signed by the CA certificate `ca_der` (by name).
fn issued_by(der: &[u8], ca_der: &[u8]) -> anyhow::Result<bool> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).context("the certificate does not parse")?;
    let (_, root) = x509_parser::parse_x509_certificate(ca_der).context("the CA certificate does not parse")?;
    Ok(cert.issuer().as_raw() == root.subject().as_raw())
}

/// `anchorage ca list`: one line per certificate the CA issued.
pub fn list_table(issued: &[Issued]) -> String {
    let now = unix_now();
    let mut rows = vec![["id".to_string(), "kind".into(), "serial".into(), "expires".into(), "revoked".into()]];
    for i in issued {
        let expires = if i.not_after < now { format!("{} (expired)", date(i.not_after)) } else { date(i.not_after) };
        let kind = match i.kind {
            Kind::Server => "server",
            Kind::Client => "client",
        };
        let revoked = i.revoked_at.map_or_else(|| "-".to_string(), date);
        rows.push([i.id.clone(), kind.into(), i.serial.clone(), expires, revoked]);
    }
    let widths: Vec<usize> = (0..5).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for row in &rows {
        let line: Vec<String> = row.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------------------------------------
// `anchorage provision project.toml`
// ---------------------------------------------------------------------------------------------

/// `project.toml`: the whole federation in one file (see `deploy/project.toml`). Relative paths
/// in it (`ca`, `out`) are taken from the file's own folder.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Project {
    /// The project's name (the CA's common name).
    pub name: String,
    /// The project CA's folder; made with `ca init` when it holds no CA yet.
    #[serde(default = "default_ca")]
    pub ca: PathBuf,
    /// Where the site folders go (`anchorage provision --out` overrides it).
    #[serde(default = "default_out")]
    pub out: PathBuf,
    /// Validity of the sites' certificates, in days.
    #[serde(default = "default_days")]
    pub days: u32,
    /// Validity of a new CA, in days.
    #[serde(default = "default_ca_days")]
    pub ca_days: u32,
    /// The method: a name (`"fedavg"`) or a `[method]` table; server and devices get the same.
    #[serde(default = "default_method")]
    pub method: toml::Value,
    pub server: ServerSite,
    /// Copied as server.toml's `[engine]` (rounds, min_fit, `[engine.robust]`, …).
    #[serde(default)]
    pub engine: toml::Table,
    /// Copied as server.toml's `[limits]`.
    #[serde(default)]
    pub limits: Option<toml::Table>,
    /// Copied as server.toml's `[store]`.
    #[serde(default)]
    pub store: Option<toml::Table>,
    /// Settings every client.toml gets (`device`, `memory_mb`, `encoding`, `optimizer`,
    /// `[client.connection]`, `[client.reconnect]`, …).
    #[serde(default)]
    pub client: toml::Table,
    /// Every device's `[data]`, with the device's own share filled in: `index` (and `clients`,
    /// unless given: the number of devices) for `source = "synthetic"`, `client` for
    /// `source = "scenario"`.
    #[serde(default = "default_data")]
    pub data: toml::Table,
    pub devices: Vec<DeviceSite>,
}

/// `[server]` of project.toml.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSite {
    /// What devices dial, `host:port` (`server.example.org:4433`, `10.0.0.5:4433`).
    pub address: String,
    /// Where the server listens (default `0.0.0.0` and the address's port).
    #[serde(default)]
    pub bind: Option<SocketAddr>,
    /// DNS names (or IP addresses) in the server's certificate (default: the address's host).
    /// Devices check the address's host when it is among them, else the first.
    #[serde(default)]
    pub names: Vec<String>,
    /// The server's id in its certificate.
    #[serde(default = "default_server_id")]
    pub id: String,
    /// Prometheus endpoint (`GET /metrics`) of server.toml.
    #[serde(default)]
    pub metrics_bind: Option<SocketAddr>,
}

/// One `[[devices]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSite {
    /// The device's id: its certificate's name, the `client_id` the server knows it by.
    pub id: String,
    /// This device's share of the data (default: its position in the list, from 0).
    #[serde(default)]
    pub index: Option<usize>,
}

fn default_ca() -> PathBuf {
    "ca".into()
}
fn default_out() -> PathBuf {
    "sites".into()
}
fn default_days() -> u32 {
    DEFAULT_DAYS
}
fn default_ca_days() -> u32 {
    DEFAULT_CA_DAYS
}
fn default_method() -> toml::Value {
    toml::Value::String("fedavg".into())
}
fn default_server_id() -> String {
    DEFAULT_SERVER_ID.into()
}
fn default_data() -> toml::Table {
    let mut t = toml::Table::new();
    t.insert("source".into(), "synthetic".into());
    t.insert("seed".into(), 7.into());
    t.insert("alpha".into(), 0.5.into());
    t
}

/// The keys of client.toml that provisioning writes itself; `[client]` may not set them.
const OWNED_CLIENT_KEYS: [&str; 9] =
    ["server", "server_name", "server_cert", "cert", "key", "client_id", "state_dir", "method", "data"];

impl Project {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let project: Self = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        project.check().with_context(|| format!("checking {}", path.display()))?;
        Ok(project)
    }

    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.devices.is_empty(), "no [[devices]]");
        anyhow::ensure!(self.days > 0 && self.ca_days > 0, "days and ca_days must be above 0");
        let mut seen = std::collections::BTreeSet::new();
        seen.insert(self.server.id.as_str());
        for d in &self.devices {
            anyhow::ensure!(seen.insert(d.id.as_str()), "the id `{}` is given twice (ids name one site each)", d.id);
        }
        for key in OWNED_CLIENT_KEYS {
            anyhow::ensure!(
                !self.client.contains_key(key),
                "[client] sets `{key}`, which provisioning writes itself (see [server], [data], method)"
            );
        }
        self.server_host()?;
        Ok(())
    }

    /// The host part of the server's address (no brackets around an IPv6 address).
    fn server_host(&self) -> anyhow::Result<String> {
        let (host, port) = self
            .server
            .address
            .rsplit_once(':')
            .with_context(|| format!("[server] address `{}` is not host:port", self.server.address))?;
        port.parse::<u16>().with_context(|| format!("[server] address `{}`: bad port", self.server.address))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        anyhow::ensure!(!host.is_empty(), "[server] address `{}` names no host", self.server.address);
        Ok(host.to_string())
    }

    /// The names in the server's certificate and the one devices check.
    fn server_names(&self) -> anyhow::Result<(Vec<String>, String)> {
        let host = self.server_host()?;
        if self.server.names.is_empty() {
            return Ok((vec![host.clone()], host));
        }
        let checked = if self.server.names.contains(&host) { host } else { self.server.names[0].clone() };
        Ok((self.server.names.clone(), checked))
    }

    fn bind(&self) -> anyhow::Result<SocketAddr> {
        if let Some(bind) = self.server.bind {
            return Ok(bind);
        }
        let port: u16 = self.server.address.rsplit_once(':').map(|(_, p)| p).unwrap_or("").parse()?;
        Ok(SocketAddr::from(([0, 0, 0, 0], port)))
    }

    /// server.toml's text (checked by [`ServerConfig::parse`]).
    pub fn server_toml(&self) -> anyhow::Result<String> {
        let mut t = toml::Table::new();
        t.insert("bind".into(), self.bind()?.to_string().into());
        t.insert("method".into(), self.method.clone());
        t.insert("state_dir".into(), "state".into());
        t.insert("tls_dir".into(), ".".into());
        t.insert("initial_model".into(), INITIAL_MODEL.into());
        if let Some(m) = self.server.metrics_bind {
            t.insert("metrics_bind".into(), m.to_string().into());
        }
        t.insert("engine".into(), self.engine.clone().into());
        if let Some(limits) = &self.limits {
            t.insert("limits".into(), limits.clone().into());
        }
        if let Some(store) = &self.store {
            t.insert("store".into(), store.clone().into());
        }
        let text = format!(
            "# Written by `anchorage provision` for the project `{}`: edit project.toml and provision again.\n\
             # anchorage-server --config server.toml  (relative paths are taken from this file's folder;\n\
             # this folder holds cert.der, key.der (0600), ca.der and revoked.crl: copy the CA's revoked.crl\n\
             # over it after `anchorage ca revoke`, the running server re-reads it)\n{}",
            self.name,
            toml::to_string(&t)?
        );
        ServerConfig::parse(&text).context("the server.toml provisioning would write")?;
        Ok(text)
    }

    /// The index of the `n`-th device's data share.
    fn index(&self, n: usize) -> usize {
        self.devices[n].index.unwrap_or(n)
    }

    /// client.toml's text for the `n`-th device (checked by parsing it as a [`ClientConfig`]).
    pub fn client_toml(&self, n: usize) -> anyhow::Result<String> {
        let device = &self.devices[n];
        let (_, server_name) = self.server_names()?;
        let mut t = toml::Table::new();
        t.insert("server".into(), self.server.address.clone().into());
        t.insert("server_name".into(), server_name.into());
        t.insert("server_cert".into(), ca::CA_CERT.into());
        t.insert("cert".into(), tls::CERT_FILE.into());
        t.insert("key".into(), tls::KEY_FILE.into());
        t.insert("client_id".into(), device.id.clone().into());
        t.insert("state_dir".into(), "state".into());
        t.extend(self.client.clone());
        let method = match &self.method {
            toml::Value::String(name) => {
                toml::Table::from_iter([("name".to_string(), toml::Value::from(name.as_str()))])
            }
            toml::Value::Table(table) => table.clone(),
            other => anyhow::bail!("method must be a name or a table, not {other}"),
        };
        t.insert("method".into(), method.into());
        let mut data = self.data.clone();
        let index = self.index(n);
        match data.get("source").and_then(|s| s.as_str()) {
            Some("synthetic") => {
                let clients = match data.get("clients") {
                    Some(c) => c.as_integer().context("data.clients must be a number")? as usize,
                    None => self.devices.len(),
                };
                anyhow::ensure!(
                    index < clients,
                    "device `{}` has data index {index}, but [data] splits the data into {clients} shares",
                    device.id
                );
                data.insert("clients".into(), (clients as i64).into());
                data.insert("index".into(), (index as i64).into());
            }
            Some("scenario") => {
                data.insert("client".into(), (index as i64).into());
            }
            _ => {}
        }
        t.insert("data".into(), data.into());
        let text = format!(
            "# Written by `anchorage provision` for the project `{}`: edit project.toml and provision again.\n\
             # anchorage-client --config client.toml  (relative paths are taken from this file's folder)\n{}",
            self.name,
            toml::to_string(&t)?
        );
        let config: ClientConfig = toml::from_str(&text).context("the client.toml provisioning would write")?;
        config.validate().context("the client.toml provisioning would write")?;
        Ok(text)
    }
}

/// What happened to one site folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SiteKey {
    /// A certificate and key were issued now.
    Issued,
    /// The folder's certificate and key were kept.
    Kept,
}

/// One site folder provisioning wrote.
#[derive(Debug, Clone)]
pub struct Site {
    pub id: String,
    pub kind: Kind,
    pub dir: PathBuf,
    /// `server.toml` or `client.toml` in `dir`.
    pub config: PathBuf,
    pub key: SiteKey,
}

/// What [`provision`] did.
#[derive(Debug, Clone)]
pub struct Provisioned {
    pub ca_dir: PathBuf,
    /// The CA was made now (`false`: an existing one was used).
    pub ca_created: bool,
    pub out: PathBuf,
    /// The server first, then the devices in project.toml's order.
    pub sites: Vec<Site>,
}

/// Keeps the identity in `dir` or issues one; refuses a folder holding half a pair or a
/// certificate from another CA.
fn site_identity(
    ca: &mut ProjectCa,
    kind: Kind,
    id: &str,
    names: &[String],
    days: u32,
    dir: &Path,
) -> anyhow::Result<SiteKey> {
    match tls::load_identity(dir).with_context(|| format!("site `{id}`"))? {
        Some(identity) => {
            anyhow::ensure!(
                issued_by(identity.cert.as_ref(), ca.cert().as_ref())?,
                "{} was not issued by this project's CA: move the folder away to provision `{id}` anew",
                dir.join(tls::CERT_FILE).display()
            );
            if kind == Kind::Server {
                let have = cert_names(identity.cert.as_ref())?;
                if let Some(missing) = names.iter().find(|n| !have.contains(n)) {
                    anyhow::bail!(
                        "{} does not carry the name `{missing}` that project.toml now gives the server: \
                         `anchorage ca renew {id} --dir <ca> --out {}` issues one that does",
                        dir.join(tls::CERT_FILE).display(),
                        dir.display()
                    );
                }
            }
            Ok(SiteKey::Kept)
        }
        None => {
            let identity = ca.issue(kind, id, names, days)?;
            tls::save_identity(dir, &identity)?;
            Ok(SiteKey::Issued)
        }
    }
}

/// `anchorage provision`: the CA (made when absent) and one folder per site under `out`
/// (project.toml's `out` when `None`).
pub fn provision(project_path: &Path, out: Option<&Path>) -> anyhow::Result<Provisioned> {
    let project = Project::load(project_path)?;
    let base = project_path.parent().unwrap_or(Path::new(""));
    let ca_dir = anchorage_client::config::resolve(base, &project.ca);
    let out = match out {
        Some(out) => out.to_path_buf(),
        None => anchorage_client::config::resolve(base, &project.out),
    };
    // Every config first: a mistake in project.toml stops here, before a key is made.
    let server_toml = project.server_toml()?;
    let client_tomls =
        (0..project.devices.len()).map(|n| project.client_toml(n)).collect::<anyhow::Result<Vec<_>>>()?;

    let ca_created = !ca_dir.join(ca::CA_KEY).exists() && !ca_dir.join(ca::CA_CERT).exists();
    let mut ca =
        if ca_created { ProjectCa::init(&ca_dir, &project.name, project.ca_days)? } else { ProjectCa::open(&ca_dir)? };
    let ca_cert = ca.cert().as_ref().to_vec();
    let write = |path: PathBuf, bytes: &[u8]| {
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))
    };

    let mut sites = Vec::new();
    let (names, _) = project.server_names()?;
    let dir = out.join("server");
    let key = site_identity(&mut ca, Kind::Server, &project.server.id, &names, project.days, &dir)?;
    write(dir.join(ca::CA_CERT), &ca_cert)?;
    // The CA's revocation list as it is now; `anchorage ca revoke` later rewrites the CA's copy.
    write(dir.join(ca::CRL), ca.crl()?.as_ref())?;
    write(dir.join("server.toml"), server_toml.as_bytes())?;
    sites.push(Site { id: project.server.id.clone(), kind: Kind::Server, config: dir.join("server.toml"), dir, key });

    for (device, text) in project.devices.iter().zip(&client_tomls) {
        let dir = out.join(&device.id);
        let key = site_identity(&mut ca, Kind::Client, &device.id, &[], project.days, &dir)?;
        write(dir.join(ca::CA_CERT), &ca_cert)?;
        write(dir.join("client.toml"), text.as_bytes())?;
        sites.push(Site { id: device.id.clone(), kind: Kind::Client, config: dir.join("client.toml"), dir, key });
    }
    write_initial_model(&out, &sites)?;
    Ok(Provisioned { ca_dir, ca_created, out, sites })
}

/// The server's initial model file, beside its server.toml.
pub const INITIAL_MODEL: &str = "initial-model.bin";

/// The global model of round 1, made by the method's own client half on the first device's
/// config (every device builds the same model), so that the server's layout is the method's,
/// never an update's. Kept when it exists: a running federation's first model does not change.
fn write_initial_model(out: &Path, sites: &[Site]) -> anyhow::Result<()> {
    let path = out.join("server").join(INITIAL_MODEL);
    if path.exists() {
        return Ok(());
    }
    let Some(first) = sites.iter().find(|s| s.kind == Kind::Client) else { return Ok(()) };
    let config = anchorage_client::config::ClientConfig::load(&first.config)?;
    let method = anchorage_client::runner::method(&config, &burn::tensor::Device::flex())
        .with_context(|| format!("building the method of {} for the initial model", first.config.display()))?;
    let blocks = method.initial_blocks().context("the method's initial model")?;
    anchorage_server::model_file::save(&path, &blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const PROJECT: &str = r#"
name = "unit"
days = 30
method = "fedavg"
[server]
address = "server.example.org:4433"
names = ["server.example.org", "localhost"]
[engine]
rounds = 2
min_available = 2
min_fit = 2
[client]
device = "cpu"
encoding = "f16"
[client.connection]
keep_alive_ms = 1000
[[devices]]
id = "edge-001"
[[devices]]
id = "edge-002"
"#;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(date(0), "1970-01-01");
        assert_eq!(date(951_782_400), "2000-02-29");
        assert_eq!(date(1_767_225_599), "2025-12-31");
    }

    #[test]
    fn provision_writes_one_ready_folder_per_site_and_keeps_keys_when_run_again() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project.toml");
        std::fs::write(&project, PROJECT).unwrap();
        let done = provision(&project, None).unwrap();
        assert!(done.ca_created);
        assert_eq!(done.out, dir.path().join("sites"));
        assert_eq!(done.sites.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["server", "edge-001", "edge-002"]);
        let ca_der = std::fs::read(dir.path().join("ca/ca.der")).unwrap();
        for site in &done.sites {
            assert_eq!(site.key, SiteKey::Issued);
            assert_eq!(mode(&site.dir.join("key.der")), 0o600, "{}: the key is private", site.id);
            assert_eq!(std::fs::read(site.dir.join("ca.der")).unwrap(), ca_der);
            let (id, _) = ca::peer_id(&std::fs::read(site.dir.join("cert.der")).unwrap().into()).unwrap();
            assert_eq!(id, site.id, "the certificate names the site");
        }

        // Copy a folder elsewhere: its configs still find their files.
        let moved = tempfile::tempdir().unwrap();
        for site in ["server", "edge-002"] {
            let to = moved.path().join(site);
            std::fs::create_dir_all(&to).unwrap();
            for f in std::fs::read_dir(done.out.join(site)).unwrap() {
                let f = f.unwrap();
                std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
            }
        }
        let server = ServerConfig::load(&moved.path().join("server/server.toml")).unwrap();
        assert_eq!(server.bind, "0.0.0.0:4433".parse().unwrap());
        assert_eq!(server.tls_dir, moved.path().join("server/."));
        assert_eq!(server.state_dir, moved.path().join("server/state"));
        assert!(!server.insecure_dev, "mutual TLS");
        assert_eq!((server.engine.rounds, server.engine.min_fit), (2, 2));
        assert!(server.tls_dir.join("cert.der").exists() && server.tls_dir.join("revoked.crl").exists());
        let names = cert_names(&std::fs::read(server.tls_dir.join("cert.der")).unwrap()).unwrap();
        assert_eq!(names, ["server", "server.example.org", "localhost"]);

        let client = ClientConfig::load(&moved.path().join("edge-002/client.toml")).unwrap();
        assert_eq!(
            (client.server.as_str(), client.server_name.as_str()),
            ("server.example.org:4433", "server.example.org")
        );
        assert_eq!(client.client_id, "edge-002");
        assert_eq!(client.server_cert, moved.path().join("edge-002/ca.der"));
        assert_eq!(client.cert.as_deref(), Some(moved.path().join("edge-002/cert.der").as_path()));
        assert_eq!(client.key.as_deref(), Some(moved.path().join("edge-002/key.der").as_path()));
        assert_eq!(client.state_dir, moved.path().join("edge-002/state"));
        assert_eq!((client.encoding.as_str(), client.connection.keep_alive_ms), ("f16", 1000));
        assert_eq!(client.method.name(), "fedavg");
        assert!(matches!(client.data, anchorage_client::config::DataSource::Synthetic { clients: 2, index: 1, .. }));
        assert!(client.server_cert.exists() && client.cert.unwrap().exists() && client.key.unwrap().exists());

        // Again, with a third device: the CA and every existing key stay; the new device is added.
        let keys: Vec<Vec<u8>> = done.sites.iter().map(|s| std::fs::read(s.dir.join("key.der")).unwrap()).collect();
        std::fs::write(&project, format!("{PROJECT}[[devices]]\nid = \"edge-003\"\n")).unwrap();
        let again = provision(&project, None).unwrap();
        assert!(!again.ca_created);
        assert_eq!(std::fs::read(dir.path().join("ca/ca.der")).unwrap(), ca_der, "the same CA");
        for (site, key) in again.sites.iter().zip(&keys) {
            assert_eq!(site.key, SiteKey::Kept, "{}", site.id);
            assert_eq!(&std::fs::read(site.dir.join("key.der")).unwrap(), key, "{}: the key is kept", site.id);
        }
        let new = &again.sites[3];
        assert_eq!((new.id.as_str(), &new.key), ("edge-003", &SiteKey::Issued));
        let third = ClientConfig::load(&new.config).unwrap();
        assert!(matches!(third.data, anchorage_client::config::DataSource::Synthetic { clients: 3, index: 2, .. }));
        assert_eq!(ProjectCa::open(&dir.path().join("ca")).unwrap().issued().len(), 4);

        // A key gone with its certificate still there is an error, not a new key.
        std::fs::remove_file(done.out.join("edge-001/key.der")).unwrap();
        let err = format!("{:#}", provision(&project, None).unwrap_err());
        assert!(err.contains("key.der is missing") && err.contains("edge-001"), "{err}");
        assert!(!done.out.join("edge-001/key.der").exists());
    }

    #[test]
    fn the_example_project_provisions() {
        let dir = tempfile::tempdir().unwrap();
        let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/project.toml");
        let project = dir.path().join("project.toml");
        std::fs::copy(&example, &project).unwrap();
        let done = provision(&project, None).unwrap();
        assert_eq!(done.sites.len(), 3);
        let server = ServerConfig::load(&done.sites[0].config).unwrap();
        assert_eq!(server.bind, "0.0.0.0:4433".parse().unwrap());
        let client = ClientConfig::load(&done.sites[1].config).unwrap();
        assert_eq!(
            (client.server.as_str(), client.server_name.as_str()),
            ("server.example.org:4433", "server.example.org")
        );
    }

    #[test]
    fn a_bad_project_is_refused_before_any_key_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project.toml");
        let refused = |text: String| {
            std::fs::write(&project, text).unwrap();
            format!("{:#}", provision(&project, None).unwrap_err())
        };
        let twice = refused(format!("{PROJECT}[[devices]]\nid = \"edge-001\"\n"));
        assert!(twice.contains("`edge-001` is given twice"), "{twice}");
        let owned = refused(PROJECT.replace("device = \"cpu\"", "client_id = \"x\""));
        assert!(owned.contains("[client] sets `client_id`"), "{owned}");
        let method = refused(PROJECT.replace("method = \"fedavg\"", "method = \"fedfoo\""));
        assert!(method.contains("unknown method `fedfoo`"), "{method}");
        let index = refused(format!("{PROJECT}[[devices]]\nid = \"edge-009\"\nindex = 7\n"));
        assert!(index.contains("data index 7"), "{index}");
        let port = refused(PROJECT.replace("server.example.org:4433", "server.example.org"));
        assert!(port.contains("not host:port"), "{port}");
        assert!(!dir.path().join("ca").exists() && !dir.path().join("sites").exists(), "nothing written");
    }

    #[test]
    fn ca_issue_list_revoke_and_renew() {
        let dir = tempfile::tempdir().unwrap();
        let ca_dir = dir.path().join("ca");
        let mut ca = ProjectCa::init(&ca_dir, "unit", 100).unwrap();
        let out = dir.path().join("server");
        let first = issue(&mut ca, Kind::Server, "server", &["fl.example.org".into()], 10, &out).unwrap();
        assert_eq!(mode(&out.join("key.der")), 0o600);
        assert_eq!(std::fs::read(out.join("ca.der")).unwrap(), ca.cert().as_ref());
        // A server's folder gets the CA's (empty) revocation list: the server does not start without it.
        let crl = std::fs::read(out.join(ca::CRL)).expect("`ca issue server` writes revoked.crl");
        assert!(ca::revoked_serials(&crl).unwrap().is_empty());
        let err = issue(&mut ca, Kind::Server, "server", &[], 10, &out).unwrap_err().to_string();
        assert!(err.contains("ca renew server"), "an issued pair is not overwritten: {err}");
        let edge = dir.path().join("edge-001");
        issue(&mut ca, Kind::Client, "edge-001", &[], 10, &edge).unwrap();
        assert!(!edge.join(ca::CRL).exists(), "a device needs no revocation list");

        // Renew: same id and kind, a later expiry, a new key, the server's names kept.
        let old_key = std::fs::read(out.join("key.der")).unwrap();
        let mut ca = ProjectCa::open(&ca_dir).unwrap();
        let renewed = renew(&mut ca, "server", &[], 60, &out).unwrap();
        assert_eq!((renewed.kind, renewed.id.as_str()), (Kind::Server, "server"));
        assert!(renewed.not_after > first.not_after + 40 * 86_400 && renewed.serial != first.serial);
        assert_ne!(std::fs::read(out.join("key.der")).unwrap(), old_key);
        assert_eq!(mode(&out.join("key.der")), 0o600);
        let cert = std::fs::read(out.join("cert.der")).unwrap();
        assert_eq!(cert_names(&cert).unwrap(), ["server", "fl.example.org"]);
        assert!(renew(&mut ca, "nobody", &[], 10, &out).is_err());

        // Revoke: the CRL lists every certificate of the id; list shows it.
        let revoked = ca.revoke("server").unwrap();
        assert_eq!(revoked.len(), 2);
        let crl = std::fs::read(ca_dir.join(ca::CRL)).unwrap();
        let serials = ca::revoked_serials(&crl).unwrap();
        assert!(serials.contains(&first.serial) && serials.contains(&renewed.serial));
        let table = list_table(ProjectCa::open(&ca_dir).unwrap().issued());
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4, "{table}");
        assert!(lines[0].starts_with("id") && lines[0].contains("expires") && lines[0].ends_with("revoked"));
        let today = date(unix_now());
        let edge_line = lines.iter().find(|l| l.starts_with("edge-001")).unwrap();
        assert!(edge_line.contains("client") && edge_line.trim_end().ends_with('-'), "{edge_line}");
        assert!(lines.iter().filter(|l| l.starts_with("server") && l.ends_with(&today)).count() == 2, "{table}");
        assert!(lines[1].contains(&first.serial) && lines[1].contains(&date(first.not_after)));
    }
}
