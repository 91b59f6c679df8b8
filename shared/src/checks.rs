//! What the programs' pre-start checks report (`anchorage-server check-config`,
//! `anchorage-client check-config` and `doctor`): one line per check, then the program's verdict.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Display;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Passed.
    Ok,
    /// Works, but needs attention (a certificate about to expire, a key others can read).
    Warn,
    /// Not checked, and why is in the detail.
    Skip,
    /// Failed.
    Fail,
}

impl Status {
    /// The word its line starts with.
    pub fn word(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Skip => "skip",
            Status::Fail => "FAIL",
        }
    }
}

/// One check's finding.
#[derive(Debug, Clone)]
pub struct Check {
    /// The check's name, the second column of its line.
    pub name: &'static str,
    /// How it came out.
    pub status: Status,
    /// What it found, or why it was skipped or failed.
    pub detail: String,
}

impl Check {
    /// A finding.
    pub fn new(name: &'static str, status: Status, detail: impl Into<String>) -> Self {
        Self { name, status, detail: detail.into() }
    }

    /// `Ok` with the detail, or `Fail` with the error and its causes (`{e:#}`).
    pub fn outcome<E: Display>(name: &'static str, result: Result<String, E>) -> Self {
        match result {
            Ok(detail) => Self::new(name, Status::Ok, detail),
            Err(e) => Self::new(name, Status::Fail, format!("{e:#}")),
        }
    }
}

/// Everything the checks found, and how the program words its verdict.
#[derive(Debug, Clone)]
pub struct Report {
    /// The findings, in the order the lines are rendered.
    pub checks: Vec<Check>,
    verdict: fn(&Report) -> String,
}

impl Report {
    /// An empty report whose last line is `verdict` of it.
    pub fn new(verdict: fn(&Report) -> String) -> Self {
        Self { checks: Vec::new(), verdict }
    }

    /// Whether any check failed.
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Status::Fail)
    }

    /// The names of the checks that failed, joined by ", ".
    pub fn failed_names(&self) -> String {
        let names: Vec<&str> = self.checks.iter().filter(|c| c.status == Status::Fail).map(|c| c.name).collect();
        names.join(", ")
    }

    /// How many checks came out `status`.
    pub fn count(&self, status: Status) -> usize {
        self.checks.iter().filter(|c| c.status == status).count()
    }

    /// The check named `name`, if there is one.
    pub fn get(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// One line per check, then the verdict.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            out.push_str(&format!("  {:<5} {:<12} {}\n", c.status.word(), c.name, c.detail));
        }
        out.push_str(&(self.verdict)(self));
        out.push('\n');
        out
    }
}
