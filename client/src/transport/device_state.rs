//! The method's device state across restarts: restored at start, saved after each trained round.

use anyhow::Context;

use crate::methods::ClientMethod;
use crate::store::ClientStore;

/// Gives the method the device state saved before a restart. A state file that cannot be read
/// back (the store sets it aside) or that the method refuses (another method or model; set aside
/// here) is reported with a warning and the method starts fresh; an unreadable disk is an error.
pub(super) fn restore_device_state(
    store: &ClientStore,
    method: &mut dyn ClientMethod,
    client: &str,
) -> anyhow::Result<()> {
    let Some(blocks) = store.load_device_state().context("loading the device state")? else { return Ok(()) };
    match method.restore_device_state(&blocks) {
        Ok(()) => tracing::info!(client, blocks = blocks.len(), "device state restored"),
        Err(e) => {
            store
                .set_aside_device_state(&format!("the method refused it: {e}"))
                .context("setting the refused device state aside")?;
            tracing::warn!(client, "starting from a fresh device state");
        }
    }
    Ok(())
}

/// Saves the method's device state after a trained round; a failure is logged (the round's
/// update still goes out, and the previous state file stays whole).
pub(super) fn save_device_state(store: &ClientStore, method: &dyn ClientMethod, round: u64) {
    let saved = method.device_state().map_err(|e| e.to_string()).and_then(|blocks| {
        if blocks.is_empty() { Ok(()) } else { store.save_device_state(&blocks).map_err(|e| e.to_string()) }
    });
    if let Err(e) = saved {
        tracing::warn!(round, error = %e, "could not save the device state");
    }
}
