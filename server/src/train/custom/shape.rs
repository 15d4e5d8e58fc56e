//! Shape functions (basic indexing, reshapes), reductions, softmax and cumsum, with
//! their derivatives. Reductions follow torch: `amax`/`amin` share the gradient equally
//! among tied maxima, and an empty `dim` (or none) reduces every dimension.

use super::array::{checked_shape, reduction, strided_map, strides, wrap_dim, Array, Kind};
use super::compile::Reduce;
use super::value::Val;
use super::EvalError;

/// Basic indexing (`x[1:, 0]`, `x[..., None]`): the output shape and, for each output
/// element, the input element it reads.
pub fn index_map(shape: &[usize], index: &Val) -> Result<(Vec<usize>, Vec<usize>), EvalError> {
    let items: Vec<&Val> = match index {
        Val::Seq(items) => items.iter().collect(),
        other => vec![other],
    };
    let consumed = items
        .iter()
        .filter(|v| matches!(v, Val::Scalar(..) | Val::Slice(_)))
        .count();
    let ellipses = items.iter().filter(|v| matches!(v, Val::Ellipsis)).count();
    let rank = shape.len();
    if ellipses > 1 {
        return Err(EvalError("an index may hold only one ...".into()));
    }
    if consumed > rank {
        return Err(EvalError(format!(
            "too many indices ({consumed}) for a tensor of rank {rank}"
        )));
    }
    let in_strides = strides(shape);
    let (mut out_shape, mut steps, mut base, mut d) = (Vec::new(), Vec::new(), 0usize, 0usize);
    let keep = |d: &mut usize, out_shape: &mut Vec<usize>, steps: &mut Vec<usize>| {
        out_shape.push(shape[*d]);
        steps.push(in_strides[*d]);
        *d += 1;
    };
    for item in items {
        match item {
            Val::Ellipsis => {
                for _ in 0..rank - consumed {
                    keep(&mut d, &mut out_shape, &mut steps);
                }
            }
            Val::None => {
                out_shape.push(1);
                steps.push(0);
            }
            Val::Scalar(v, Kind::Int) => {
                let n = shape[d] as i64;
                let i = *v as i64;
                let at = if i < 0 { i + n } else { i };
                if !(0..n).contains(&at) {
                    return Err(EvalError(format!(
                        "index {i} is out of range for dimension {d} of size {n}"
                    )));
                }
                base += at as usize * in_strides[d];
                d += 1;
            }
            Val::Slice(parts) => {
                let n = shape[d] as i64;
                let part = |v: &Val, what: &str| match v {
                    Val::None => Ok(None),
                    other => other.int(what).map(Some),
                };
                let step = part(&parts[2], "a slice's step")?.unwrap_or(1);
                if step <= 0 {
                    return Err(EvalError(format!(
                        "a slice's step must be positive, got {step}"
                    )));
                }
                let clamp = |v: Option<i64>, default: i64| match v {
                    None => default,
                    Some(x) => (if x < 0 { x + n } else { x }).clamp(0, n),
                };
                let start = clamp(part(&parts[0], "a slice's start")?, 0);
                let stop = clamp(part(&parts[1], "a slice's stop")?, n);
                // `0 <= start, stop <= n` after clamping, so nothing here overflows
                // however large `step` is.
                let len = if stop > start {
                    (stop - start - 1) / step + 1
                } else {
                    0
                };
                base += start as usize * in_strides[d];
                out_shape.push(len as usize);
                // With one element or none the step is never taken.
                steps.push(if len > 1 {
                    in_strides[d] * step as usize
                } else {
                    0
                });
                d += 1;
            }
            Val::Array(_) => {
                return Err(EvalError(
                    "indexing with a tensor (advanced indexing) is not supported; use \
                     torch.where or a mask multiplication"
                        .into(),
                ))
            }
            other => {
                return Err(EvalError(format!(
                    "{} cannot index a tensor",
                    other.describe()
                )))
            }
        }
    }
    while d < rank {
        keep(&mut d, &mut out_shape, &mut steps);
    }
    checked_shape(&out_shape)?;
    let map = strided_map(&out_shape, &steps, base);
    Ok((out_shape, map))
}

