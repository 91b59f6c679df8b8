#!/usr/bin/env python3
"""Reference values for the RDP accountant in `accountant.rs` (issue 34, item 3).

Prints, as Rust table rows, what Google's dp-accounting (`pip install dp-accounting`) gives for the
Poisson-sampled Gaussian mechanism at the same RDP orders the Rust code uses. How to run it:

    python3 -m venv /tmp/dpvenv && /tmp/dpvenv/bin/pip install dp-accounting==0.6.0
    /tmp/dpvenv/bin/python shared/src/privacy/reference.py

Four tables: RDP at single orders (both the integer and the fractional series), epsilon after
homogeneous rounds, epsilon after a heterogeneous run, and the noise multiplier for a target epsilon
(dp-accounting's own `calibrate_dp_mechanism`, Brent's method, tol 1e-12).
"""
import importlib.metadata

from absl import logging
import dp_accounting
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp

# Our DEFAULT_ORDERS, spelled out; it must be dp-accounting's DEFAULT_RDP_ORDERS.
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
assert ORDERS == list(rdp.DEFAULT_RDP_ORDERS), "dp-accounting changed its default orders"
DELTA = 1e-5


def event(q, sigma):
    gauss = dp_event.GaussianDpEvent(sigma)
    return gauss if q == 1.0 else dp_event.PoissonSampledDpEvent(q, gauss)


def eps(steps):
    """steps: [(q, sigma, rounds)] composed in order -> (epsilon, best order)."""
    acc = rdp.RdpAccountant(ORDERS)
    for q, sigma, rounds in steps:
        acc.compose(event(q, sigma), rounds)
    return acc.get_epsilon_and_optimal_order(DELTA)


def sigma_for(q, rounds, target):
    return dp_accounting.calibrate_dp_mechanism(
        lambda: rdp.RdpAccountant(ORDERS),
        lambda s: dp_event.SelfComposedDpEvent(event(q, s), rounds),
        target, DELTA,
        dp_accounting.LowerEndpointAndGuess(0.05, 1.0), tol=1e-12)


def main():
    # dp-accounting warns (absl) each time its fractional-order series does not converge in 1000
    # steps and drops that order (RDP = inf); the Rust code does the same, so the warnings are noise.
    logging.set_verbosity(logging.ERROR)
    print(f"// dp-accounting {importlib.metadata.version('dp-accounting')}, delta = {DELTA!r}")
    print("// RDP: (q, sigma, order, rdp of one round)")
    for q, sigma in [(0.01, 1.1), (0.1, 0.5), (0.1, 4.0), (1.0, 1.0)]:
        for order in [1.5, 2, 3.7, 10.5, 32, 1024]:
            r = rdp._compute_rdp_poisson_subsampled_gaussian(q, sigma, [order])[0]
            print(f"    ({q!r}, {sigma!r}, {float(order)!r}, {float(r)!r}),")
    print("// epsilon: (q, sigma, rounds, epsilon, best order)")
    for q, sigma, rounds in [
        (0.01, 1.1, 1), (0.01, 1.1, 100), (0.01, 1.1, 1000), (0.01, 0.5, 1000),
        (0.01, 4.0, 1000), (0.1, 1.0, 1), (0.1, 1.0, 100), (0.1, 0.5, 100),
        (0.1, 1.1, 1000), (0.1, 4.0, 1000), (1.0, 1.0, 1), (1.0, 4.0, 100),
        (1.0, 1.1, 1000), (1.0, 0.5, 1),
    ]:
        e, order = eps([(q, sigma, rounds)])
        print(f"    ({q!r}, {sigma!r}, {rounds}, {float(e)!r}, {float(order)!r}),")
    print("// heterogeneous: 100 rounds (0.01, 1.1), then 10 rounds (0.1, 4.0), then 1 round (1.0, 4.0)")
    e, order = eps([(0.01, 1.1, 100), (0.1, 4.0, 10), (1.0, 4.0, 1)])
    print(f"    ({float(e)!r}, {float(order)!r}),")
    print("// sigma for target epsilon: (q, rounds, target epsilon, sigma)")
    for q, rounds, target in [(0.01, 1000, 1.0), (0.1, 100, 3.0), (1.0, 10, 8.0)]:
        print(f"    ({q!r}, {rounds}, {target!r}, {sigma_for(q, rounds, target)!r}),")


if __name__ == "__main__":
    main()
