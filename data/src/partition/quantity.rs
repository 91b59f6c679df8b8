//! Quantity skew: clients hold IID samples but in amounts drawn from Dirichlet(β) (small β: a few
//! clients hold most of the data).

use anchorage_shared::rng::Rng;

use super::MAX_REDRAWS;
use super::split::deal;
use crate::DataError;

/// Client amounts from Dir(β, …, β) (redrawn, at most [`MAX_REDRAWS`] times, until every client
/// has `min_per_client`), dealt from a seeded shuffle of `0..len`. Each part is sorted.
pub fn quantity_skew(
    len: usize,
    num_clients: usize,
    beta: f64,
    min_per_client: usize,
    seed: u64,
) -> Result<Vec<Vec<usize>>, DataError> {
    if num_clients == 0 || !(beta.is_finite() && beta > 0.0) {
        return Err(DataError::Invalid(format!("need clients > 0 and a finite β > 0 (got {num_clients}, β = {beta})")));
    }
    if len < num_clients * min_per_client {
        return Err(DataError::TooFewSamples { len, num_clients, min_per_client });
    }
    let mut rng = Rng::derive(seed, 0x9A7);
    let mut idx: Vec<usize> = (0..len).collect();
    rng.shuffle(&mut idx);
    for _ in 0..MAX_REDRAWS {
        let shares = rng.dirichlet(beta, num_clients);
        let mut parts = deal(&idx, &shares);
        if parts.iter().all(|p| p.len() >= min_per_client) {
            parts.iter_mut().for_each(|p| p.sort_unstable());
            return Ok(parts);
        }
    }
    Err(DataError::MinPerClientUnmet { num_clients, min_per_client, alpha: beta, attempts: MAX_REDRAWS })
}
