//! The input checks of one attention step: every shape, value and parameter of a call made
//! into the [`Ctx`] its pieces read, or a typed error (no input panics).

use super::attend::AttentionParams;
use super::part::{Ctx, RawRows};
use super::rope::KeyRope;
use super::store::LayerCodes;
use crate::error::{input, param, Result};

fn check_finite(name: &str, v: &[f32]) -> Result<()> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => input(format!("{name} holds a non-finite value at flat index {i}")),
        None => Ok(()),
    }
}

fn check_len(name: &str, v: &[f32], dims: &[usize], shape: &str) -> Result<()> {
    let want = dims
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| crate::error::Error::InvalidInput(format!("{name}: size overflows")))?;
    if v.len() != want {
        return input(format!(
            "{name} must hold {shape} = {dims:?} = {want} values, got {}",
            v.len()
        ));
    }
    Ok(())
}

impl<'a> Ctx<'a> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        codes: &'a LayerCodes,
        q: &'a [f32],
        q_heads: usize,
        n_q: usize,
        sink: RawRows<'a>,
        tail: RawRows<'a>,
        mask: Option<&'a [f32]>,
        p: &AttentionParams,
        rope: Option<&KeyRope<'a>>,
    ) -> Result<Self> {
        let (batch, kv_heads) = (codes.batch(), codes.kv_heads());
        let (dk, dv) = (codes.k_dim(), codes.v_dim());
        if q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return input(format!(
                "query heads ({q_heads}) must be a positive multiple of the kv-heads ({kv_heads})"
            ));
        }
        if n_q == 0 {
            return input("n_q must be >= 1");
        }
        if p.latent && rope.is_some() {
            return param("latent attention takes no key rotation (its latent rows carry no RoPE)");
        }
        let dq = if p.latent { dk + dv } else { dk };
        let shape = if p.latent {
            "[B, H_q, n_q, D_k + D_v]"
        } else {
            "[B, H_q, n_q, D_k]"
        };
        check_len("q", q, &[batch, q_heads, n_q, dq], shape)?;
        check_finite("q", q)?;
        for (name, r) in [("sink", &sink), ("tail", &tail)] {
            check_len(
                &format!("{name} keys"),
                r.k,
                &[batch, kv_heads, r.rows, dk],
                "[B, H_kv, rows, D_k]",
            )?;
            check_len(
                &format!("{name} values"),
                r.v,
                &[batch, kv_heads, r.rows, dv],
                "[B, H_kv, rows, D_v]",
            )?;
            check_finite(&format!("{name} keys"), r.k)?;
            check_finite(&format!("{name} values"), r.v)?;
        }
        if tail.rows < n_q {
            return input(format!(
                "the tail ({} rows) must end with the queries' own {n_q} rows",
                tail.rows
            ));
        }
        let sealed = codes.common_rows()?;
        let total = sink
            .rows
            .checked_add(sealed)
            .and_then(|t| t.checked_add(tail.rows))
            .filter(|&t| t <= u32::MAX as usize)
            .ok_or_else(|| crate::error::Error::InvalidInput("too many positions".into()))?;
        if let Some(m) = mask {
            check_len("mask", m, &[batch, n_q, total], "[B, n_q, T]")?;
            if let Some(i) = m.iter().position(|&x| x.is_nan() || x == f32::INFINITY) {
                return input(format!(
                    "mask values must be finite or -inf; flat index {i} is {}",
                    m[i]
                ));
            }
        }
        if !p.scale.is_finite() {
            return param(format!("scale must be finite, got {}", p.scale));
        }
        if let Some(c) = p.softcap {
            if !(c.is_finite() && c > 0.0) {
                return param(format!("softcap must be finite and > 0, got {c}"));
            }
        }
        if p.window == Some(0) {
            return param("window must be >= 1");
        }
        if let Some(r) = rope {
            r.check(batch, sealed, dk)?;
            // Derived here, once, so that the workers only read it.
            for bh in 0..batch * kv_heads {
                codes.k_store(bh).tables().key_synthesis();
            }
        }
        Ok(Self {
            codes,
            q,
            sink,
            tail,
            mask,
            rope: rope.copied(),
            scale: p.scale,
            softcap: p.softcap,
            window: p.window,
            batch,
            kv_heads,
            q_heads,
            group: q_heads / kv_heads,
            n_q,
            dk,
            dv,
            latent: p.latent,
            dq,
            dout: if p.latent { dk } else { dv },
            sealed,
            total,
        })
    }
}
