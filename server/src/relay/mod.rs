//! The relay role (issue 37; DESIGN.md, "one engine, three roles"): the round engine with a
//! parent. A relay's engine opens a round when its parent's broadcast arrives
//! ([`crate::Engine::relay`], [`crate::Engine::handle_parent_round`]), forwards that broadcast to
//! the devices it samples, screens and bounds their updates as the root would, and when the
//! round closes folds them into one partial aggregate ([`fold`]) that goes up as one
//! participant's update, weighted by its devices' total. The partial is the relay method's state,
//! so it is durable in the same transaction as the round's close ([`partial_of`]).
//!
//! Only methods whose server half aggregates sums can sit behind relays (the registry's
//! `relays`), under the sample-weighted mean: a median of medians is not the median.

mod partial;
#[cfg(test)]
mod tests;
pub mod uplink;

pub use partial::{RelayMethod, fold, partial_of};

use anchorage_shared::method::{MethodConfig, info};
use anchorage_shared::protocol::{Capabilities, Hello, Message};

use crate::aggregate::AggregationRule;
use crate::engine::{AggregationMode, EngineConfig};

/// A relay's hello to its parent: its id, the federation's method, and the last round it closed.
pub fn hello(relay_id: &str, method: &str, last_round: Option<u64>) -> Message {
    let mut methods = heapless::Vec::new();
    let _ = methods.push(heapless::String::try_from(method).unwrap_or_default());
    Message::Hello(Box::new(Hello {
        client_id: relay_id.into(),
        capabilities: Capabilities { backend: "relay".into(), memory_mb: 0, methods },
        num_samples: 1,
        last_round,
    }))
}

/// A root's refusal of a partial aggregate whose devices another relay's accepted partial holds:
/// the detail names every such device after [`DUPLICATES`], so that the relay can fold its
/// round again without them ([`duplicate_devices`]).
pub fn duplicate_detail(round: u64, devices: &[String]) -> String {
    format!(
        "round {round}: another relay's partial aggregate holds {} of these devices already{DUPLICATES}{}",
        devices.len(),
        devices.join(" ")
    )
}

const DUPLICATES: &str = "; devices: ";

/// The devices a [`duplicate_detail`] names; `None` for any other detail.
pub fn duplicate_devices(detail: &str) -> Option<Vec<String>> {
    let (_, list) = detail.split_once(DUPLICATES)?;
    Some(list.split(' ').filter(|d| !d.is_empty()).map(String::from).collect())
}

/// Why a relay cannot run `method` under `config`; `Ok` when it can. The same check runs at the
/// root for a federation that takes relays.
pub fn check(config: &EngineConfig, method: &MethodConfig) -> Result<(), String> {
    let entry = info(method.name()).ok_or_else(|| format!("unknown method `{}`", method.name()))?;
    (entry.relays)(method).map_err(String::from)?;
    if config.robust.aggregation != AggregationRule::Mean {
        return Err(format!(
            "[engine.robust] aggregation = {}: a relay's partial aggregate is a weighted sum, and only the \
             sample-weighted mean of partial sums is the mean over the devices",
            config.robust.aggregation.name()
        ));
    }
    if config.mode != AggregationMode::Synchronous {
        return Err("a relay runs synchronous rounds: its parent opens them".into());
    }
    if config.secagg.enabled || config.privacy.is_on() {
        return Err("secure aggregation and differential privacy run between the devices and the root, \
                    not behind a relay (not supported yet)"
            .into());
    }
    Ok(())
}
