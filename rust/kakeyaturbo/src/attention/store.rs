//! The sealed codes attention reads: per stream of one (batch row, kv-head) a list of `KKYC`
//! containers, each parsed and checked once when it is appended, then held as its bytes plus a
//! few offsets into them. A decode step reads the bytes in place: no container is parsed and
//! no checksum computed again. Memory is the containers' bytes plus O(1) per block.

use super::tables::StreamTables;
use crate::error::{input, param, Error, Result};
use crate::limits::MAX_STORES;
use crate::pack::{checked_packed_len, index_bits};
use std::sync::Arc;

/// Bytes of a calibrated container's header (FORMAT.md: magic, version, flags, metric, n, d,
/// m, row_bytes, fingerprint, outlier count).
const HEADER: usize = 4 + 2 + 1 + 1 + 8 + 4 + 4 + 4 + 8 + 4;

/// A container's bytes as a block holds them: its own, or shared with another owner that
/// keeps them unchanged for as long as the block lives (the binding shares the Python `bytes`
/// object the cache keeps, so a sealed block is held once, not twice).
pub struct Blob(Box<dyn AsRef<[u8]> + Send + Sync>);

impl Blob {
    /// Bytes shared with their owner (not copied).
    pub fn shared(bytes: impl AsRef<[u8]> + Send + Sync + 'static) -> Self {
        Self(Box::new(bytes))
    }
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        (*self.0).as_ref()
    }
}

impl From<Vec<u8>> for Blob {
    fn from(v: Vec<u8>) -> Self {
        Self(Box::new(v))
    }
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Blob({} bytes)", self.as_slice().len())
    }
}

/// One sealed block: its container bytes and where its fields lie in them.
#[derive(Debug)]
pub struct SealedBlock {
    blob: Blob,
    pub(crate) n: usize,
    pub(crate) scale_exp: i8,
    /// Offset of the `n` fp16 scale mantissas (None without `norm`).
    pub(crate) scales_at: Option<usize>,
    pub(crate) codes_at: usize,
    pub(crate) outliers: usize,
    pub(crate) opos_at: usize,
    pub(crate) opos_bits: u32,
    pub(crate) oval_at: usize,
}

impl SealedBlock {
    /// Parses and checks a container of the tables' calibration (everything its reader
    /// checks, plus that every scale is a float32 number). The bytes are kept as given.
    pub fn parse(tables: &StreamTables, blob: impl Into<Blob>) -> Result<Self> {
        let blob: Blob = blob.into();
        let bytes = blob.as_slice();
        let c = tables.codec.from_bytes(bytes)?;
        let (n, m, rb) = (c.n, tables.m, tables.row_bytes);
        let (scales_at, scale_exp) = match &c.scale {
            Some(s) => {
                if let Some(i) = s.decode().iter().position(|g| !g.is_finite()) {
                    return input(format!(
                        "row {i} of the block has a scale beyond the float32 range; attention \
                         over the codes needs float32 scales (decode such rows instead)"
                    ));
                }
                (Some(HEADER + 1), s.exp)
            }
            None => (None, 0),
        };
        let codes_at = HEADER + scales_at.map_or(0, |_| 1 + 2 * n);
        let opos_bits = index_bits(n * m);
        let opos_at = codes_at + n * rb;
        let oval_at = opos_at
            + checked_packed_len(c.outlier_pos.len(), opos_bits)
                .ok_or_else(|| Error::Corrupt("outlier positions overflow".into()))?;
        let end = oval_at + 2 * c.outlier_pos.len();
        // The reader accepted the bytes; the offsets must describe exactly what it read.
        let same = end + crate::bytes::CRC_LEN == bytes.len()
            && bytes.get(codes_at..opos_at) == Some(&c.codes[..])
            && c.scale.as_ref().is_none_or(|s| {
                bytes[HEADER] as i8 == s.exp
                    && s.bits.iter().enumerate().all(|(i, &h)| {
                        u16::from_le_bytes([bytes[HEADER + 1 + 2 * i], bytes[HEADER + 2 + 2 * i]])
                            == h
                    })
            });
        if !same {
            return Err(Error::Corrupt(
                "the container's layout is not the one attention reads".into(),
            ));
        }
        let b = Self {
            blob,
            n,
            scale_exp,
            scales_at,
            codes_at,
            outliers: c.outlier_pos.len(),
            opos_at,
            opos_bits,
            oval_at,
        };
        debug_assert!((0..b.outliers).all(|i| b.outlier(i)
            == (
                c.outlier_pos[i],
                half::f16::from_bits(c.outlier_val[i]).to_f32()
            )));
        Ok(b)
    }

