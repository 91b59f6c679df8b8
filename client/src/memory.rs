//! Peak memory of this process as the kernel counts it (`VmHWM` in `/proc/self/status`), so a
//! client can report what a round really needed on its device. `None` where the kernel does not
//! expose it (non-Linux systems).

/// The peak resident set size so far, in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_hwm(&status)
}

/// `VmHWM:   123456 kB` → bytes.
fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_high_water_mark() {
        assert_eq!(parse_vm_hwm("Name:\tx\nVmHWM:\t   2048 kB\nVmRSS:\t 1 kB\n"), Some(2048 * 1024));
        assert_eq!(parse_vm_hwm("Name:\tx\n"), None);
        assert_eq!(parse_vm_hwm("VmHWM:\tlots kB\n"), None);
    }

    #[test]
    fn this_process_has_a_peak() {
        if cfg!(target_os = "linux") {
            let before = peak_rss_bytes().expect("Linux exposes VmHWM");
            let big = vec![1u8; 64 << 20];
            std::hint::black_box(&big);
            let after = peak_rss_bytes().unwrap();
            // The high-water mark never falls and covers the 64 MiB held right now (other tests in
            // this process may have raised it further already).
            assert!(before > 1 << 20 && after >= before && after >= 64 << 20, "{before} → {after}");
        }
    }
}
