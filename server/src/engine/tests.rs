//! Engine tests on a fake clock.
