//! kakeyaturbo: a block transform codec for the K and V tensors of an LLM's attention cache.
//!
//! Two modes of one codec, each split by job, arrows running one way (top to bottom):
//!
//! - [`perblock`]: [`perblock::params`] -> [`perblock::block`] (stages 1-5 on one block) ->
//!   [`perblock::decode`] (and back) -> [`perblock::layer`] (blocks, threads) ->
//!   [`perblock::container`] (`KKYT` bytes);
//! - [`calibrated`]: [`calibrated::calibration`] (checked once per model, fingerprinted) ->
//!   [`calibrated::codec`] (rows to codes) -> [`calibrated::container`] (`KKYC` bytes).
//!
//! Below them: the stages [`pca`], [`kmeans`], [`wht`], [`quant`], [`pack`], with [`rng`] the
//! project's own generator and [`mod@f16`] the fp16 storage rules; [`gemm`] faer's product with
//! the registers cleared after it; [`metric`] the scale rule both
//! modes share; [`bytes`] the one byte writer and reader of both containers; [`limits`] the
//! documented limits and input checks; [`threads`] the bounded thread pools; [`error`] the one
//! error type. `FORMAT.md` specifies the bytes.

pub mod attention;
pub mod bytes;
pub mod calibrated;
pub mod cpu;
pub mod error;
pub mod f16;
pub mod gemm;
pub mod kmeans;
pub mod limits;
pub mod metric;
pub mod pack;
pub mod pca;
pub mod perblock;
pub mod quant;
mod quant_tables;
pub mod rng;
mod stack;
pub mod team;
pub mod threads;
pub mod wht;

pub use calibrated::{CalibratedCodec, CalibratedCodes, CalibratedParams};
pub use error::{Error, Result};
pub use limits::MAX_DIM;
pub use metric::Metric;
pub use pca::PcaMethod;
pub use perblock::{
    decode_layer, encode_layer, from_bytes, to_bytes, ByteBreakdown, CodecParams, EncodedLayer,
    SkeletonDtype,
};
pub use threads::with_threads;
