//! `anchorage provision project.toml`: one ready folder per site (the identity files are
//! `anchorage_pki::site`'s; this writes the configs around them).
//!
//! A site folder holds the site's certificate (`cert.der`), its private key (`key.der`, mode
//! 0600), the project CA's certificate (`ca.der`) and a complete config (`server.toml` or
//! `client.toml`) whose paths are relative to the folder itself, so the folder works wherever
//! it is copied. Keys are secrets, the rest is not: every other file is mode 0644 and the folder
//! 0755, whatever the umask, so that `cp site/* /etc/anchorage/` and a `chown` of `key.der` to
//! the service's user (deploy/README.md) give that user everything it reads. Provisioning again
//! keeps the CA and every site's key and certificate (a key is never made again silently),
//! rewrites the configs from `project.toml`, and adds the devices that are new.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anchorage_client::config::ClientConfig;
use anchorage_pki::site::{PUBLIC_MODE, SITE_DIR_MODE, set_mode, write_public};
use anchorage_pki::{CA_CERT, CERT_FILE, CRL, Kind, ProjectCa, cert};
use anchorage_server::config::ServerConfig;
use anyhow::Context;
use serde::Deserialize;

/// Validity of a new CA, in days.
pub const DEFAULT_CA_DAYS: u32 = 3650;
/// Validity of a site's certificate, in days.
pub const DEFAULT_DAYS: u32 = 365;
/// The server's id (its certificate's first name) unless `project.toml` names another.
pub const DEFAULT_SERVER_ID: &str = "server";

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
    /// A relay tier: each relay's folder, with relay.toml (the server program with a
    /// `[parent]` table naming `[server]`). Empty: the devices dial the server.
    #[serde(default)]
    pub relays: Vec<RelaySite>,
    /// Copied as every relay.toml's `[engine]` (the relays' own sampling: `fraction`,
    /// `min_available`, `round_deadline`, `[engine.robust]`).
    #[serde(default)]
    pub relay_engine: toml::Table,
    pub devices: Vec<DeviceSite>,
}

/// One `[[relays]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelaySite {
    /// The relay's id, in its certificate (with the relay role).
    pub id: String,
    /// What its devices dial, `host:port`.
    pub address: String,
    /// Where it listens (default `0.0.0.0` and the address's port).
    #[serde(default)]
    pub bind: Option<SocketAddr>,
}

/// The name every relay's certificate carries beside its own address's host: the name a device
/// checks, whichever relay of its list it reaches.
pub const RELAY_NAME: &str = "anchorage-relay";

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
    /// The relay it dials (an id of `[[relays]]`; default: round robin over them), the others
    /// its fallbacks.
    #[serde(default)]
    pub relay: Option<String>,
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

/// project.toml's tables that are copied into the sites' configs, read as the configs' own types
/// (every other key of project.toml is ignored here: [`Project`] reads those).
#[derive(Deserialize)]
struct CopiedTables {
    #[serde(default)]
    #[allow(dead_code)]
    client: Option<ClientTable>,
    #[serde(default)]
    #[allow(dead_code)]
    engine: Option<anchorage_server::EngineConfig>,
    #[serde(default)]
    #[allow(dead_code)]
    limits: Option<anchorage_server::transport::Limits>,
    #[serde(default)]
    #[allow(dead_code)]
    store: Option<anchorage_server::store::Retention>,
}

/// `[client]` read as a [`ClientConfig`] (unknown keys and wrong types refused, nested tables
/// such as `[client.connection]` included), with stand-ins for the keys provisioning writes
/// itself. Read from project.toml's text, an error carries the line of the key in that file.
struct ClientTable;

impl<'de> Deserialize<'de> for ClientTable {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        ClientConfig::deserialize(owned_keys::WithOwnedKeys(deserializer)).map(|_| ClientTable)
    }
}

mod owned_keys {
    //! A deserializer that hands a struct's visitor the keys provisioning writes into every
    //! client.toml (placeholders of the right types) before the table's own entries.

