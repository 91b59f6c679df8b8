//! A site folder's identity files, as `anchorage ca issue|renew` and `anchorage provision` write
//! them: `cert.der`, `key.der` (mode 0600), `ca.der`, and for a server the CA's `revoked.crl`.
//! Keys are secrets, the rest is not: every other file is mode 0644 and the folder 0755, whatever
//! the umask, so that `cp site/* /etc/anchorage/` and a `chown` of `key.der` to the service's user
//! (deploy/README.md) give that user everything it reads.

use std::path::Path;

use anyhow::Context;

use crate::ca::{CA_CERT, CRL, Issued, Kind, ProjectCa};
use crate::cert::cert_names;
use crate::identity::{CERT_FILE, Identity, KEY_FILE, save_identity};
use crate::unix_now;

/// `YYYY-MM-DD` (UTC) of a unix time.
pub fn date(unix: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp(unix).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!("{:04}-{:02}-{:02}", t.year(), t.month() as u8, t.day())
}

/// Mode of what a site's service reads but need not hide: certificates, the revocation list,
/// configs and the initial model. Only `key.der` is a secret (0600, written so from the start).
pub const PUBLIC_MODE: u32 = 0o644;
/// Mode of a site folder: listable by the service's user wherever the folder is mounted as it is
/// (a container's `-v site:/etc/anchorage:ro`); its key stays 0600.
pub const SITE_DIR_MODE: u32 = 0o755;

/// Sets `path`'s mode, whatever the umask or an older provision left.
pub fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {} to {mode:04o}", path.display()))
}

/// Writes a file every local user may read (mode [`PUBLIC_MODE`]).
pub fn write_public(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))?;
    set_mode(path, PUBLIC_MODE)
}

/// Writes `identity` and the CA's certificate into the site folder `out`: `cert.der`, `key.der`
/// (mode 0600) and `ca.der` (both 0644, the folder 0755).
pub fn write_site_identity(out: &Path, identity: &Identity, ca_cert: &[u8]) -> anyhow::Result<()> {
    save_identity(out, identity)?;
    set_mode(out, SITE_DIR_MODE)?;
    set_mode(&out.join(CERT_FILE), PUBLIC_MODE)?;
    write_public(&out.join(CA_CERT), ca_cert)
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
    for file in [CERT_FILE, KEY_FILE] {
        anyhow::ensure!(
            !out.join(file).exists(),
            "{} already exists: `anchorage ca renew {id}` replaces a site's certificate and key on purpose",
            out.join(file).display()
        );
    }
    let identity = ca.issue(kind, id, names, days)?;
    write_site_identity(out, &identity, ca.cert().as_ref())?;
    if kind.serves() {
        write_server_crl(ca, out)?;
    }
    ca.issued().last().cloned().context("the CA recorded no certificate just issued")
}

/// A server's folder gets the CA's revocation list as it is now (even an empty one): a CA-mode
/// server does not start without it.
fn write_server_crl(ca: &ProjectCa, out: &Path) -> anyhow::Result<()> {
    let path = out.join(CRL);
    anchorage_shared::io::write_atomic(&path, ca.crl()?.as_ref())
        .with_context(|| format!("writing {}", path.display()))?;
    set_mode(&path, PUBLIC_MODE)
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
        match std::fs::read(out.join(CERT_FILE)) {
            Ok(der) => cert_names(&der)?.into_iter().filter(|n| n != id).collect(),
            Err(_) => Vec::new(),
        }
    } else {
        names.to_vec()
    };
    let identity = ca.issue(previous.kind, id, &names, days)?;
    write_site_identity(out, &identity, ca.cert().as_ref())?;
    if previous.kind.serves() {
        write_server_crl(ca, out)?;
    }
    ca.issued().last().cloned().context("the CA recorded no certificate just issued")
}

/// `anchorage ca list`: one line per certificate the CA issued.
pub fn list_table(issued: &[Issued]) -> String {
    let now = unix_now();
    let mut rows = vec![["id".to_string(), "kind".into(), "serial".into(), "expires".into(), "revoked".into()]];
    for i in issued {
        let expires = if i.not_after < now { format!("{} (expired)", date(i.not_after)) } else { date(i.not_after) };
        let kind = i.kind.name();
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

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
    fn ca_issue_list_revoke_and_renew() {
        let dir = tempfile::tempdir().unwrap();
        let ca_dir = dir.path().join("ca");
        let mut ca = ProjectCa::init(&ca_dir, "unit", 100).unwrap();
        let out = dir.path().join("server");
        let first = issue(&mut ca, Kind::Server, "server", &["fl.example.org".into()], 10, &out).unwrap();
        assert_eq!(mode(&out.join("key.der")), 0o600);
        for public in ["cert.der", "ca.der", CRL] {
            assert_eq!(mode(&out.join(public)), 0o644, "{public}: the service's user reads it after a copy");
        }
        assert_eq!(mode(&out), 0o755);
        assert_eq!(std::fs::read(out.join("ca.der")).unwrap(), ca.cert().as_ref());
        // A server's folder gets the CA's (empty) revocation list: the server does not start without it.
        let crl = std::fs::read(out.join(CRL)).expect("`ca issue server` writes revoked.crl");
        assert!(crate::cert::revoked_serials(&crl).unwrap().is_empty());
        let err = issue(&mut ca, Kind::Server, "server", &[], 10, &out).unwrap_err().to_string();
        assert!(err.contains("ca renew server"), "an issued pair is not overwritten: {err}");
        let edge = dir.path().join("edge-001");
        issue(&mut ca, Kind::Client, "edge-001", &[], 10, &edge).unwrap();
        assert!(!edge.join(CRL).exists(), "a device needs no revocation list");

        // Renew: same id and kind, a later expiry, a new key, the server's names kept.
        let old_key = std::fs::read(out.join("key.der")).unwrap();
        let mut ca = ProjectCa::open(&ca_dir).unwrap();
        let renewed = renew(&mut ca, "server", &[], 60, &out).unwrap();
        assert_eq!((renewed.kind, renewed.id.as_str()), (Kind::Server, "server"));
        assert!(renewed.not_after > first.not_after + 40 * 86_400 && renewed.serial != first.serial);
        assert_ne!(std::fs::read(out.join("key.der")).unwrap(), old_key);
        assert_eq!(mode(&out.join("key.der")), 0o600);
        for public in ["cert.der", "ca.der", CRL] {
            assert_eq!(mode(&out.join(public)), 0o644, "{public} after renew");
        }
        let cert = std::fs::read(out.join("cert.der")).unwrap();
        assert_eq!(cert_names(&cert).unwrap(), ["server", "fl.example.org"]);
        assert!(renew(&mut ca, "nobody", &[], 10, &out).is_err());

        // Revoke: the CRL lists every certificate of the id; list shows it.
        let revoked = ca.revoke("server").unwrap();
        assert_eq!(revoked.len(), 2);
        let crl = std::fs::read(ca_dir.join(CRL)).unwrap();
        let serials = crate::cert::revoked_serials(&crl).unwrap();
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
