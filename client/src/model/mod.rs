//! Models: a frozen backbone and trainable named blocks.
//!
//! The edge default: the backbone never trains, so its features are computed once per sample
//! ([`FeatureCache`]) and every epoch of the small trainable parts runs on cached features.
//! Trainable parts travel as named parameter blocks (`adapter.0.weight`, `head.bias`, ...).

mod blocks;
mod cache;
mod mlp;

pub use blocks::{BlockLayout, ModelError};
pub use cache::FeatureCache;
pub use mlp::{FrozenBackbone, ModelSpec, Trainable};