    use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, Visitor};

    fn stand_ins() -> Vec<(&'static str, toml::Value)> {
        let data = toml::Table::from_iter([
            ("source".to_string(), toml::Value::from("synthetic")),
            ("seed".to_string(), toml::Value::from(0)),
            ("clients".to_string(), toml::Value::from(1)),
            ("index".to_string(), toml::Value::from(0)),
            ("alpha".to_string(), toml::Value::from(0.5)),
        ]);
        vec![
            ("server", "127.0.0.1:4433".into()),
            ("server_cert", "ca.der".into()),
            ("client_id", "stand-in".into()),
            ("state_dir", "state".into()),
            ("data", data.into()),
        ]
    }

    pub(super) struct WithOwnedKeys<D>(pub D);

    impl<'de, D: de::Deserializer<'de>> de::Deserializer<'de> for WithOwnedKeys<D> {
        type Error = D::Error;

        fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
            self.0.deserialize_any(Prepend(visitor))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            name: &'static str,
            fields: &'static [&'static str],
            visitor: V,
        ) -> Result<V::Value, D::Error> {
            self.0.deserialize_struct(name, fields, Prepend(visitor))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option
            unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }

    struct Prepend<V>(V);

    impl<'de, V: Visitor<'de>> Visitor<'de> for Prepend<V> {
        type Value = V::Value;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            self.0.expecting(f)
        }

        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
            self.0.visit_map(Prepended { stand_ins: stand_ins().into_iter(), value: None, map })
        }
    }

    struct Prepended<A> {
        stand_ins: std::vec::IntoIter<(&'static str, toml::Value)>,
        value: Option<toml::Value>,
        map: A,
    }

    impl<'de, A: MapAccess<'de>> MapAccess<'de> for Prepended<A> {
        type Error = A::Error;

        fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
            match self.stand_ins.next() {
                Some((key, value)) => {
                    self.value = Some(value);
                    seed.deserialize(IntoDeserializer::<A::Error>::into_deserializer(key)).map(Some)
                }
                None => self.map.next_key_seed(seed),
            }
        }

        fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
            match self.value.take() {
                Some(value) => seed.deserialize(value).map_err(de::Error::custom),
                None => self.map.next_value_seed(seed),
            }
        }
    }
}

/// The keys of client.toml that provisioning writes itself; `[client]` may not set them.
const OWNED_CLIENT_KEYS: [&str; 9] =
    ["server", "server_name", "server_cert", "cert", "key", "client_id", "state_dir", "method", "data"];

/// client.toml's training budget (`max_memory_mb`) unless project.toml's `[client]` sets one:
/// the packaged deploy/client.toml's, below the client unit's `MemoryHigh=448M` and
/// `MemoryMax=512M` (deploy/systemd/anchorage-client.service).
pub const DEFAULT_MAX_MEMORY_MB: u32 = 384;

impl Project {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let project: Self = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        project.check().with_context(|| format!("checking {}", path.display()))?;
        // The tables copied into the sites' configs are read as those configs' own types here,
        // from project.toml's text, so that a typo is reported at its line in this file.
        toml::from_str::<CopiedTables>(&text).with_context(|| {
            format!(
                "checking {} ([client] goes into every client.toml, [engine], [limits] and [store] into \
                 server.toml: they take those files' keys)",
                path.display()
            )
        })?;
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
        bind_of(self.server.bind, &self.server.address)
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

    /// relay.toml's text for relay `r` (checked by [`ServerConfig::parse`]).
    pub fn relay_toml(&self, r: usize) -> anyhow::Result<String> {
        let relay = &self.relays[r];
        let (_, parent_name) = self.server_names()?;
        let mut t = toml::Table::new();
        t.insert("bind".into(), bind_of(relay.bind, &relay.address)?.to_string().into());
        t.insert("method".into(), self.method.clone());
        t.insert("state_dir".into(), "state".into());
        t.insert("tls_dir".into(), ".".into());
        let mut parent = toml::Table::new();
        parent.insert("address".into(), self.server.address.clone().into());
        parent.insert("server_name".into(), parent_name.into());
        t.insert("parent".into(), parent.into());
        t.insert("engine".into(), self.relay_engine.clone().into());
        if let Some(limits) = &self.limits {
            t.insert("limits".into(), limits.clone().into());
        }
        let text = format!(
            "# Written by `anchorage provision` for the project `{}`: edit project.toml and provision again.\n\
             # anchorage-relay --config relay.toml  (a relay: its rounds are its parent's, [parent]; this\n\
             # folder holds cert.der with the relay role, key.der (0600), ca.der and revoked.crl)\n{}",
            self.name,
            toml::to_string(&t)?
        );
        let config = ServerConfig::parse(&text).context("the relay.toml provisioning would write")?;
        let method = config.method.config()?;
        anchorage_server::relay::check(&config.engine, &method)
            .map_err(|why| anyhow::anyhow!("relay `{}` cannot carry `{}`: {why}", relay.id, method.name()))?;
        Ok(text)
    }

