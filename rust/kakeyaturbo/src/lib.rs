//! kakeyaturbo: a block transform codec for the K and V tensors of an LLM's attention cache.
//!
//! Data flows one way: a row-major `[N, D]` float32 tensor -> [`layer`] (blocks, threads) ->
//! [`block`] (stages 1-5) -> [`container`] bytes; decoding runs the reverse. The stages live in
//! their own modules: [`pca`], [`kmeans`], [`wht`], [`quant`], [`pack`], with [`rng`] the
//! project's own generator and [`f16`] the fp16 storage rules. `FORMAT.md` specifies the bytes.

pub mod block;
pub mod calibrated;
pub mod container;
pub mod error;
pub mod f16;
pub mod kmeans;
pub mod layer;
pub mod pack;
pub mod params;
pub mod pca;
pub mod quant;
mod quant_tables;
pub mod rng;
pub mod wht;

pub use container::{from_bytes, to_bytes, ByteBreakdown};
pub use error::{Error, Result};
pub use layer::{decode_layer, encode_layer, EncodedLayer};
pub use params::{CodecParams, Metric, SkeletonDtype};
pub use pca::PcaMethod;
