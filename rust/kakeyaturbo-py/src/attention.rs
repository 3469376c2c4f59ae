//! `LayerCodes`: a layer's sealed K and V codes and one attention step over them.

use crate::calibrated::PyCalibratedCodec;
use crate::convert;
use crate::errors::{invalid_input, run, to_py};
use half::bf16;
use kakeyaturbo::attention::{
    attend, auto_threads, AttentionParams, Blob, KeyRope, LayerCodes, RawRows, StreamTables,
};
use kakeyaturbo::threads::with_threads_inline;
use numpy::{
    PyArray1, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyTuple};
use std::borrow::Cow;
use std::sync::Arc;

/// Borrows a C-contiguous array of `ndim` dimensions: its values and shape.
pub(crate) fn array<'a, T: numpy::Element>(
    py: Python<'_>,
    a: &'a PyReadonlyArrayDyn<'_, T>,
    name: &str,
    ndim: usize,
) -> PyResult<(&'a [T], Vec<usize>)> {
    let shape = a.shape().to_vec();
    if shape.len() != ndim {
        return Err(invalid_input(
            py,
            format!("{name} must be {ndim}-D, got shape {shape:?}"),
        ));
    }
    let s = a
        .as_slice()
        .map_err(|_| invalid_input(py, format!("{name} must be C-contiguous")))?;
    Ok((s, shape))
}

/// A float array as the kernel reads it: float32, or bfloat16 held as its bits (`uint16`: a
/// bfloat16 model's rows viewed without a copy), widened here (exactly).
pub(crate) enum Floats<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    Bf16(PyReadonlyArrayDyn<'py, u16>),
}

impl<'py> FromPyObject<'_, 'py> for Floats<'py> {
    type Error = PyErr;

    /// By the array's dtype: trying float32 first would format a failed extraction's message
    /// (numpy's dtype names) at every call with bfloat16 rows. Anything else is float32's error.
    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        let bf16 = obj
            .cast::<PyUntypedArray>()
            .is_ok_and(|a| a.dtype().is_equiv_to(&numpy::dtype::<u16>(obj.py())));
        Ok(if bf16 {
            Floats::Bf16(obj.extract()?)
        } else {
            Floats::F32(obj.extract()?)
        })
    }
}

/// Borrows a float32 [`Floats`], or widens a bfloat16 one: its values and shape.
pub(crate) fn floats<'a>(
    py: Python<'_>,
    a: &'a Floats<'_>,
    name: &str,
    ndim: usize,
) -> PyResult<(Cow<'a, [f32]>, Vec<usize>)> {
    match a {
        Floats::F32(x) => array(py, x, name, ndim).map(|(s, shape)| (Cow::Borrowed(s), shape)),
        Floats::Bf16(x) => array(py, x, name, ndim).map(|(s, shape)| {
            let wide = s.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
            (Cow::Owned(wide), shape)
        }),
    }
}

/// A non-negative index (ints out of range are InvalidParameterError, never OverflowError).
fn index(py: Python<'_>, v: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    convert::int_in(py, v, what, 0, u32::MAX as i128)
}

/// Keys coded before RoPE: cos and sin `[rot/2, n_pos]` (frequency-major), each sealed row's
/// position `[B, T_c]`, and the pairing.
type RopeArgs<'py> = (
    PyReadonlyArrayDyn<'py, f32>,
    PyReadonlyArrayDyn<'py, f32>,
    PyReadonlyArrayDyn<'py, u32>,
    String,
    String,
);

/// `rope` as [`RopeArgs`] (None or `None`: keys coded after RoPE); anything else is a
/// `TypeError` (PyO3's own extraction made a tuple of another length a `ValueError`).
fn rope_args<'py>(rope: Option<&Bound<'py, PyAny>>) -> PyResult<Option<RopeArgs<'py>>> {
    match rope {
        Some(r) if !r.is_none() => r.extract().map(Some).map_err(|e| {
            crate::errors::type_error(format!(
                "rope must be a (cos, sin, positions, style, synthesis) tuple: {e}"
            ))
        }),
        _ => Ok(None),
    }
}

