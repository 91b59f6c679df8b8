//! `anchorage ca …` and `anchorage provision`: the operator's commands over anchorage-pki and
//! [`anchorage::provision`].

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub(crate) enum CaCommand {
    /// Makes the project's root: ca.der (given to every site) and ca.key (0600, stays here).
    Init {
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
        /// The project's name, in the root's common name.
        #[arg(long, default_value = "anchorage")]
        name: String,
        #[arg(long, default_value_t = anchorage::provision::DEFAULT_CA_DAYS)]
        days: u32,
    },
    /// Signs a certificate for a server, a relay or a device: writes cert.der, key.der (0600) and
    /// ca.der into --out (a server's and a relay's also the CA's revoked.crl, which it needs to start).
    Issue {
        kind: KindArg,
        /// The site's id (a device's id is the client id the server knows it by).
        id: String,
        /// A DNS name (or IP address) the server is reached by; repeat for more.
        #[arg(long = "name")]
        names: Vec<String>,
        #[command(flatten)]
        site: SiteArgs,
    },
    /// Revokes every certificate of an id and rewrites the CA's revoked.crl.
    Revoke {
        id: String,
        /// Only the certificate with this serial (from `anchorage ca list`), e.g. the old one after
        /// a renewal; without it every certificate of the id is revoked.
        #[arg(long)]
        serial: Option<String>,
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
    },
    /// What the CA issued: id, kind, serial, expiry, revocation.
    List {
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
    },
    /// A new certificate and key for an id, same kind, fresh expiry, written into --out over
    /// the old pair; restart the site to use it. A revoked id is refused unless --force.
    Renew {
        id: String,
        /// A server's DNS names (default: those of the certificate now in --out).
        #[arg(long = "name")]
        names: Vec<String>,
        /// Renew an id whose every certificate is revoked: the new certificate lets the site back
        /// in (its old certificates stay revoked).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        site: SiteArgs,
    },
}

/// Where a certificate goes and for how long (`anchorage ca issue` and `renew`).
#[derive(Args)]
pub(crate) struct SiteArgs {
    #[arg(long, default_value_t = anchorage::provision::DEFAULT_DAYS)]
    days: u32,
    /// The site folder (default: ./<id>).
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, default_value = "ca")]
    dir: PathBuf,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum KindArg {
    Server,
    Client,
    /// A relay (a server to its devices, a client of its parent).
    Relay,
}

/// The project CA in `dir`; a folder without one says where the CA is expected, not to make one.
fn open_ca(dir: &Path) -> anyhow::Result<anchorage_pki::ProjectCa> {
    use anchorage_pki::{CA_CERT, CA_KEY};
    if !dir.join(CA_CERT).exists() && !dir.join(CA_KEY).exists() {
        let shown = if dir.is_absolute() { dir.display().to_string() } else { format!("./{}", dir.display()) };
        anyhow::bail!(
            "the project CA is not here: {shown} holds no {CA_CERT} / {CA_KEY}. Run this from the folder that holds \
             the CA folder, or give it with --dir <project>/ca (`anchorage provision` makes it beside project.toml, \
             as its `ca` key says). Only for a new project: `anchorage ca init --dir <dir>`"
        );
    }
    anchorage_pki::ProjectCa::open(dir)
}

/// `ca renew` of an id whose every certificate is revoked: refused unless `force`, saying when
/// it was revoked and what `--force` does. Returns whether the id was revoked (and forced).
fn renew_revoked(issued: &[anchorage_pki::Issued], id: &str, force: bool) -> anyhow::Result<bool> {
    let of_id: Vec<_> = issued.iter().filter(|i| i.id == id).collect();
    let Some(last) = of_id.iter().filter_map(|i| i.revoked_at).max() else { return Ok(false) };
    if of_id.iter().any(|i| i.revoked_at.is_none()) {
        return Ok(false);
    }
    let when = anchorage_pki::site::date(last);
    if force {
        eprintln!(
            "warning: `{id}` was revoked on {when}; --force issues it a valid certificate (its old ones stay revoked)"
        );
        return Ok(true);
    }
    anyhow::bail!(
        "`{id}` was revoked on {when} (every certificate of it; see `anchorage ca list`): a renewed certificate would \
         let it back in. There is no un-revoke: if the site is to be trusted again, run `anchorage ca renew {id} \
         --force` (its old certificates stay revoked); a lost or stolen device should get a new id instead"
    )
}

