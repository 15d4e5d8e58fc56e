//! The interpreter's tensors: small row-major f64 arrays of any rank, with a dtype
//! kind, numpy broadcasting and the index maps that forward and backward passes share.
//!
//! Every shape op (broadcast, basic indexing, reduction) is expressed as an *index map*:
//! for each element of one array, the flat index of the element it reads from (or adds
//! into) in the other. A forward gather `out[i] = x[map[i]]` then has the backward
//! scatter `dx[map[i]] += dout[i]`, so each shape op is written once for both passes.

use super::{EvalError, MAX_ELEMENTS, MAX_RANK};

/// What a value holds, in torch's promotion order (bool < integer < floating).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// `torch.bool`.
    Bool,
    /// An integer dtype.
    Int,
    /// A floating dtype (computed in f64).
    Float,
}

/// A dense row-major array.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    /// Dimensions; empty for a 0-d tensor.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f64>,
    /// The dtype kind.
    pub kind: Kind,
}

impl Array {
    /// A 0-d array.
    pub fn scalar(v: f64, kind: Kind) -> Self {
        Self {
            shape: Vec::new(),
            data: vec![v],
            kind,
        }
    }

    /// An array from its parts (`data.len()` must be the shape's size).
    pub fn new(shape: Vec<usize>, data: Vec<f64>, kind: Kind) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data, kind }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

/// Row-major strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// The size of `shape`, or an error when it overflows or passes `limit`.
pub fn checked_size(shape: &[usize], limit: usize) -> Result<usize, EvalError> {
    let size = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= limit);
    size.ok_or_else(|| {
        EvalError(format!(
            "a tensor of shape {shape:?} would exceed the limit of {limit} elements"
        ))
    })
}

/// Checks a shape a tensor is about to take, before anything of that size is allocated:
/// at most [`MAX_RANK`] dimensions and [`MAX_ELEMENTS`] elements, counting an empty
/// dimension as 1 (so a reduction over the empty dimension of `(0, 2⁴⁰)` cannot ask for
/// a result of `2⁴⁰` elements).
pub fn checked_shape(shape: &[usize]) -> Result<(), EvalError> {
    if shape.len() > MAX_RANK {
        return Err(EvalError(format!(
            "a tensor of rank {} exceeds the limit of {MAX_RANK} dimensions",
            shape.len()
        )));
    }
    let size = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d.max(1)));
    match size {
        Some(n) if n <= MAX_ELEMENTS => Ok(()),
        _ => Err(EvalError(format!(
            "a tensor of shape {shape:?} would exceed the limit of {MAX_ELEMENTS} elements"
        ))),
    }
}

/// Wraps a possibly negative dimension index of a rank-`rank` tensor.
pub fn wrap_dim(dim: i64, rank: usize) -> Result<usize, EvalError> {
    // A 0-d tensor accepts dims 0 and -1, as in torch.
    let n = rank.max(1) as i64;
    let d = if dim < 0 { dim + n } else { dim };
    if (0..n).contains(&d) {
        Ok(d as usize)
    } else {
        Err(EvalError(format!(
            "dimension {dim} is out of range for a tensor of rank {rank}"
        )))
    }
}

