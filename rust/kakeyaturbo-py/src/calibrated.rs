//! `CalibratedCodec`: the calibrated mode as a Python object holding a checked calibration.

use crate::convert::{self, arr, arr_up_to, int_item, item, matrix, to_array2, to_array2_u8, vec1};
use crate::errors::{invalid_input, invalid_parameter, run, to_py, type_error};
use crate::layer::{error_sums, set_errors};
use crate::params;
use kakeyaturbo::calibrated::{self, CalibratedCodec, CalibratedCodes, CalibratedParams};
use kakeyaturbo::f16::{ScaledF16, MAX_EXP, MIN_EXP};
use kakeyaturbo::limits::{saturate, MAX_ROWS};
use kakeyaturbo::quant::MAX_BITS;
use kakeyaturbo::threads::with_threads;
use numpy::{
    PyArray1, PyArray2, PyArray3, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyReadonlyArray3, PyReadwriteArray3,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::time::Instant;

fn slice<'a, T: numpy::Element>(
    py: Python<'_>,
    a: &'a PyReadonlyArray1<'_, T>,
    name: &str,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| invalid_input(py, format!("{name} must be contiguous")))
}

/// One stream of one (layer, kv-head) coded against a model-level calibration.
#[pyclass(name = "CalibratedCodec", module = "kakeyaturbo._core", frozen)]
pub struct PyCalibratedCodec {
    inner: CalibratedCodec,
}