/// The shape `reshape`/`view` gives `shape` (one size may be -1).
pub fn reshaped(shape: &[usize], sizes: &[i64]) -> Result<Vec<usize>, EvalError> {
    let numel: usize = shape.iter().product();
    let bad = || {
        EvalError(format!(
            "cannot reshape a tensor of shape {shape:?} to {sizes:?}"
        ))
    };
    if sizes.iter().filter(|&&s| s == -1).count() > 1 || sizes.iter().any(|&s| s < -1) {
        return Err(bad());
    }
    let known = sizes
        .iter()
        .filter(|&&s| s != -1)
        .try_fold(1usize, |acc, &s| acc.checked_mul(s as usize))
        .ok_or_else(bad)?;
    sizes
        .iter()
        .map(|&s| {
            if s != -1 {
                Ok(s as usize)
            } else if known != 0 && numel.is_multiple_of(known) {
                Ok(numel / known)
            } else {
                Err(bad())
            }
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(|new| {
            checked_shape(&new)?;
            if new.iter().product::<usize>() == numel {
                Ok(new)
            } else {
                Err(bad())
            }
        })
}

/// The shape after `squeeze(dims)` (all size-1 dimensions when `dims` is `None`).
pub fn squeezed(shape: &[usize], dims: Option<&[i64]>) -> Result<Vec<usize>, EvalError> {
    let drop: Vec<usize> = match dims {
        None => (0..shape.len()).filter(|&d| shape[d] == 1).collect(),
        Some(dims) if shape.is_empty() => {
            for &d in dims {
                wrap_dim(d, 0)?;
            }
            Vec::new()
        }
        Some(dims) => dims
            .iter()
            .map(|&d| wrap_dim(d, shape.len()))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter()
            .filter(|&d| shape[d] == 1)
            .collect(),
    };
    Ok((0..shape.len())
        .filter(|d| !drop.contains(d))
        .map(|d| shape[d])
        .collect())
}

/// The shape after `unsqueeze(dim)`.
pub fn unsqueezed(shape: &[usize], dim: i64) -> Result<Vec<usize>, EvalError> {
    let d = wrap_dim(dim, shape.len() + 1)?;
    let mut out = shape.to_vec();
    out.insert(d, 1);
    checked_shape(&out)?;
    Ok(out)
}

/// The shape after `flatten(start, end)`.
pub fn flattened(shape: &[usize], start: i64, end: i64) -> Result<Vec<usize>, EvalError> {
    if shape.is_empty() {
        return Ok(vec![1]);
    }
    let (s, e) = (wrap_dim(start, shape.len())?, wrap_dim(end, shape.len())?);
    if s > e {
        return Err(EvalError(format!(
            "flatten's start_dim {start} comes after its end_dim {end}"
        )));
    }
    let mut out = shape[..s].to_vec();
    out.push(shape[s..=e].iter().product());
    out.extend_from_slice(&shape[e + 1..]);
    Ok(out)
}

/// The dimensions a reduction's `dim` argument names (`None` or `()`: all of them).
pub fn reduce_dims(rank: usize, dim: &Val) -> Result<Vec<usize>, EvalError> {
    if rank == 0 {
        // A 0-d tensor reduces to itself over dim None, 0 or -1.
        if !matches!(dim, Val::None) {
            for d in dim.ints("dim")? {
                wrap_dim(d, 0)?;
            }
        }
        return Ok(Vec::new());
    }
    let dims = match dim {
        Val::None => return Ok((0..rank).collect()),
        other => other.ints("dim")?,
    };
    if dims.is_empty() {
        return Ok((0..rank).collect());
    }
    let mut out = Vec::with_capacity(dims.len());
    for d in dims {
        let w = wrap_dim(d, rank)?;
        if out.contains(&w) {
            return Err(EvalError(format!("dimension {d} appears twice in dim")));
        }
        out.push(w);
    }
    Ok(out)
}

/// The output shape of a reduction of `shape` over `dims`.
fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    (0..shape.len())
        .filter_map(|d| match (dims.contains(&d), keepdim) {
            (false, _) => Some(shape[d]),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

/// `sum`, `mean`, `amax`, `amin` over `dims`.
pub fn reduce(op: Reduce, x: &Array, dims: &[usize], keepdim: bool) -> Result<Array, EvalError> {
    let r = reduction(&x.shape, dims);
    let outputs: usize = r.keep_shape.iter().product();
    if r.count == 0 && matches!(op, Reduce::Amax | Reduce::Amin) {
        return Err(EvalError(
            "amax/amin/max/min of an empty tensor have no value".into(),
        ));
    }
    let init = match op {
        Reduce::Sum | Reduce::Mean => 0.0,
        Reduce::Amax => f64::NEG_INFINITY,
        Reduce::Amin => f64::INFINITY,
    };
    let mut out = vec![init; outputs];
    for (&v, &o) in x.data.iter().zip(&r.map) {
        out[o] = match op {
            Reduce::Sum | Reduce::Mean => out[o] + v,
            _ if v.is_nan() || out[o].is_nan() => f64::NAN,
            Reduce::Amax => out[o].max(v),
            Reduce::Amin => out[o].min(v),
        };
    }
    if op == Reduce::Mean {
        out.iter_mut().for_each(|v| *v /= r.count as f64);
    }
    let kind = match op {
        Reduce::Mean => Kind::Float,
        Reduce::Sum if x.kind == Kind::Bool => Kind::Int,
        _ => x.kind,
    };
    Ok(Array::new(
        reduced_shape(&x.shape, dims, keepdim),
        out,
        kind,
    ))
}

/// The gradient of a reduction's input.
pub fn reduce_grad(op: Reduce, x: &Array, dims: &[usize], y: &Array, g: &[f64]) -> Vec<f64> {
    let r = reduction(&x.shape, dims);
    match op {
        Reduce::Sum => r.map.iter().map(|&o| g[o]).collect(),
        Reduce::Mean => r.map.iter().map(|&o| g[o] / r.count as f64).collect(),
        Reduce::Amax | Reduce::Amin => {
            let mut ties = vec![0usize; y.numel()];
            for (&v, &o) in x.data.iter().zip(&r.map) {
                ties[o] += usize::from(v == y.data[o]);
            }
            x.data
                .iter()
                .zip(&r.map)
                .map(|(&v, &o)| {
                    if v == y.data[o] {
                        g[o] / ties[o] as f64
                    } else {
                        0.0
                    }
                })
                .collect()
        }
    }
}

/// `logsumexp` over `dims` (kept as 1 in the returned values' layout).
fn logsumexp_kept(x: &Array, dims: &[usize]) -> Vec<f64> {
    let r = reduction(&x.shape, dims);
    let outputs: usize = r.keep_shape.iter().product();
    let mut max = vec![f64::NEG_INFINITY; outputs];
    for (&v, &o) in x.data.iter().zip(&r.map) {
        max[o] = max[o].max(v);
    }
    let mut sum = vec![0.0; outputs];
    for (&v, &o) in x.data.iter().zip(&r.map) {
        if max[o].is_finite() {
            sum[o] += (v - max[o]).exp();
        }
    }
    max.iter()
        .zip(&sum)
        .map(|(&m, &s)| if m.is_finite() { m + s.ln() } else { m })
        .collect()
}

/// `logsumexp(x, dims, keepdim)`.
pub fn logsumexp(x: &Array, dims: &[usize], keepdim: bool) -> Array {
    Array::new(
        reduced_shape(&x.shape, dims, keepdim),
        logsumexp_kept(x, dims),
        Kind::Float,
    )
}

/// The gradient of `logsumexp`'s input: `g * softmax(x)` over the reduced dims.
pub fn logsumexp_grad(x: &Array, dims: &[usize], y: &Array, g: &[f64]) -> Vec<f64> {
    let r = reduction(&x.shape, dims);
    x.data
        .iter()
        .zip(&r.map)
        .map(|(&v, &o)| g[o] * (v - y.data[o]).exp())
        .collect()
}

/// `softmax` (or `log_softmax`) along `dim`.
pub fn softmax(x: &Array, dim: &[usize], log: bool) -> Array {
    let lse = logsumexp_kept(x, dim);
    let r = reduction(&x.shape, dim);
    let data = x
        .data
        .iter()
        .zip(&r.map)
        .map(|(&v, &o)| if log { v - lse[o] } else { (v - lse[o]).exp() })
        .collect();
    Array::new(x.shape.clone(), data, Kind::Float)
}

/// The gradient of `softmax`'s (or `log_softmax`'s) input.
pub fn softmax_grad(x: &Array, dim: &[usize], y: &Array, g: &[f64], log: bool) -> Vec<f64> {
    let r = reduction(&x.shape, dim);
    let mut acc = vec![0.0; r.keep_shape.iter().product()];
    for (k, &o) in r.map.iter().enumerate() {
        acc[o] += if log { g[k] } else { g[k] * y.data[k] };
    }
    r.map
        .iter()
        .enumerate()
        .map(|(k, &o)| {
            if log {
                g[k] - y.data[k].exp() * acc[o]
            } else {
                y.data[k] * (g[k] - acc[o])
            }
        })
        .collect()
}

/// `cumsum` along `dim` (`None` for a 0-d tensor).
pub fn cumsum(x: &Array, dim: Option<usize>) -> Array {
    let kind = if x.kind == Kind::Float {
        Kind::Float
    } else {
        Kind::Int
    };
    let Some(d) = dim else {
        return Array::new(x.shape.clone(), x.data.clone(), kind);
    };
    let (stride, n) = (strides(&x.shape)[d], x.shape[d]);
    let mut out = x.data.clone();
    for i in 0..out.len() {
        if (i / stride) % n > 0 {
            out[i] += out[i - stride];
        }
    }
    Array::new(x.shape.clone(), out, kind)
}

/// The gradient of `cumsum`'s input: a reversed cumulative sum of `g`.
pub fn cumsum_grad(x: &Array, dim: Option<usize>, g: &[f64]) -> Vec<f64> {
    let Some(d) = dim else {
        return g.to_vec();
    };
    let (stride, n) = (strides(&x.shape)[d], x.shape[d]);
    let mut out = g.to_vec();
    for i in (0..out.len()).rev() {
        if (i / stride) % n + 1 < n {
            out[i] += out[i + stride];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(v: i64) -> Val {
        Val::Scalar(v as f64, Kind::Int)
    }

    fn slice(a: Option<i64>, b: Option<i64>) -> Val {
        let p = |x: Option<i64>| x.map_or(Val::None, int);
        Val::Slice(Box::new([p(a), p(b), Val::None]))
    }

    #[test]
    fn basic_indexing_reads_what_python_would() {
        // x = arange(6).reshape(2, 3)
        let (s, m) = index_map(&[2, 3], &Val::Seq(vec![slice(None, None), int(0)])).unwrap();
        assert_eq!((s, m), (vec![2], vec![0, 3]));
        let (s, m) = index_map(&[2, 3], &Val::Seq(vec![slice(Some(1), None)])).unwrap();
        assert_eq!((s, m), (vec![1, 3], vec![3, 4, 5]));
        let (s, m) = index_map(&[2, 3], &int(-1)).unwrap();
        assert_eq!((s, m), (vec![3], vec![3, 4, 5]));
        let (s, m) = index_map(&[3], &Val::Seq(vec![Val::Ellipsis, Val::None])).unwrap();
        assert_eq!((s, m), (vec![3, 1], vec![0, 1, 2]));
        let (s, _) = index_map(&[3], &slice(Some(5), Some(1))).unwrap();
        assert_eq!(s, vec![0]);
        assert!(index_map(&[3], &int(3)).is_err());
        assert!(index_map(&[3], &Val::Seq(vec![int(0), int(0)])).is_err());
    }

    #[test]
    fn reshapes_infer_one_size_and_refuse_mismatches() {
        assert_eq!(reshaped(&[2, 3], &[-1]).unwrap(), vec![6]);
        assert_eq!(reshaped(&[2, 3], &[3, -1]).unwrap(), vec![3, 2]);
        assert!(reshaped(&[2, 3], &[4, -1]).is_err());
        assert!(reshaped(&[2, 3], &[-1, -1]).is_err());
        assert!(reshaped(&[2, 3], &[i64::MAX, 2]).is_err());
        assert_eq!(squeezed(&[1, 3, 1], None).unwrap(), vec![3]);
        assert_eq!(squeezed(&[1, 3, 1], Some(&[-1])).unwrap(), vec![1, 3]);
        assert_eq!(unsqueezed(&[3], -1).unwrap(), vec![3, 1]);
        assert_eq!(flattened(&[2, 3, 4], 1, -1).unwrap(), vec![2, 12]);
    }

    #[test]
    fn cumsum_runs_along_the_chosen_dimension() {
        let x = Array::new(vec![2, 3], vec![1., 2., 3., 4., 5., 6.], Kind::Float);
        assert_eq!(cumsum(&x, Some(1)).data, vec![1., 3., 6., 4., 9., 15.]);
        assert_eq!(cumsum(&x, Some(0)).data, vec![1., 2., 3., 5., 7., 9.]);
        let g = vec![1.0; 6];
        assert_eq!(cumsum_grad(&x, Some(1), &g), vec![3., 2., 1., 3., 2., 1.]);
    }
}