/// The broadcast shape of `a` and `b` (numpy rules).
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, EvalError> {
    let rank = a.len().max(b.len());
    let at = |s: &[usize], i: usize| {
        let pad = rank - s.len();
        if i < pad {
            1
        } else {
            s[i - pad]
        }
    };
    (0..rank)
        .map(|i| match (at(a, i), at(b, i)) {
            (x, y) if x == y => Ok(x),
            (1, y) => Ok(y),
            (x, 1) => Ok(x),
            (x, y) => Err(EvalError(format!(
                "shapes {a:?} and {b:?} cannot be broadcast together (dimension {i}: {x} and {y})"
            ))),
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(|shape| checked_shape(&shape).map(|()| shape))
}

/// For each element of an array of shape `to`, the flat index of the element of an
/// array of shape `from` that broadcasting reads (`from` must broadcast to `to`).
pub fn broadcast_map(from: &[usize], to: &[usize]) -> Vec<usize> {
    let n: usize = to.iter().product();
    if from == to {
        return (0..n).collect();
    }
    let pad = to.len() - from.len();
    let from_strides = strides(from);
    // The stride in `from` of each dimension of `to` (0 where broadcast).
    let step: Vec<usize> = (0..to.len())
        .map(|d| {
            if d < pad || from[d - pad] == 1 {
                0
            } else {
                from_strides[d - pad]
            }
        })
        .collect();
    strided_map(to, &step, 0)
}

/// For each element of an array of shape `shape`, the flat index `base + sum_d coord_d *
/// step_d` in another array: the general form of broadcasting and basic indexing.
pub fn strided_map(shape: &[usize], step: &[usize], base: usize) -> Vec<usize> {
    let n: usize = shape.iter().product();
    let mut map = Vec::with_capacity(n);
    let mut coord = vec![0usize; shape.len()];
    let mut at = base;
    for _ in 0..n {
        map.push(at);
        // Advance the odometer, keeping `at` in step with it.
        for d in (0..shape.len()).rev() {
            coord[d] += 1;
            at += step[d];
            if coord[d] < shape[d] {
                break;
            }
            at -= step[d] * coord[d];
            coord[d] = 0;
        }
    }
    map
}

/// Adds `values` (one per element of the array the map was built for) into an array of
/// `len` elements at the mapped positions: the backward pass of a gather.
pub fn scatter_add(values: &[f64], map: &[usize], len: usize) -> Vec<f64> {
    let mut out = vec![0.0; len];
    for (v, &i) in values.iter().zip(map) {
        out[i] += v;
    }
    out
}

/// A reduction over some dimensions of `shape`: the kept-dims output shape and, for each
/// input element, the flat index of the output element it reduces into.
pub struct Reduction {
    /// The output shape with reduced dimensions kept as 1.
    pub keep_shape: Vec<usize>,
    /// Input flat index -> output flat index.
    pub map: Vec<usize>,
    /// Elements reduced into each output element.
    pub count: usize,
}

/// Plans the reduction of `shape` over `dims` (each already wrapped, no repeats).
pub fn reduction(shape: &[usize], dims: &[usize]) -> Reduction {
    let keep_shape: Vec<usize> = shape
        .iter()
        .enumerate()
        .map(|(d, &n)| if dims.contains(&d) { 1 } else { n })
        .collect();
    let count = dims.iter().map(|&d| shape[d]).product();
    Reduction {
        map: broadcast_map(&keep_shape, shape),
        keep_shape,
        count,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_maps_read_the_right_elements() {
        // [2, 1] against [2, 3]: each row repeats its one value.
        assert_eq!(broadcast_map(&[2, 1], &[2, 3]), vec![0, 0, 0, 1, 1, 1]);
        // [3] against [2, 3]: rows repeat the vector.
        assert_eq!(broadcast_map(&[3], &[2, 3]), vec![0, 1, 2, 0, 1, 2]);
        // A 0-d array reads its one value everywhere.
        assert_eq!(broadcast_map(&[], &[2, 2]), vec![0; 4]);
        assert_eq!(broadcast_shape(&[4, 1], &[3]).unwrap(), vec![4, 3]);
        assert!(broadcast_shape(&[2], &[3]).is_err());
    }

    #[test]
    fn reductions_map_each_element_to_its_output() {
        let r = reduction(&[2, 3], &[1]);
        assert_eq!(r.keep_shape, vec![2, 1]);
        assert_eq!(r.map, vec![0, 0, 0, 1, 1, 1]);
        assert_eq!(r.count, 3);
        let r = reduction(&[2, 3], &[0]);
        assert_eq!(r.map, vec![0, 1, 2, 0, 1, 2]);
        let r = reduction(&[2, 3], &[0, 1]);
        assert_eq!(r.map, vec![0; 6]);
        assert_eq!(r.count, 6);
    }

    #[test]
    fn sizes_are_checked_not_overflowed() {
        assert!(checked_size(&[usize::MAX, 2], usize::MAX).is_err());
        assert!(checked_size(&[1000, 1000], 999_999).is_err());
        assert_eq!(checked_size(&[], 1).unwrap(), 1);
        assert_eq!(wrap_dim(-1, 2).unwrap(), 1);
        assert!(wrap_dim(2, 2).is_err());
        assert_eq!(wrap_dim(-1, 0).unwrap(), 0);
    }
}