#[pymethods]
impl PyCalibratedCodec {
    #[new]
    #[pyo3(signature = (mean, analysis, synthesis, spread, bits, rotation_seed, metric, norm, outlier_threshold=None, centroids=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        mean: PyReadonlyArray1<'_, f32>,
        analysis: PyReadonlyArray2<'_, f32>,
        synthesis: PyReadonlyArray2<'_, f32>,
        spread: PyReadonlyArray1<'_, f32>,
        bits: PyReadonlyArray1<'_, u8>,
        rotation_seed: &Bound<'_, PyAny>,
        metric: &str,
        norm: bool,
        outlier_threshold: Option<&Bound<'_, PyAny>>,
        centroids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let rotation_seed = convert::seed(py, rotation_seed, "rotation_seed")?;
        let outlier_threshold = match outlier_threshold {
            Some(t) if !t.is_none() => Some(convert::float(py, t, "outlier_threshold")? as f32),
            _ => None,
        };
        let centroids = match centroids {
            Some(c) if !c.is_none() => tables(py, c)?,
            _ => Vec::new(),
        };
        let (a, m, d) = matrix(py, &analysis)?;
        let (s, ms, ds) = matrix(py, &synthesis)?;
        if (ms, ds) != (m, d) {
            return Err(invalid_input(
                py,
                format!("synthesis must have the shape of analysis ({m}, {d}), got ({ms}, {ds})"),
            ));
        }
        let p = CalibratedParams {
            rotation_seed,
            metric: params::metric(py, metric)?,
            outlier_threshold,
            norm,
        };
        let c = CalibratedCodec::new(
            d,
            slice(py, &mean, "mean")?.to_vec(),
            a.to_vec(),
            s.to_vec(),
            slice(py, &spread, "spread")?.to_vec(),
            slice(py, &bits, "bits")?.to_vec(),
            centroids,
            p,
        )
        .map_err(|e| to_py(py, e))?;
        Ok(Self { inner: c })
    }

    /// The codec itself: it never changes after construction, so a copy may share it (as a
    /// tuple's copy is the tuple), and `copy.deepcopy` of what holds it (a cache) works.
    fn __copy__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    fn __deepcopy__(slf: Py<Self>, _memo: &Bound<'_, PyAny>) -> Py<Self> {
        slf
    }

    #[getter]
    fn d(&self) -> usize {
        self.inner.d
    }
    #[getter]
    fn m(&self) -> usize {
        self.inner.m
    }
    /// 64-bit FNV-1a hash of the calibration's canonical bytes; containers carry it.
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }
    /// Bytes of the calibration itself, stored once per model.
    #[getter]
    fn model_bytes(&self) -> usize {
        self.inner.model_bytes()
    }
    #[getter]
    fn row_bits(&self) -> usize {
        self.inner.row_bits()
    }
    #[getter]
    fn row_bytes(&self) -> usize {
        self.inner.row_bytes()
    }
    /// `(offset, width, bits)` of every sub-band, in order.
    #[getter]
    fn bands(&self) -> Vec<(usize, usize, u8)> {
        self.inner
            .bands()
            .iter()
            .map(|b| (b.offset, b.width, b.bits))
            .collect()
    }
    /// `M` float32 `[m, D]`: a row of scale `g` and centroids `c` (outliers' values in place)
    /// decodes as `mean + g * c M` (row `j`: the synthesis of the unit vector `e_j`, band
    /// rotation folded in), as the attention kernel multiplies it for keys coded before RoPE:
    /// `synthesis="bf16"` each entry rounded to bfloat16 (the default kernel's factors),
    /// `"f32"` as it is, `"i16"` as its fixed-point weight times the channel's step (which
    /// multiplies the centroids in steps of 1/256). For mirrors of the kernel (the Triton one).
    #[pyo3(signature = (synthesis="bf16"))]
    fn key_synthesis<'py>(
        &self,
        py: Python<'py>,
        synthesis: &str,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        use kakeyaturbo::attention::StreamTables;
        let mode = params::synthesis(py, synthesis)?;
        let (m, d) = (self.inner.m, self.inner.d);
        let values = StreamTables::new(&self.inner).key_synthesis_values(mode);
        to_array2(py, values, m, d)
    }

    /// What the calibration holds, as the arrays it was made from: `mean [D]`, `analysis` and
    /// `synthesis [m, D]`, `spread [m]` (float32), `bits [m]` (uint8) and `centroids` (the custom
    /// tables by bit width, float32; empty for none).
    fn arrays<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let out = PyDict::new(py);
        out.set_item("mean", vec1(py, c.mean.clone()))?;
        out.set_item("analysis", to_array2(py, c.analysis.clone(), c.m, c.d)?)?;
        out.set_item("synthesis", to_array2(py, c.synthesis.clone(), c.m, c.d)?)?;
        out.set_item("spread", vec1(py, c.spread.clone()))?;
        out.set_item("bits", vec1(py, c.bits.clone()))?;
        let tables = PyDict::new(py);
        for (b, t) in &c.custom_tables {
            tables.set_item(*b, vec1(py, t.clone()))?;
        }
        out.set_item("centroids", tables)?;
        Ok(out)
    }

    fn canonical_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.canonical_bytes())
    }

    #[pyo3(signature = (array, threads=None))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        array: PyReadonlyArray2<'py, f32>,
        threads: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let threads = convert::threads(py, threads)?;
        let (x, n, d) = self.rows(py, &array)?;
        let c = &self.inner;
        let b = run(py, || {
            calibrated::on_threads(threads, n, || Ok(c.to_bytes(&c.encode(x, n)?).0))
        })?;
        debug_assert_eq!(d, c.d);
        Ok(PyBytes::new(py, &b))
    }

    #[pyo3(signature = (data, threads=None))]
    fn decode<'py>(
        &self,
        py: Python<'py>,
        data: &[u8],
        threads: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let threads = convert::threads(py, threads)?;
        let c = &self.inner;
        let (y, n) = run(py, || {
            let codes = c.from_bytes(data)?;
            calibrated::on_threads(threads, codes.n, || Ok((c.decode(&codes)?, codes.n)))
        })?;
        to_array2(py, y, n, c.d)
    }

    /// Encode + decode with a report (bytes per part, errors, timings).
    #[pyo3(signature = (array, threads=None))]
    fn roundtrip<'py>(
        &self,
        py: Python<'py>,
        array: PyReadonlyArray2<'py, f32>,
        threads: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyArray2<f32>>, Bound<'py, PyDict>)> {
        let threads = convert::threads(py, threads)?;
        let (x, n, d) = self.rows(py, &array)?;
        let c = &self.inner;
        let (y, parts, nout, enc, dec) = run(py, || {
            with_threads(threads, || {
                let t0 = Instant::now();
                let codes = c.encode(x, n)?;
                let (_bytes, parts) = c.to_bytes(&codes);
                let t1 = Instant::now();
                let y = c.decode(&codes)?;
                let dec = t1.elapsed().as_secs_f64();
                Ok((
                    y,
                    parts,
                    codes.outlier_pos.len(),
                    (t1 - t0).as_secs_f64(),
                    dec,
                ))
            })?
        })?;
        let r = PyDict::new(py);
        let elems = (n * d) as f64;
        let total = parts.total();
        r.set_item("num_vecs", n)?;
        r.set_item("dim", d)?;
        r.set_item("components", c.m)?;
        r.set_item("header_bytes", parts.header)?;
        r.set_item("scale_bytes", parts.scales)?;
        r.set_item("code_bytes", parts.codes)?;
        r.set_item("outlier_bytes", parts.outliers)?;
        r.set_item("num_outliers", nout)?;
        r.set_item("compressed_bytes", total)?;
        r.set_item("bits_per_element", 8.0 * total as f64 / elems)?;
        r.set_item("ratio_vs_bf16", 2.0 * elems / total as f64)?;
        r.set_item("model_bytes", c.model_bytes())?;
        r.set_item("encode_seconds", enc)?;
        r.set_item("decode_seconds", dec)?;
        set_errors(&r, error_sums(x, &y), n * d)?;
        Ok((to_array2(py, y, n, d)?, r))
    }

    /// Every intermediate of an encode, by name: the oracle for GPU kernels, and the codec's
    /// own `z` for fitting Lloyd-Max tables.
    fn encode_parts<'py>(
        &self,
        py: Python<'py>,
        array: PyReadonlyArray2<'py, f32>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let (x, n, _) = self.rows(py, &array)?;
        let c = &self.inner;
        let p = run(py, || c.encode_parts(x, n))?;
        let r = PyDict::new(py);
        let m = c.m;
        r.set_item("n", n)?;
        r.set_item("d", c.d)?;
        r.set_item("m", m)?;
        r.set_item("row_bytes", c.row_bytes())?;
        r.set_item("z", to_array2(py, p.z, n, m)?)?;
        r.set_item("g", vec1(py, p.g))?;
        r.set_item("indices", to_array2_u8(py, p.indices, n, m)?)?;
        r.set_item("codes", PyBytes::new(py, &p.codes.codes))?;
        if let Some(s) = &p.codes.scale {
            r.set_item(
                "scale",
                vec1(py, s.decode_f64().into_iter().map(saturate).collect()),
            )?;
            r.set_item("scale_exp", s.exp)?;
            r.set_item("scale_bits", vec1(py, s.bits.clone()))?;
        }
        r.set_item(
            "outlier_pos",
            vec1(py, p.codes.outlier_pos.iter().map(|&v| v as i64).collect()),
        )?;
        r.set_item("outlier_bits", vec1(py, p.codes.outlier_val.clone()))?;
        r.set_item(
            "outlier_val",
            vec1(
                py,
                p.codes
                    .outlier_val
                    .iter()
                    .map(|&b| half::f16::from_bits(b).to_f32())
                    .collect(),
            ),
        )?;
        Ok(r)
    }

    /// Decodes the `codes`, `scale_exp`/`scale_bits` and `outlier_pos`/`outlier_bits` of a
    /// parts dict (as [`Self::encode_parts`] returns it).
    fn decode_parts<'py>(
        &self,
        py: Python<'py>,
        parts: &Bound<'py, PyDict>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let c = &self.inner;
        let n: usize = int_item(py, parts, "n", 0, MAX_ROWS as i128)?;
        let scale = if c.params.norm {
            Some(ScaledF16 {
                exp: int_item(py, parts, "scale_exp", MIN_EXP as i128, MAX_EXP as i128)?,
                bits: arr(py, parts, "scale_bits", n, "n")?,
            })
        } else {
            None
        };
        let pos: Vec<i64> = arr_up_to(py, parts, "outlier_pos", n * c.m, "n x m")?;
        if pos.iter().any(|&p| p < 0 || p > u32::MAX as i64) {
            return Err(invalid_input(py, "outlier_pos out of range"));
        }
        let codes = CalibratedCodes {
            n,
            scale,
            codes: item(parts, "codes")?
                .extract()
                .map_err(|_| type_error("parts[\"codes\"] must be bytes"))?,
            outlier_pos: pos.iter().map(|&p| p as u32).collect(),
            outlier_val: arr(py, parts, "outlier_bits", pos.len(), "len(outlier_pos)")?,
        };
        let y = run(py, || c.decode(&codes))?;
        to_array2(py, y, n, c.d)
    }

    /// Header fields and byte counts of a container, read without decoding it.
    fn inspect<'py>(&self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let (h, parts) = run(py, || {
            let codes = c.from_bytes(data)?;
            let h = calibrated::read_header(data)?;
            Ok((h, c.to_bytes(&codes).1))
        })?;
        let r = PyDict::new(py);
        r.set_item("num_vecs", h.n)?;
        r.set_item("dim", h.d)?;
        r.set_item("components", h.m)?;
        r.set_item("row_bytes", h.row_bytes)?;
        r.set_item("fingerprint", h.fingerprint)?;
        r.set_item("num_outliers", h.num_outliers)?;
        r.set_item("header_bytes", parts.header)?;
        r.set_item("scale_bytes", parts.scales)?;
        r.set_item("code_bytes", parts.codes)?;
        r.set_item("outlier_bytes", parts.outliers)?;
        r.set_item("compressed_bytes", parts.total())?;
        Ok(r)
    }
}