/// The sealed K and V codes of one attention layer, per (batch row, kv-head).
#[pyclass(name = "LayerCodes", module = "kakeyaturbo._core")]
pub struct PyLayerCodes {
    inner: LayerCodes,
}

fn tables(codecs: &[PyRef<'_, PyCalibratedCodec>]) -> Vec<Arc<StreamTables>> {
    codecs
        .iter()
        .map(|c| Arc::new(StreamTables::new(c.codec())))
        .collect()
}

#[pymethods]
impl PyLayerCodes {
    #[new]
    fn new(
        py: Python<'_>,
        k_codecs: Vec<PyRef<'_, PyCalibratedCodec>>,
        v_codecs: Vec<PyRef<'_, PyCalibratedCodec>>,
        batch: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let batch: usize = convert::int_in(py, batch, "batch", 1, 1 << 20)?;
        let (k, v) = (tables(&k_codecs), tables(&v_codecs));
        let inner = LayerCodes::new(k, v, batch).map_err(|e| to_py(py, e))?;
        Ok(Self { inner })
    }

    /// An independent copy: appending to or selecting rows of one leaves the other as it was.
    /// The sealed containers (never changed once appended) and the calibrations' tables are
    /// shared, not copied.
    fn __copy__(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
    fn __deepcopy__(&self, _memo: &Bound<'_, PyAny>) -> Self {
        self.__copy__()
    }

    #[getter]
    fn batch(&self) -> usize {
        self.inner.batch()
    }
    #[getter]
    fn kv_heads(&self) -> usize {
        self.inner.kv_heads()
    }
    #[getter]
    fn k_dim(&self) -> usize {
        self.inner.k_dim()
    }
    #[getter]
    fn v_dim(&self) -> usize {
        self.inner.v_dim()
    }
    /// Bytes held: every container's bytes, each counted once however many (batch row,
    /// kv-head) stores share it (repeated batch rows, one `bytes` object appended twice).
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// Sealed rows, the same in every (batch row, kv-head) (else InvalidInputError).
    fn rows(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.common_rows().map_err(|e| to_py(py, e))
    }

    fn rows_at(
        &self,
        py: Python<'_>,
        b: &Bound<'_, PyAny>,
        h: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let (b, h) = (index(py, b, "b")?, index(py, h, "h")?);
        self.inner.rows(b, h).map_err(|e| to_py(py, e))
    }

    fn num_blocks(
        &self,
        py: Python<'_>,
        b: &Bound<'_, PyAny>,
        h: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let (b, h) = (index(py, b, "b")?, index(py, h, "h")?);
        self.inner.num_blocks(b, h).map_err(|e| to_py(py, e))
    }

    /// Appends one block to (batch row `b`, kv-head `h`): both containers are parsed and
    /// checked once, here. A `bytes` container is shared with its Python object, not copied.
    fn append(
        &mut self,
        py: Python<'_>,
        b: &Bound<'_, PyAny>,
        h: &Bound<'_, PyAny>,
        k: PyBackedBytes,
        v: PyBackedBytes,
    ) -> PyResult<()> {
        let (b, h) = (index(py, b, "b")?, index(py, h, "h")?);
        let (k, v) = (Blob::shared(k), Blob::shared(v));
        let inner = &mut self.inner;
        run(py, || inner.append(b, h, k, v))
    }

    /// Appends one block to every (batch row, kv-head): `k[b][h]`, `v[b][h]` (bytes, shared
    /// with their Python objects). Nothing is kept unless every container is accepted.
    fn append_blocks(
        &mut self,
        py: Python<'_>,
        k: Vec<Vec<PyBackedBytes>>,
        v: Vec<Vec<PyBackedBytes>>,
    ) -> PyResult<()> {
        let (batch, heads) = (self.inner.batch(), self.inner.kv_heads());
        for (name, x) in [("k", &k), ("v", &v)] {
            if x.len() != batch || x.iter().any(|r| r.len() != heads) {
                return Err(invalid_input(
                    py,
                    format!("{name} must hold [batch={batch}][kv_heads={heads}] containers"),
                ));
            }
        }
        let mut next = self.inner.clone();
        run(py, || {
            for (b, (kr, vr)) in k.into_iter().zip(v).enumerate() {
                for (h, (kb, vb)) in kr.into_iter().zip(vr).enumerate() {
                    next.append(b, h, Blob::shared(kb), Blob::shared(vb))?;
                }
            }
            Ok(())
        })?;
        self.inner = next;
        Ok(())
    }

    /// The container bytes of block `i` of stream `"k"` or `"v"` of (b, h).
    fn blob<'py>(
        &self,
        py: Python<'py>,
        b: &Bound<'py, PyAny>,
        h: &Bound<'py, PyAny>,
        stream: &str,
        i: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (b, h, i) = (index(py, b, "b")?, index(py, h, "h")?, index(py, i, "i")?);
        let x = self.inner.blob(b, h, stream, i).map_err(|e| to_py(py, e))?;
        Ok(PyBytes::new(py, x))
    }

    /// Removes the last block of every (batch row, kv-head).
    fn pop_block(&mut self) {
        self.inner.pop_block();
    }

    /// Removes the first block of every (batch row, kv-head).
    fn pop_front_block(&mut self) {
        self.inner.pop_front_block();
    }

    /// Keeps batch rows `index`, in that order (repeats allowed).
    fn select(&mut self, py: Python<'_>, index: Vec<Bound<'_, PyAny>>) -> PyResult<()> {
        let rows = index
            .iter()
            .map(|v| self::index(py, v, "a batch row"))
            .collect::<PyResult<Vec<usize>>>()?;
        self.inner.select(&rows).map_err(|e| to_py(py, e))
    }

    fn clear(&mut self) {
        self.inner.clear();
    }

    /// One attention step; see `kakeyaturbo.codec.attention.LayerCodes.attend`.
    #[pyo3(signature = (q, sink_k, sink_v, tail_k, tail_v, mask, scale, softcap=None, window=None, threads=None, rope=None, latent=false, out_bf16=false))]
    #[allow(clippy::too_many_arguments)]
    fn attend<'py>(
        &self,
        py: Python<'py>,
        q: Floats<'py>,
        sink_k: Floats<'py>,
        sink_v: Floats<'py>,
        tail_k: Floats<'py>,
        tail_v: Floats<'py>,
        mask: Option<PyReadonlyArrayDyn<'py, f32>>,
        scale: &Bound<'py, PyAny>,
        softcap: Option<&Bound<'py, PyAny>>,
        window: Option<&Bound<'py, PyAny>>,
        threads: Option<&Bound<'py, PyAny>>,
        rope: Option<&Bound<'py, PyAny>>,
        latent: bool,
        out_bf16: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let rope = rope_args(rope)?;
        let threads = convert::threads(py, threads)?;
        let scale = convert::float(py, scale, "scale")? as f32;
        let softcap = match softcap {
            Some(c) if !c.is_none() => Some(convert::float(py, c, "softcap")? as f32),
            _ => None,
        };
        let window: Option<usize> = match window {
            Some(w) if !w.is_none() => Some(convert::int_in(py, w, "window", 1, u32::MAX as i128)?),
            _ => None,
        };
        let (qs, qshape) = floats(py, &q, "q", 4)?;
        let (b, hkv, dk, dv) = (
            self.inner.batch(),
            self.inner.kv_heads(),
            self.inner.k_dim(),
            self.inner.v_dim(),
        );
        // Latent attention: queries score both streams; the output is the K stream's width.
        let (dq, dout) = if latent { (dk + dv, dk) } else { (dk, dv) };
        if qshape[0] != b || qshape[3] != dq {
            let what = if latent { "D_k + D_v" } else { "D_k" };
            return Err(invalid_input(
                py,
                format!("q must be [B={b}, H_q, n_q, {what}={dq}], got {qshape:?}"),
            ));
        }
        let (hq, nq) = (qshape[1], qshape[2]);
        let mut raw = Vec::new();
        for (name, a, d) in [
            ("sink_k", &sink_k, dk),
            ("sink_v", &sink_v, dv),
            ("tail_k", &tail_k, dk),
            ("tail_v", &tail_v, dv),
        ] {
            let (s, shape) = floats(py, a, name, 4)?;
            if shape[0] != b || shape[1] != hkv || shape[3] != d {
                return Err(invalid_input(
                    py,
                    format!("{name} must be [B={b}, H_kv={hkv}, rows, {d}], got {shape:?}"),
                ));
            }
            raw.push((s, shape[2]));
        }
        if raw[0].1 != raw[1].1 || raw[2].1 != raw[3].1 {
            return Err(invalid_input(py, "keys and values must have the same rows"));
        }
        let m = match &mask {
            Some(m) => Some(array(py, m, "mask", 3)?.0),
            None => None,
        };
        let p = AttentionParams {
            scale,
            softcap,
            window,
            latent,
        };
        let inner = &self.inner;
        // Keys coded before RoPE: (cos [rot/2, n_pos] frequency-major, sin, positions [B, T_c],
        // style, synthesis).
        let rope = match &rope {
            None => None,
            Some((cos, sin, pos, style, synthesis)) => {
                let (c, cshape) = array(py, cos, "rope cos", 2)?;
                let (sn, sshape) = array(py, sin, "rope sin", 2)?;
                if cshape != sshape {
                    return Err(invalid_input(
                        py,
                        format!("rope cos and sin differ in shape: {cshape:?} and {sshape:?}"),
                    ));
                }
                if pos.shape().len() != 2 || pos.shape()[0] != b {
                    return Err(invalid_input(
                        py,
                        format!(
                            "positions must be [B={b}, T_c], got shape {:?}",
                            pos.shape()
                        ),
                    ));
                }
                let positions = pos
                    .as_slice()
                    .map_err(|_| invalid_input(py, "positions must be C-contiguous"))?;
                let style = crate::params::rope_style(py, style)?;
                let synthesis = crate::params::synthesis(py, synthesis)?;
                Some(KeyRope {
                    cos: c,
                    sin: sn,
                    rot: 2 * cshape[0],
                    style,
                    positions,
                    synthesis,
                })
            }
        };
        let sink = RawRows {
            k: &raw[0].0,
            v: &raw[1].0,
            rows: raw[0].1,
        };
        let tail = RawRows {
            k: &raw[2].0,
            v: &raw[3].0,
            rows: raw[2].1,
        };
        let o = run(py, || {
            with_threads_inline(auto_threads(inner, hq, nq, threads), || {
                attend(inner, &qs, hq, nq, sink, tail, m, &p, rope.as_ref())
            })?
        })?;
        // The output rounded to bfloat16 (nearest even, as torch rounds), as its bits, if asked.
        let out = if out_bf16 {
            let bits: Vec<u16> = o.out.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
            PyArray1::from_vec(py, bits)
                .reshape(vec![b, hq, nq, dout])?
                .into_any()
        } else {
            PyArray1::from_vec(py, o.out)
                .reshape(vec![b, hq, nq, dout])?
                .into_any()
        };
        let lse: Bound<'py, PyArrayDyn<f32>> =
            PyArray1::from_vec(py, o.lse).reshape(vec![b, hq, nq])?;
        PyTuple::new(py, [out, lse.into_any()])
    }

    fn __repr__(&self) -> String {
        format!(
            "LayerCodes(batch={}, kv_heads={}, k_dim={}, v_dim={}, nbytes={})",
            self.inner.batch(),
            self.inner.kv_heads(),
            self.inner.k_dim(),
            self.inner.v_dim(),
            self.inner.nbytes()
        )
    }
}

/// The threads of the host's team (`kakeyaturbo::team`) a call on every core runs on now, 0
/// where none.
#[pyfunction]
pub fn attention_team() -> usize {
    kakeyaturbo::team::available().map_or(0, |(_, n)| n)
}

/// The instruction set `decode_attention` runs on this CPU: "avx512", "avx2" or "portable"
/// (every one computes the same bits).
#[pyfunction]
pub fn attention_kernel() -> &'static str {
    match kakeyaturbo::attention::Isa::best() {
        kakeyaturbo::attention::Isa::Avx512 => "avx512",
        kakeyaturbo::attention::Isa::Avx2 => "avx2",
        kakeyaturbo::attention::Isa::Portable => "portable",
    }
}