    /// The relay the `n`-th device dials and its fallbacks (`None` without relays).
    fn relay_of(&self, n: usize) -> anyhow::Result<Option<(String, Vec<String>)>> {
        if self.relays.is_empty() {
            return Ok(None);
        }
        let first = match &self.devices[n].relay {
            Some(id) => self.relays.iter().position(|r| &r.id == id).with_context(|| {
                format!("device `{}` names relay `{id}`, which [[relays]] does not list", self.devices[n].id)
            })?,
            None => n % self.relays.len(),
        };
        let order = (0..self.relays.len()).map(|k| &self.relays[(first + k) % self.relays.len()].address);
        let mut order: Vec<String> = order.cloned().collect();
        let dial = order.remove(0);
        Ok(Some((dial, order)))
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
        match self.relay_of(n)? {
            Some((dial, fallbacks)) => {
                t.insert("server".into(), dial.into());
                t.insert("fallbacks".into(), fallbacks.into());
                t.insert("server_name".into(), RELAY_NAME.into());
            }
            None => {
                t.insert("server".into(), self.server.address.clone().into());
                t.insert("server_name".into(), server_name.into());
            }
        }
        t.insert("server_cert".into(), CA_CERT.into());
        t.insert("cert".into(), CERT_FILE.into());
        t.insert("key".into(), anchorage_pki::KEY_FILE.into());
        t.insert("client_id".into(), device.id.clone().into());
        t.insert("state_dir".into(), "state".into());
        t.insert("max_memory_mb".into(), i64::from(DEFAULT_MAX_MEMORY_MB).into());
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
    /// The server first, then the relays, then the devices in project.toml's order.
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
    match anchorage_pki::load_identity(dir).with_context(|| format!("site `{id}`"))? {
        Some(identity) => {
            anyhow::ensure!(
                cert::issued_by(identity.cert.as_ref(), ca.cert().as_ref())?,
                "{} was not issued by this project's CA: move the folder away to provision `{id}` anew",
                dir.join(CERT_FILE).display()
            );
            if kind.serves() {
                let have = cert::cert_names(identity.cert.as_ref())?;
                if let Some(missing) = names.iter().find(|n| !have.contains(n)) {
                    anyhow::bail!(
                        "{} does not carry the name `{missing}` that project.toml now gives the server: \
                         `anchorage ca renew {id} --dir <ca> --out {}` issues one that does",
                        dir.join(CERT_FILE).display(),
                        dir.display()
                    );
                }
            }
            set_mode(dir, SITE_DIR_MODE)?;
            set_mode(&dir.join(CERT_FILE), PUBLIC_MODE)?;
            Ok(SiteKey::Kept)
        }
        None => {
            let identity = ca.issue(kind, id, names, days)?;
            anchorage_pki::save_identity(dir, &identity)?;
            set_mode(dir, SITE_DIR_MODE)?;
            set_mode(&dir.join(CERT_FILE), PUBLIC_MODE)?;
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
    let relay_tomls = (0..project.relays.len()).map(|r| project.relay_toml(r)).collect::<anyhow::Result<Vec<_>>>()?;

    let ca_created = !ca_dir.join(anchorage_pki::CA_KEY).exists() && !ca_dir.join(CA_CERT).exists();
    let mut ca =
        if ca_created { ProjectCa::init(&ca_dir, &project.name, project.ca_days)? } else { ProjectCa::open(&ca_dir)? };
    let ca_cert = ca.cert().as_ref().to_vec();

    // Every file but key.der is written 0644 (and set so when kept), each folder 0755: the
    // service's user reads them after a plain copy (deploy/README.md).
    let mut sites = Vec::new();
    let (names, _) = project.server_names()?;
    let dir = out.join("server");
    let key = site_identity(&mut ca, Kind::Server, &project.server.id, &names, project.days, &dir)?;
    write_public(&dir.join(CA_CERT), &ca_cert)?;
    // The CA's revocation list as it is now; `anchorage ca revoke` later rewrites the CA's copy.
    write_public(&dir.join(CRL), ca.crl()?.as_ref())?;
    write_public(&dir.join("server.toml"), server_toml.as_bytes())?;
    sites.push(Site { id: project.server.id.clone(), kind: Kind::Server, config: dir.join("server.toml"), dir, key });

    for (relay, text) in project.relays.iter().zip(&relay_tomls) {
        let dir = out.join(&relay.id);
        let names = [host_of(&relay.address), RELAY_NAME.to_string()];
        let key = site_identity(&mut ca, Kind::Relay, &relay.id, &names, project.days, &dir)?;
        write_public(&dir.join(CA_CERT), &ca_cert)?;
        write_public(&dir.join(CRL), ca.crl()?.as_ref())?;
        write_public(&dir.join("relay.toml"), text.as_bytes())?;
        sites.push(Site { id: relay.id.clone(), kind: Kind::Relay, config: dir.join("relay.toml"), dir, key });
    }
    for (device, text) in project.devices.iter().zip(&client_tomls) {
        let dir = out.join(&device.id);
        let key = site_identity(&mut ca, Kind::Client, &device.id, &[], project.days, &dir)?;
        write_public(&dir.join(CA_CERT), &ca_cert)?;
        write_public(&dir.join("client.toml"), text.as_bytes())?;
        sites.push(Site { id: device.id.clone(), kind: Kind::Client, config: dir.join("client.toml"), dir, key });
    }
    write_initial_model(&out, &sites)?;
    Ok(Provisioned { ca_dir, ca_created, out, sites })
}

/// Where a site listens: `bind`, or `0.0.0.0` and `address`'s port.
fn bind_of(bind: Option<SocketAddr>, address: &str) -> anyhow::Result<SocketAddr> {
    if let Some(bind) = bind {
        return Ok(bind);
    }
    let port: u16 = address.rsplit_once(':').map(|(_, p)| p).unwrap_or("").parse()?;
    Ok(SocketAddr::from(([0, 0, 0, 0], port)))
}

/// The host of `host:port`.
fn host_of(address: &str) -> String {
    address.rsplit_once(':').map_or(address, |(host, _)| host).trim_matches(['[', ']']).to_string()
}

/// The server's initial model file, beside its server.toml.
pub const INITIAL_MODEL: &str = "initial-model.bin";

/// The global model of round 1, made by the method's own client half on the first device's
/// config (every device builds the same model), so that the server's layout is the method's,
/// never an update's. Kept when it exists: a running federation's first model does not change.
fn write_initial_model(out: &Path, sites: &[Site]) -> anyhow::Result<()> {
    let path = out.join("server").join(INITIAL_MODEL);
    if !path.exists() {
        let Some(first) = sites.iter().find(|s| s.kind == Kind::Client) else { return Ok(()) };
        let config = anchorage_client::config::ClientConfig::load(&first.config)?;
        let method = anchorage_client::runner::method(&config, &burn::tensor::Device::flex())
            .with_context(|| format!("building the method of {} for the initial model", first.config.display()))?;
        let blocks = method.initial_blocks().context("the method's initial model")?;
        anchorage_server::model_file::save(&path, &blocks)?;
    }
    // The server's user reads it after a plain copy (it is no secret: every device builds it).
    set_mode(&path, PUBLIC_MODE)
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

    /// `[[relays]]` get folders of their own (a relay certificate naming the relay
    /// and the tier, relay.toml with the server as its parent); each device dials its relay and
    /// lists the others as fallbacks.
    #[test]
    fn relays_get_folders_and_devices_dial_them() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project.toml");
        let relays = "[[relays]]\nid = \"relay-a\"\naddress = \"relay-a.example.org:4434\"\n\
                      [[relays]]\nid = \"relay-b\"\naddress = \"relay-b.example.org:4435\"\n\
                      [relay_engine]\nfraction = 0.5\nmin_available = 1\nmin_fit = 1\n";
        let text = PROJECT
            .replace("[[devices]]\nid = \"edge-002\"\n", "[[devices]]\nid = \"edge-002\"\nrelay = \"relay-a\"\n");
        std::fs::write(&project, format!("{text}{relays}")).unwrap();
        let done = provision(&project, None).unwrap();
        let ids: Vec<&str> = done.sites.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["server", "relay-a", "relay-b", "edge-001", "edge-002"]);
        let relay = ServerConfig::load(&done.out.join("relay-b/relay.toml")).unwrap();
        let parent = relay.parent.expect("a relay's parent");
        assert_eq!(
            (parent.address.as_str(), parent.server_name.as_str()),
            ("server.example.org:4433", "server.example.org")
        );
        assert_eq!((relay.bind, relay.engine.fraction), ("0.0.0.0:4435".parse().unwrap(), 0.5));
        let cert = std::fs::read(done.out.join("relay-b/cert.der")).unwrap();
        assert!(cert::is_relay(&cert), "the relay role");
        assert_eq!(cert::cert_names(&cert).unwrap(), ["relay-b", "relay-b.example.org", RELAY_NAME]);
        assert!(done.out.join("relay-b/revoked.crl").exists());
        // edge-001 (first, round robin) dials relay-a, so does edge-002 (named); each lists the other.
        for device in ["edge-001", "edge-002"] {
            let client = ClientConfig::load(&done.out.join(device).join("client.toml")).unwrap();
            assert_eq!(client.server, "relay-a.example.org:4434", "{device}");
            assert_eq!(client.fallbacks, ["relay-b.example.org:4435"], "{device}");
            assert_eq!(client.server_name, RELAY_NAME);
        }
        std::fs::write(
            &project,
            format!("{PROJECT}{relays}").replace("id = \"edge-002\"", "id = \"edge-002\"\nrelay = \"nowhere\""),
        )
        .unwrap();
        let err = format!("{:#}", provision(&project, None).unwrap_err());
        assert!(err.contains("relay `nowhere`"), "{err}");
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
            let (id, _) = anchorage_pki::peer_id(&std::fs::read(site.dir.join("cert.der")).unwrap().into()).unwrap();
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
        let names = cert::cert_names(&std::fs::read(server.tls_dir.join("cert.der")).unwrap()).unwrap();
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
        assert_eq!((client.encoding.name(), client.connection.keep_alive_ms), ("f16", 1000));
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
        assert_eq!(server.metrics_bind, Some("127.0.0.1:9464".parse().unwrap()), "/metrics on loopback");
        let client = ClientConfig::load(&done.sites[1].config).unwrap();
        assert_eq!(
            (client.server.as_str(), client.server_name.as_str()),
            ("server.example.org:4433", "server.example.org")
        );
        assert_eq!(client.max_memory_mb, Some(DEFAULT_MAX_MEMORY_MB));
    }

    /// The repository's root (the sim crate's parent).
    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
    }