/// Custom Lloyd-Max tables: a dict `{bit width: table}` or a sequence of `(bit width, table)`
/// pairs; widths are ints in 1..=8, tables sequences of floats.
fn tables(py: Python<'_>, c: &Bound<'_, PyAny>) -> PyResult<Vec<(u8, Vec<f32>)>> {
    let pairs: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)> = if let Ok(d) = c.cast::<PyDict>() {
        d.iter().collect()
    } else if c.is_instance_of::<PyList>() || c.is_instance_of::<PyTuple>() {
        c.try_iter()?
            .map(|p| {
                p.and_then(|p| p.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>())
                    .map_err(|_| type_error("centroids must map bit widths to tables"))
            })
            .collect::<PyResult<_>>()?
    } else {
        return Err(type_error(format!(
            "centroids must be a dict {{bit width: table}}, got {}",
            c.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        )));
    };
    pairs
        .into_iter()
        .map(|(k, v)| {
            let b: u8 =
                convert::int_in(py, &k, "a centroids key (bit width)", 1, MAX_BITS as i128)?;
            let t: Vec<f64> = v
                .extract()
                .map_err(|_| type_error(format!("centroids[{b}] must be a sequence of floats")))?;
            Ok((b, t.into_iter().map(|x| x as f32).collect()))
        })
        .collect()
}

