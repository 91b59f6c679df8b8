//! anchorage-sim: one server and N clients in one process, talking real QUIC over loopback.
//!
//! [`run()`] is what `anchorage sim` does; tests call it directly. The embedded default needs no
//! file and no network: procedural synthetic images made in code, Dirichlet label skew over the
//! clients, FedAvg of a trainable adapter and head on a frozen backbone.

pub mod accuracy;
pub mod compare;
pub mod config;
pub mod continual;
pub mod device;
pub mod export;
pub mod fleet;
pub mod microbench;
pub mod network;
pub mod power;
pub mod progress;
mod record;
pub mod recorder;
pub mod report;
mod run;
pub mod scenario;
mod setup;
pub mod swarm;
pub mod sweep;
pub mod virtual_clock;

pub use config::{
    Attack, ClientLink, Clock, DataConfig, FederationConfig, KillAt, LinkShare, OutputConfig, SimConfig, SystemsConfig,
};
pub use record::{RoundRow, RunStatus, RunSummary, claim_run_folder, percent, run_folder_name, write_run_folder};
pub use record::{SimResult, TierOutcome};
pub use run::{run, run_on_clock, run_recorded};