    /// The first ```sh block after the heading `heading` of the Markdown file `file`.
    fn sh_block(file: &str, heading: &str) -> String {
        let text = std::fs::read_to_string(repo().join(file)).unwrap();
        let (_, section) = text.split_once(&format!("\n{heading}\n")).unwrap_or_else(|| panic!("{file}: {heading}"));
        let (_, block) = section.split_once("```sh\n").unwrap_or_else(|| panic!("{file}: a sh block under {heading}"));
        block.split_once("```").unwrap().0.to_string()
    }

    /// The block's line that starts with `start`, without its trailing comment.
    fn line_starting(block: &str, start: &str) -> String {
        let line = block.lines().find(|l| l.starts_with(start)).unwrap_or_else(|| panic!("no `{start}` in {block}"));
        match line.find("  #") {
            Some(at) => line[..at].trim_end().to_string(),
            None => line.to_string(),
        }
    }

    /// Runs `script` with sh in `cwd`, HOME set to `home`; returns its stdout.
    fn sh(script: &str, cwd: &Path, home: &Path) -> String {
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .current_dir(cwd)
            .env("HOME", home)
            .output()
            .expect("sh runs");
        assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn every_file_but_the_key_is_readable_by_a_service_user_after_a_copy() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project.toml");
        std::fs::write(&project, PROJECT).unwrap();
        let check = |done: &Provisioned| {
            for site in &done.sites {
                assert_eq!(mode(&site.dir), 0o755, "{}: the folder", site.id);
                let mut files = 0;
                for f in std::fs::read_dir(&site.dir).unwrap() {
                    let path = f.unwrap().path();
                    let want = if path.ends_with("key.der") { 0o600 } else { 0o644 };
                    assert_eq!(mode(&path), want, "{}: keys are secrets, the rest is not", path.display());
                    files += 1;
                }
                assert_eq!(files, if site.kind == Kind::Server { 6 } else { 4 }, "{}", site.id);
            }
        };
        let done = provision(&project, None).unwrap();
        check(&done);
        // A folder an older provision left (everything 0600, the folder 0700) is set right again.
        for site in &done.sites {
            for f in std::fs::read_dir(&site.dir).unwrap() {
                std::fs::set_permissions(f.unwrap().path(), std::fs::Permissions::from_mode(0o600)).unwrap();
            }
            std::fs::set_permissions(&site.dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        check(&provision(&project, None).unwrap());
    }

    #[test]
    fn the_walkthroughs_keep_the_ca_key_out_of_the_checkout_and_the_images() {
        // README.md's and deploy/README.md's lines that make the project folder, run in a stand-in
        // checkout: the folder lands under HOME, nothing in the checkout.
        let checkout = tempfile::tempdir().unwrap();
        std::fs::create_dir(checkout.path().join("deploy")).unwrap();
        std::fs::copy(repo().join("deploy/project.toml"), checkout.path().join("deploy/project.toml")).unwrap();
        let home = tempfile::tempdir().unwrap();
        let home_path = home.path().canonicalize().unwrap();
        let walkthrough = sh_block("README.md", "## Running it for real");
        let made = line_starting(&walkthrough, "P=");
        let p = sh(&format!("{made}\nprintf %s \"$P\""), checkout.path(), &home_path);
        let p = Path::new(&p).canonicalize().unwrap();
        assert!(p.join("project.toml").exists() && p.starts_with(&home_path), "README.md: {made} made {}", p.display());
        let deploy =
            sh_block("deploy/README.md", "## 1. Provision (on the operator's machine; the CA never leaves it)");
        let made = line_starting(&deploy, "mkdir");
        sh(&made, checkout.path(), &home_path);
        assert!(home_path.join("myproject/project.toml").exists(), "deploy/README.md: {made}");
        let left: Vec<_> = std::fs::read_dir(checkout.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["deploy"], "the walkthroughs make nothing in the checkout");

        // One made in the checkout anyway is ignored by git and never copied into an image.
        let dockerignore = std::fs::read_to_string(repo().join(".dockerignore")).unwrap();
        let lines: Vec<&str> = dockerignore.lines().map(str::trim).collect();
        for pattern in ["myproject", "**/ca.key", "**/key.der"] {
            assert!(lines.contains(&pattern), ".dockerignore leaves out {pattern}: {dockerignore}");
        }
        let git = std::process::Command::new("git")
            .args(["check-ignore", "--no-index", "myproject/ca/ca.key", "myproject/sites/edge-001/key.der"])
            .args(["anchorage-try/ca/ca.key", "elsewhere/ca/ca.key", "elsewhere/sites/edge-001/key.der"])
            .current_dir(repo())
            .output();
        match git {
            Ok(out) if out.status.code() != Some(128) => {
                let ignored = String::from_utf8_lossy(&out.stdout);
                assert_eq!(ignored.lines().count(), 5, "git ignores every key: {ignored}");
            }
            _ => anchorage_shared::skip::skipped(
                "the .gitignore half of the walkthrough test: no git here, or not a git checkout (apt install git)",
            ),
        }
    }

    #[test]
    fn the_walkthrough_binds_loopback_and_serves_metrics() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(repo().join("deploy/project.toml"), dir.path().join("project.toml")).unwrap();
        let walkthrough = sh_block("README.md", "## Running it for real");
        let edit = line_starting(&walkthrough, "sed -i");
        sh(&format!("P='{}'\n{edit}", dir.path().display()), dir.path(), dir.path());
        let done = provision(&dir.path().join("project.toml"), None).unwrap();
        let server = ServerConfig::load(&done.sites[0].config).unwrap();
        assert_eq!(server.bind, "127.0.0.1:4433".parse().unwrap(), "the one-machine try listens on loopback only");
        assert_eq!(server.metrics_bind, Some("127.0.0.1:9464".parse().unwrap()), "/metrics, as the README then shows");
        let client = ClientConfig::load(&done.sites[1].config).unwrap();
        assert_eq!((client.server.as_str(), client.server_name.as_str()), ("127.0.0.1:4433", "localhost"));
    }

    #[test]
    fn every_client_toml_carries_a_memory_budget_within_the_unit() {
        let unit = std::fs::read_to_string(repo().join("deploy/systemd/anchorage-client.service")).unwrap();
        let max: u32 =
            unit.lines().find_map(|l| l.strip_prefix("MemoryMax=")?.strip_suffix('M')?.parse().ok()).unwrap();
        assert!(
            DEFAULT_MAX_MEMORY_MB < max,
            "the budget ({DEFAULT_MAX_MEMORY_MB} MiB) leaves room below MemoryMax={max}M"
        );
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project.toml");
        std::fs::write(&project, PROJECT).unwrap();
        let done = provision(&project, None).unwrap();
        let client = ClientConfig::load(&done.sites[1].config).unwrap();
        assert_eq!(client.max_memory_mb, Some(384), "the packaged client.toml's budget by default");
        std::fs::write(&project, PROJECT.replace("device = \"cpu\"", "device = \"cpu\"\nmax_memory_mb = 256")).unwrap();
        let done = provision(&project, None).unwrap();
        assert_eq!(ClientConfig::load(&done.sites[2].config).unwrap().max_memory_mb, Some(256), "[client] sets it");
    }

    #[test]
    fn a_typo_in_a_copied_table_is_reported_at_its_line_in_project_toml() {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project.toml");
        // (what replaces what, the key the message must name)
        let cases = [
            ("rounds = 2", "roundz = 2", "roundz"),
            ("min_fit = 2", "min_fit = \"two\"", "min_fit"),
            ("encoding = \"f16\"", "encodin = \"f16\"", "encodin"),
            ("keep_alive_ms = 1000", "keep_alive = 1000", "keep_alive"),
            ("device = \"cpu\"", "device = \"cpu\"\nmax_memory_mb = \"lots\"", "max_memory_mb"),
        ];
        for (from, to, key) in cases {
            let text = PROJECT.replace(from, to);
            assert_ne!(text, PROJECT);
            std::fs::write(&project, &text).unwrap();
            let err = format!("{:#}", provision(&project, None).unwrap_err());
            println!("{to}:\n{err}");
            let line = text.lines().position(|l| l.starts_with(key)).unwrap() + 1;
            assert!(err.contains("project.toml"), "{to}: the message names project.toml: {err}");
            assert!(err.contains(&format!("line {line}")), "{to}: the message gives project.toml's line {line}: {err}");
            assert!(err.contains(key), "{to}: the message names `{key}`: {err}");
            assert!(!dir.path().join("ca").exists() && !dir.path().join("sites").exists(), "{to}: nothing written");
        }
        // [engine.robust], [limits] and [store] too ([engine.round] is the protocol's RoundConfig,
        // which takes unknown keys in server.toml as well).
        for (table, typo) in
            [("[engine.robust]", "max_normz = 1"), ("[limits]", "idle_timout = 1"), ("[store]", "keep = 1")]
        {
            let text = format!("{PROJECT}\n{table}\n{typo}\n");
            std::fs::write(&project, &text).unwrap();
            let err = format!("{:#}", provision(&project, None).expect_err(&format!("{table} {typo} is refused")));
            let line = text.lines().position(|l| l == typo).unwrap() + 1;
            assert!(err.contains(&format!("line {line}")) && err.contains(typo.split(' ').next().unwrap()), "{err}");
        }
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
}