    /// The container bytes.
    pub fn bytes(&self) -> &[u8] {
        self.blob.as_slice()
    }
    /// Rows in the block.
    pub fn rows(&self) -> usize {
        self.n
    }
    pub(crate) fn blob(&self) -> &[u8] {
        self.blob.as_slice()
    }

    /// The packed indices of row `r` (`row_bytes` bytes).
    #[inline]
    pub(crate) fn row(&self, r: usize, rb: usize) -> &[u8] {
        let at = self.codes_at + r * rb;
        &self.blob()[at..at + rb]
    }

    /// The stored scale of row `r` (1 without `norm`).
    #[inline]
    pub(crate) fn scale(&self, r: usize) -> f32 {
        match self.scales_at {
            Some(at) => {
                let blob = self.blob();
                let h = u16::from_le_bytes([blob[at + 2 * r], blob[at + 2 * r + 1]]);
                crate::f16::from_bits_scaled(h, self.scale_exp)
            }
            None => 1.0,
        }
    }

    /// Outlier `i`: its flat position `row * m + j` and its value.
    #[inline]
    pub(crate) fn outlier(&self, i: usize) -> (u32, f32) {
        let nb = self.opos_bits as usize;
        let bit = i * nb;
        let mut acc = 0u64;
        let first = self.opos_at + bit / 8;
        let last = self.opos_at + (bit + nb).div_ceil(8);
        let blob = self.blob();
        for (k, &byte) in blob[first..last].iter().enumerate() {
            acc |= (byte as u64) << (8 * k);
        }
        let pos = if nb == 0 {
            0
        } else {
            ((acc >> (bit % 8)) & ((1u64 << nb) - 1)) as u32
        };
        let at = self.oval_at + 2 * i;
        let val = half::f16::from_bits(u16::from_le_bytes([blob[at], blob[at + 1]]));
        (pos, val.to_f32())
    }

