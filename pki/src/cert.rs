//! Reading certificates and revocation lists: the one definition of a device's id.

use anyhow::Context;
use rustls::pki_types::CertificateDer;
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;

/// Serial bytes as the CA's index and the revocation checks compare them: lowercase hex without
/// leading zeros.
pub fn serial_hex(bytes: &[u8]) -> String {
    let trimmed: Vec<u8> = bytes.iter().copied().skip_while(|b| *b == 0).collect();
    trimmed.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse(der: &[u8]) -> anyhow::Result<X509Certificate<'_>> {
    Ok(x509_parser::parse_x509_certificate(der).context("the certificate does not parse")?.1)
}

/// The id a certificate was issued to: its first DNS subject alternative name (the CA puts the
/// id there first, `ca::ProjectCa::issue`). `None` when it names none.
pub fn device_id(x509: &X509Certificate<'_>) -> Option<String> {
    x509.subject_alternative_name().ok().flatten().and_then(|san| {
        san.value.general_names.iter().find_map(|n| match n {
            GeneralName::DNSName(s) => Some(s.to_string()),
            _ => None,
        })
    })
}

/// The organizational unit a relay's certificate carries in its subject: the role
/// that lets a peer send partial aggregates. Only the project CA signs subjects, so a device
/// cannot claim it.
pub const RELAY_UNIT: &str = "anchorage-relay";

/// Whether a certificate carries the relay role ([`RELAY_UNIT`]); `false` for one that does not parse.
pub fn is_relay(der: &[u8]) -> bool {
    parse(der).is_ok_and(|x509| {
        x509.subject().iter_organizational_unit().any(|ou| ou.as_str().is_ok_and(|s| s == RELAY_UNIT))
    })
}

/// The id a peer's certificate was issued to ([`device_id`]) and its serial ([`serial_hex`]).
pub fn peer_id(cert: &CertificateDer<'_>) -> anyhow::Result<(String, String)> {
    let x509 = parse(cert.as_ref())?;
    let serial = serial_hex(x509.tbs_certificate.raw_serial());
    let id = device_id(&x509).context("the certificate names no id (no DNS subject alternative name)")?;
    Ok((id, serial))
}

/// The DNS names and IP addresses a certificate is issued for, the id first.
pub fn cert_names(der: &[u8]) -> anyhow::Result<Vec<String>> {
    let cert = parse(der)?;
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
pub fn issued_by(der: &[u8], ca_der: &[u8]) -> anyhow::Result<bool> {
    let cert = parse(der)?;
    let root = x509_parser::parse_x509_certificate(ca_der).context("the CA certificate does not parse")?.1;
    Ok(cert.issuer().as_raw() == root.subject().as_raw())
}

/// What a certificate says, as `doctor` and `check-config` show it.
#[derive(Debug, Clone, PartialEq)]
pub struct CertInfo {
    /// [`device_id`]: the id the server knows the holder by.
    pub id: Option<String>,
    /// [`serial_hex`].
    pub serial: String,
    /// Start of the validity period, Unix seconds.
    pub not_before: i64,
    /// End of the validity period, Unix seconds.
    pub not_after: i64,
    /// End of the validity period as x509-parser prints it.
    pub not_after_text: String,
}

/// Reads a DER certificate.
pub fn cert_info(der: &[u8]) -> anyhow::Result<CertInfo> {
    let (_, x509) =
        x509_parser::parse_x509_certificate(der).map_err(|e| anyhow::anyhow!("not a DER certificate: {e}"))?;
    let v = x509.validity();
    Ok(CertInfo {
        id: device_id(&x509),
        serial: serial_hex(x509.tbs_certificate.raw_serial()),
        not_before: v.not_before.timestamp(),
        not_after: v.not_after.timestamp(),
        not_after_text: v.not_after.to_string(),
    })
}

/// The serial numbers a CRL revokes (hex, as [`serial_hex`]).
pub fn revoked_serials(crl: &[u8]) -> anyhow::Result<std::collections::BTreeSet<String>> {
    let (_, crl) = x509_parser::parse_x509_crl(crl).context("the revocation list does not parse")?;
    Ok(crl.iter_revoked_certificates().map(|r| serial_hex(r.raw_serial())).collect())
}