pub(crate) fn run(command: CaCommand) -> anyhow::Result<()> {
    use anchorage_pki::{Kind, ProjectCa};
    let site = |out: Option<PathBuf>, id: &str| out.unwrap_or_else(|| PathBuf::from(id));
    match command {
        CaCommand::Init { dir, name, days } => {
            ProjectCa::init(&dir, &name, days)?;
            println!(
                "project CA `{name}` in {}: give every site {}/ca.der; ca.key stays here",
                dir.display(),
                dir.display()
            );
        }
        CaCommand::Issue { kind, id, names, site: SiteArgs { days, out, dir } } => {
            let mut ca = open_ca(&dir)?;
            let kind = match kind {
                KindArg::Server => Kind::Server,
                KindArg::Client => Kind::Client,
                KindArg::Relay => Kind::Relay,
            };
            let out = site(out, &id);
            let issued = anchorage_pki::site::issue(&mut ca, kind, &id, &names, days, &out)?;
            println!(
                "issued `{id}` (serial {}, expires {}): {}/cert.der, key.der (0600), ca.der{}",
                issued.serial,
                anchorage_pki::site::date(issued.not_after),
                out.display(),
                if kind.serves() { ", revoked.crl" } else { "" }
            );
        }
        CaCommand::Revoke { id, serial, dir } => {
            let mut ca = open_ca(&dir)?;
            for r in ca.revoke_where(&id, serial.as_deref())? {
                println!("revoked `{id}` (serial {})", r.serial);
            }
            println!(
                "revocation list: {}\ncopy it over the server's tls_dir/revoked.crl (a provisioned server: its folder's \
                 revoked.crl); the running server re-reads it within seconds, refuses the certificate and closes its \
                 connections, no restart needed",
                dir.join(anchorage_pki::CRL).display()
            );
        }
        CaCommand::List { dir } => print!("{}", anchorage_pki::site::list_table(open_ca(&dir)?.issued())),
        CaCommand::Renew { id, names, force, site: SiteArgs { days, out, dir } } => {
            let mut ca = open_ca(&dir)?;
            let was_revoked = renew_revoked(ca.issued(), &id, force)?;
            let out = site(out, &id);
            let issued = anchorage_pki::site::renew(&mut ca, &id, &names, days, &out)?;
            let old = if was_revoked {
                "its old certificates stay revoked"
            } else {
                "the old certificate stays valid until it expires (`anchorage ca revoke` ends it and this one too)"
            };
            println!(
                "renewed `{id}` (serial {}, expires {}) in {}: restart the site to use it; {old}",
                issued.serial,
                anchorage_pki::site::date(issued.not_after),
                out.display()
            );
        }
    }
    Ok(())
}

pub(crate) fn provision(project: &Path, out: Option<&Path>) -> anyhow::Result<()> {
    let done = anchorage::provision::provision(project, out)?;
    let verb = if done.ca_created { "made" } else { "used" };
    println!("{verb} the project CA in {} (ca.key stays there)", done.ca_dir.display());
    for site in &done.sites {
        let key = match site.key {
            anchorage::provision::SiteKey::Issued => "new certificate and key",
            anchorage::provision::SiteKey::Kept => "certificate and key kept",
        };
        println!("  {:<24} {} ({key})", site.id, site.config.display());
    }
    let server = &done.sites[0];
    println!(
        "copy each folder to its machine, then start\n  anchorage-server --config {}/server.toml\n  anchorage-client --config <device>/client.toml",
        server.dir.file_name().map_or("server".into(), |n| n.to_string_lossy())
    );
    Ok(())
}
