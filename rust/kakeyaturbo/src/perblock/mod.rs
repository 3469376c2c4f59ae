//! The per-block mode: a skeleton (mean, PCA basis, k-means centres) is fitted for every block
//! of rows and stored with it, so a container decodes with nothing but its own bytes.
//!
//! Arrows run one way: [`params`] (the checked parameters) -> [`block`] (one block through
//! stages 1-5) -> [`decode`] (its codes back to rows) -> [`layer`] (a `[N, D]` tensor cut into
//! blocks, coded in parallel) -> [`container`] (the `KKYT` bytes) -> [`many`] (a cache's blocks: many containers in one
//! call).

pub mod block;
pub mod container;
pub mod decode;
pub mod layer;
pub mod many;
pub mod params;

pub use container::{from_bytes, to_bytes, ByteBreakdown};
pub use layer::{decode_layer, encode_layer, EncodedLayer};
pub use params::{CodecParams, SkeletonDtype};