impl PyCalibratedCodec {
    /// The core calibration (for the attention binding).
    pub(crate) fn codec(&self) -> &CalibratedCodec {
        &self.inner
    }

    fn rows<'a>(
        &self,
        py: Python<'_>,
        a: &'a PyReadonlyArray2<'_, f32>,
    ) -> PyResult<(&'a [f32], usize, usize)> {
        let (x, n, d) = matrix(py, a)?;
        if d != self.inner.d {
            return Err(invalid_input(
                py,
                format!("rows have {d} columns, the calibration {}", self.inner.d),
            ));
        }
        Ok((x, n, d))
    }
}

/// `array [G, T, D]` (C-contiguous float32) in blocks of `block_rows`, row set `g` against
/// `codecs[g]`: the containers `[block][g]`, every encode of the call spread over `threads`
/// threads (`kakeyaturbo::calibrated::encode_many`).
#[pyfunction]
#[pyo3(signature = (codecs, array, block_rows, threads=None))]
pub fn encode_calibrated_blocks<'py>(
    py: Python<'py>,
    codecs: Vec<PyRef<'py, PyCalibratedCodec>>,
    array: PyReadonlyArray3<'py, f32>,
    block_rows: usize,
    threads: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<Vec<Bound<'py, PyBytes>>>> {
    let threads = convert::threads(py, threads)?;
    let (rows, [g, _, d]) = convert::block_rows_of(py, &array, block_rows)?;
    if codecs.len() != g {
        return Err(invalid_input(
            py,
            format!("{} calibrations for {g} row sets", codecs.len()),
        ));
    }
    if let Some(c) = codecs.iter().find(|c| c.inner.d != d) {
        return Err(invalid_input(
            py,
            format!("rows have {d} columns, a calibration {}", c.inner.d),
        ));
    }
    let jobs: Vec<calibrated::EncodeJob<'_>> = rows
        .into_iter()
        .map(|(h, x)| (&codecs[h].inner, x, block_rows))
        .collect();
    let out = run(py, || calibrated::encode_many(&jobs, threads))?;
    Ok(convert::by_block(py, out, g))
}