    /// Index of the first outlier at flat position `>= pos` (binary search over the packed,
    /// ascending positions).
    pub(crate) fn first_outlier_from(&self, pos: u32) -> usize {
        let (mut lo, mut hi) = (0, self.outliers);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.outlier(mid).0 < pos {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

/// The sealed blocks of one stream of one (batch row, kv-head), in position order.
#[derive(Debug, Clone)]
pub struct CodeStore {
    tables: Arc<StreamTables>,
    blocks: Vec<Arc<SealedBlock>>,
    rows: usize,
}

impl CodeStore {
    pub fn new(tables: Arc<StreamTables>) -> Self {
        Self {
            tables,
            blocks: Vec::new(),
            rows: 0,
        }
    }
    pub fn tables(&self) -> &Arc<StreamTables> {
        &self.tables
    }
    /// Appends a container of this store's calibration (parsed and checked here, once).
    pub fn append(&mut self, blob: impl Into<Blob>) -> Result<()> {
        let b = SealedBlock::parse(&self.tables, blob)?;
        self.push(Arc::new(b));
        Ok(())
    }
    fn push(&mut self, b: Arc<SealedBlock>) {
        self.rows += b.n;
        self.blocks.push(b);
    }
    /// Rows held (the sum over blocks).
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn blocks(&self) -> &[Arc<SealedBlock>] {
        &self.blocks
    }
    /// Bytes held: the containers' bytes.
    pub fn nbytes(&self) -> usize {
        self.blocks.iter().map(|b| b.bytes().len()).sum()
    }
    /// Removes and returns the first block.
    pub fn pop_front(&mut self) -> Option<Arc<SealedBlock>> {
        if self.blocks.is_empty() {
            return None;
        }
        let b = self.blocks.remove(0);
        self.rows -= b.n;
        Some(b)
    }
    /// Removes and returns the last block.
    pub fn pop(&mut self) -> Option<Arc<SealedBlock>> {
        let b = self.blocks.pop()?;
        self.rows -= b.n;
        Some(b)
    }
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.rows = 0;
    }
}

/// The sealed K and V codes of one attention layer: a [`CodeStore`] per stream and
/// (batch row, kv-head), each kv-head with its own K and V calibrations.
#[derive(Debug, Clone)]
pub struct LayerCodes {
    batch: usize,
    kv_heads: usize,
    k: Vec<CodeStore>,
    v: Vec<CodeStore>,
}

impl LayerCodes {
    /// Empty stores for `batch` rows; `k_tables[h]`, `v_tables[h]` are kv-head `h`'s
    /// calibrations (every K calibration of one `D`, every V calibration of one `D`).
    pub fn new(
        k_tables: Vec<Arc<StreamTables>>,
        v_tables: Vec<Arc<StreamTables>>,
        batch: usize,
    ) -> Result<Self> {
        let h = k_tables.len();
        if h == 0 || v_tables.len() != h {
            return param(format!(
                "one K and one V calibration per kv-head: got {} and {}",
                h,
                v_tables.len()
            ));
        }
        if batch == 0 {
            return param("batch must be >= 1");
        }
        if batch.saturating_mul(h) > MAX_STORES {
            return param(format!(
                "batch {batch} x {h} kv-heads is more than the {MAX_STORES} (batch row, kv-head) \
                 pairs a layer holds"
            ));
        }
        for (name, t) in [("K", &k_tables), ("V", &v_tables)] {
            if let Some(i) = t.iter().position(|x| x.d != t[0].d) {
                return param(format!(
                    "{name} calibrations of one layer must share D: kv-head 0 has {}, kv-head {i} has {}",
                    t[0].d, t[i].d
                ));
            }
        }
        let mk = |t: &[Arc<StreamTables>]| -> Vec<CodeStore> {
            (0..batch)
                .flat_map(|_| t.iter().map(|x| CodeStore::new(x.clone())))
                .collect()
        };
        Ok(Self {
            batch,
            kv_heads: h,
            k: mk(&k_tables),
            v: mk(&v_tables),
        })
    }
    pub fn batch(&self) -> usize {
        self.batch
    }
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    pub fn k_dim(&self) -> usize {
        self.k[0].tables.d
    }
    pub fn v_dim(&self) -> usize {
        self.v[0].tables.d
    }
    fn at(&self, b: usize, h: usize) -> Result<usize> {
        if b >= self.batch || h >= self.kv_heads {
            return input(format!(
                "(batch row {b}, kv-head {h}) is outside [{}, {}]",
                self.batch, self.kv_heads
            ));
        }
        Ok(b * self.kv_heads + h)
    }
    /// The K and V stores of (batch row `b`, kv-head `h`).
    pub fn stores(&self, b: usize, h: usize) -> Result<(&CodeStore, &CodeStore)> {
        let i = self.at(b, h)?;
        Ok((&self.k[i], &self.v[i]))
    }
    /// Appends one block of K and V rows to (batch row `b`, kv-head `h`): both containers are
    /// checked before either is kept, and must hold the same number of rows.
    pub fn append(
        &mut self,
        b: usize,
        h: usize,
        k_blob: impl Into<Blob>,
        v_blob: impl Into<Blob>,
    ) -> Result<()> {
        let i = self.at(b, h)?;
        let kb = SealedBlock::parse(&self.k[i].tables, k_blob)?;
        let vb = SealedBlock::parse(&self.v[i].tables, v_blob)?;
        if kb.n != vb.n {
            return input(format!(
                "the K block holds {} rows, the V block {}",
                kb.n, vb.n
            ));
        }
        self.k[i].push(Arc::new(kb));
        self.v[i].push(Arc::new(vb));
        Ok(())
    }
    /// Rows sealed in (batch row `b`, kv-head `h`).
    pub fn rows(&self, b: usize, h: usize) -> Result<usize> {
        Ok(self.k[self.at(b, h)?].rows)
    }
    /// Rows sealed in every (batch row, kv-head), or an error naming two that differ.
    pub fn common_rows(&self) -> Result<usize> {
        let r = self.k[0].rows;
        if let Some(i) = self.k.iter().position(|s| s.rows != r) {
            return input(format!(
                "sealed rows differ across the layer: (0, 0) holds {r}, (batch row {}, kv-head {}) holds {}",
                i / self.kv_heads,
                i % self.kv_heads,
                self.k[i].rows
            ));
        }
        Ok(r)
    }
    /// Blocks of (batch row `b`, kv-head `h`) (K and V have the same count).
    pub fn num_blocks(&self, b: usize, h: usize) -> Result<usize> {
        Ok(self.k[self.at(b, h)?].blocks.len())
    }
    /// The container bytes of block `i` of one stream (`"k"` or `"v"`) of (b, h).
    pub fn blob(&self, b: usize, h: usize, stream: &str, i: usize) -> Result<&[u8]> {
        let s = match stream {
            "k" => &self.k[self.at(b, h)?],
            "v" => &self.v[self.at(b, h)?],
            _ => return param(format!("stream must be 'k' or 'v', got {stream:?}")),
        };
        s.blocks.get(i).map(|x| x.bytes()).ok_or_else(|| {
            Error::InvalidInput(format!(
                "block {i} does not exist ({} blocks)",
                s.blocks.len()
            ))
        })
    }
    /// Removes the last block of every (batch row, kv-head) (those that have one).
    pub fn pop_block(&mut self) {
        for s in self.k.iter_mut().chain(self.v.iter_mut()) {
            s.pop();
        }
    }
    /// Removes the first block of every (batch row, kv-head) (those that have one): a
    /// sliding-window layer dropping what left its window.
    pub fn pop_front_block(&mut self) {
        for s in self.k.iter_mut().chain(self.v.iter_mut()) {
            s.pop_front();
        }
    }
    /// Keeps the batch rows `index` in that order (repeats allowed: blocks are shared, not
    /// copied), as beam search reorders a cache.
    pub fn select(&mut self, index: &[usize]) -> Result<()> {
        if index.is_empty() {
            return input("select needs at least one batch row");
        }
        if index.len().saturating_mul(self.kv_heads) > MAX_STORES {
            return input(format!(
                "select of {} batch rows x {} kv-heads is more than the {MAX_STORES} (batch row, \
                 kv-head) pairs a layer holds",
                index.len(),
                self.kv_heads
            ));
        }
        if let Some(&b) = index.iter().find(|&&b| b >= self.batch) {
            return input(format!(
                "batch row {b} does not exist ({} rows)",
                self.batch
            ));
        }
        let pick = |s: &[CodeStore]| -> Vec<CodeStore> {
            index
                .iter()
                .flat_map(|&b| {
                    s[b * self.kv_heads..(b + 1) * self.kv_heads]
                        .iter()
                        .cloned()
                })
                .collect()
        };
        self.k = pick(&self.k);
        self.v = pick(&self.v);
        self.batch = index.len();
        Ok(())
    }
    /// Removes every block.
    pub fn clear(&mut self) {
        for s in self.k.iter_mut().chain(self.v.iter_mut()) {
            s.clear();
        }
    }
    /// Bytes held: every container's bytes, each counted once however many stores share it
    /// (repeated batch rows after `select`, or one owner's bytes appended twice).
    pub fn nbytes(&self) -> usize {
        let mut seen = std::collections::HashSet::new();
        self.k
            .iter()
            .chain(&self.v)
            .flat_map(|s| s.blocks())
            .map(|b| b.bytes())
            .filter(|bytes| seen.insert(bytes.as_ptr() as usize))
            .map(|bytes| bytes.len())
            .sum()
    }
    pub(crate) fn k_store(&self, i: usize) -> &CodeStore {
        &self.k[i]
    }
    pub(crate) fn v_store(&self, i: usize) -> &CodeStore {
        &self.v[i]
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