/// The containers `blobs[block][g]`, each of `block_rows` rows, container `[j][g]` decoded
/// against `codecs[g]`: float32 `[G, blocks * block_rows, D]`, block `j` of row set `g` at rows
/// `j * block_rows ..`, every decode of the call spread over `threads` threads
/// (`kakeyaturbo::calibrated::decode_many`).
#[pyfunction]
#[pyo3(signature = (codecs, blobs, block_rows, threads=None))]
pub fn decode_calibrated_blocks<'py>(
    py: Python<'py>,
    codecs: Vec<PyRef<'py, PyCalibratedCodec>>,
    blobs: Vec<Vec<Bound<'py, PyBytes>>>,
    block_rows: usize,
    threads: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray3<f32>>> {
    let threads = convert::threads(py, threads)?;
    let (jobs, d) = block_jobs(py, &codecs, &blobs)?;
    let g = codecs.len();
    let out = run(py, || {
        calibrated::decode_many(&jobs, g, block_rows, threads)
    })?;
    PyArray1::from_vec(py, out).reshape([g, blobs.len() * block_rows, d])
}

/// [`decode_calibrated_blocks`] into rows `at ..` of each row set of `out`, a C-contiguous
/// float32 `[G, rows, D]` array (written in place; the rest of it left as it is): a cache decodes
/// a layer's sealed blocks between the raw rows it attends with
/// (`kakeyaturbo::calibrated::decode_many_into`).
#[pyfunction]
#[pyo3(signature = (codecs, blobs, block_rows, out, at, threads=None))]
pub fn decode_calibrated_blocks_into<'py>(
    py: Python<'py>,
    codecs: Vec<PyRef<'py, PyCalibratedCodec>>,
    blobs: Vec<Vec<Bound<'py, PyBytes>>>,
    block_rows: usize,
    mut out: PyReadwriteArray3<'py, f32>,
    at: usize,
    threads: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let threads = convert::threads(py, threads)?;
    let (jobs, d) = block_jobs(py, &codecs, &blobs)?;
    let g = codecs.len();
    let (dst, rows, _) = convert::rows_out(py, &mut out, g, Some(d))?;
    run(py, || {
        calibrated::decode_many_into(&jobs, g, block_rows, dst, rows, at, threads)
    })
}

/// The decode jobs of `blobs[block][g]` against `codecs[g]`, block-major, and the rows' width;
/// refusals for no calibration, a block of another count of containers, calibrations of
/// different widths.
fn block_jobs<'a>(
    py: Python<'_>,
    codecs: &'a [PyRef<'_, PyCalibratedCodec>],
    blobs: &'a [Vec<Bound<'_, PyBytes>>],
) -> PyResult<(Vec<calibrated::DecodeJob<'a>>, usize)> {
    let g = codecs.len();
    if g == 0 {
        return Err(invalid_parameter(
            py,
            "codecs must hold at least one calibration",
        ));
    }
    if let Some(row) = blobs.iter().find(|row| row.len() != g) {
        return Err(invalid_input(
            py,
            format!(
                "a block holds {} containers for {g} calibrations",
                row.len()
            ),
        ));
    }
    let d = codecs[0].inner.d;
    if codecs.iter().any(|c| c.inner.d != d) {
        return Err(invalid_parameter(
            py,
            "the calibrations code rows of different widths",
        ));
    }
    let jobs = blobs
        .iter()
        .flat_map(|row| {
            row.iter()
                .zip(codecs)
                .map(|(b, c)| (&c.inner, b.as_bytes()))
        })
        .collect();
    Ok((jobs, d))
}
