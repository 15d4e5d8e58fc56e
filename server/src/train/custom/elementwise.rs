//! Elementwise functions with broadcasting, and their derivatives. Ties and edges follow
//! torch's autograd: `minimum`/`maximum` split the gradient of equal operands in half,
//! `clamp` passes it to the input at its bounds, `abs` and `relu` have derivative 0 at
//! 0, and `pow` has no gradient in the exponent where the base is 0.

use super::array::{broadcast_map, broadcast_shape, checked_size, Array, Kind};
use super::compile::{Binary, Unary};
use super::EvalError;

/// Whether the unary function passes gradients (rounding and logic do not).
pub fn unary_differentiable(op: Unary) -> bool {
    !matches!(
        op,
        Unary::Sign | Unary::Floor | Unary::Ceil | Unary::Round | Unary::LogicalNot
    )
}

/// Whether the binary function passes gradients.
pub fn binary_differentiable(op: Binary) -> bool {
    matches!(
        op,
        Binary::Add
            | Binary::Sub
            | Binary::Mul
            | Binary::Div
            | Binary::Pow
            | Binary::Minimum
            | Binary::Maximum
    )
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

fn unary_value(op: Unary, x: f64) -> f64 {
    match op {
        Unary::Exp => x.exp(),
        Unary::Log => x.ln(),
        Unary::Log1p => x.ln_1p(),
        Unary::Expm1 => x.exp_m1(),
        Unary::Neg => -x,
        Unary::Pos => x,
        Unary::Abs => x.abs(),
        Unary::Sqrt => x.sqrt(),
        Unary::Rsqrt => 1.0 / x.sqrt(),
        Unary::Sigmoid => sigmoid(x),
        // log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)), exact for large |x|.
        Unary::LogSigmoid => x.min(0.0) - (-x.abs()).exp().ln_1p(),
        Unary::Tanh => x.tanh(),
        Unary::Relu => x.max(0.0),
        Unary::Square => x * x,
        Unary::Reciprocal => 1.0 / x,
        Unary::Sign => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                x
            }
        }
        Unary::Floor => x.floor(),
        Unary::Ceil => x.ceil(),
        Unary::Round => x.round_ties_even(),
        Unary::LogicalNot => f64::from(u8::from(x == 0.0)),
    }
}

/// `dy/dx` at `x`, where `y` is the value there.
fn unary_derivative(op: Unary, x: f64, y: f64) -> f64 {
    match op {
        Unary::Exp => y,
        Unary::Log => 1.0 / x,
        Unary::Log1p => 1.0 / (1.0 + x),
        Unary::Expm1 => y + 1.0,
        Unary::Neg => -1.0,
        Unary::Pos => 1.0,
        Unary::Abs => unary_value(Unary::Sign, x),
        Unary::Sqrt => 0.5 / y,
        Unary::Rsqrt => -0.5 * y * y * y,
        Unary::Sigmoid => y * (1.0 - y),
        Unary::LogSigmoid => sigmoid(-x),
        Unary::Tanh => 1.0 - y * y,
        Unary::Relu => f64::from(u8::from(x > 0.0)),
        Unary::Square => 2.0 * x,
        Unary::Reciprocal => -y * y,
        Unary::Sign | Unary::Floor | Unary::Ceil | Unary::Round | Unary::LogicalNot => 0.0,
    }
}

/// The kind a unary function returns for an input of `kind`.
fn unary_kind(op: Unary, kind: Kind) -> Result<Kind, EvalError> {
    Ok(match op {
        Unary::LogicalNot if kind != Kind::Bool => {
            return Err(EvalError(
                "~ and logical_not take bool tensors (comparison results) here".into(),
            ))
        }
        Unary::LogicalNot => Kind::Bool,
        Unary::Neg | Unary::Pos | Unary::Abs | Unary::Sign | Unary::Square | Unary::Relu
            if kind != Kind::Bool =>
        {
            kind
        }
        Unary::Floor | Unary::Ceil | Unary::Round if kind != Kind::Bool => kind,
        _ => Kind::Float,
    })
}

/// `op` applied to a Python number.
pub fn unary_scalar(op: Unary, x: f64, kind: Kind) -> Result<(f64, Kind), EvalError> {
    Ok((unary_value(op, x), unary_kind(op, kind)?))
}

/// `op` applied to every element.
pub fn unary(op: Unary, x: &Array) -> Result<Array, EvalError> {
    let kind = unary_kind(op, x.kind)?;
    Ok(Array::new(
        x.shape.clone(),
        x.data.iter().map(|&v| unary_value(op, v)).collect(),
        kind,
    ))
}

/// The gradient of a unary function's input, given its output `y` and the output's
/// gradient `g`.
pub fn unary_grad(op: Unary, x: &Array, y: &Array, g: &[f64]) -> Vec<f64> {
    x.data
        .iter()
        .zip(&y.data)
        .zip(g)
        .map(|((&x, &y), &g)| {
            if g == 0.0 {
                0.0
            } else {
                g * unary_derivative(op, x, y)
            }
        })
        .collect()
}

fn binary_value(op: Binary, a: f64, b: f64, alpha: f64) -> f64 {
    let truth = |t: bool| f64::from(u8::from(t));
    match op {
        Binary::Add => a + alpha * b,
        Binary::Sub => a - alpha * b,
        Binary::Mul => a * b,
        Binary::Div => a / b,
        Binary::FloorDiv => (a / b).floor(),
        Binary::Pow => a.powf(b),
        Binary::Minimum if a.is_nan() || b.is_nan() => f64::NAN,
        Binary::Maximum if a.is_nan() || b.is_nan() => f64::NAN,
        Binary::Minimum => a.min(b),
        Binary::Maximum => a.max(b),
        Binary::Gt => truth(a > b),
        Binary::Lt => truth(a < b),
        Binary::Ge => truth(a >= b),
        Binary::Le => truth(a <= b),
        Binary::Eq => truth(a == b),
        Binary::Ne => truth(a != b),
        Binary::And => truth(a != 0.0 && b != 0.0),
        Binary::Or => truth(a != 0.0 || b != 0.0),
    }
}

/// `(d/da, d/db)` at `(a, b)` with value `y`.
fn binary_partials(op: Binary, a: f64, b: f64, y: f64, alpha: f64) -> (f64, f64) {
    match op {
        Binary::Add => (1.0, alpha),
        Binary::Sub => (1.0, -alpha),
        Binary::Mul => (b, a),
        Binary::Div => (1.0 / b, -a / (b * b)),
        Binary::Pow => {
            let da = if b == 0.0 { 0.0 } else { b * a.powf(b - 1.0) };
            let db = if a == 0.0 && b >= 0.0 {
                0.0
            } else {
                y * a.ln()
            };
            (da, db)
        }
        Binary::Minimum | Binary::Maximum => {
            let a_wins = if op == Binary::Minimum { a < b } else { a > b };
            if a == b {
                (0.5, 0.5)
            } else if a_wins {
                (1.0, 0.0)
            } else {
                (0.0, 1.0)
            }
        }
        _ => (0.0, 0.0),
    }
}

fn binary_kind(op: Binary, a: Kind, b: Kind) -> Result<Kind, EvalError> {
    Ok(match op {
        Binary::Gt | Binary::Lt | Binary::Ge | Binary::Le | Binary::Eq | Binary::Ne => Kind::Bool,
        Binary::And | Binary::Or if a == Kind::Bool && b == Kind::Bool => Kind::Bool,
        Binary::And | Binary::Or => {
            return Err(EvalError(
                "& and | (logical_and, logical_or) take bool tensors here".into(),
            ))
        }
        Binary::Div => Kind::Float,
        _ => a.max(b).max(Kind::Int),
    })
}

/// `op` on two Python numbers.
pub fn binary_scalar(
    op: Binary,
    (a, ka): (f64, Kind),
    (b, kb): (f64, Kind),
    alpha: f64,
) -> Result<(f64, Kind), EvalError> {
    let kind = binary_kind(op, ka, kb)?;
    // Python: an int to a negative int power is a float.
    let kind = if op == Binary::Pow && kind == Kind::Int && b < 0.0 {
        Kind::Float
    } else {
        kind
    };
    Ok((binary_value(op, a, b, alpha), kind))
}

/// `op` on two tensors, broadcast; at most `limit` output elements.
pub fn binary(
    op: Binary,
    a: &Array,
    b: &Array,
    alpha: f64,
    limit: usize,
) -> Result<Array, EvalError> {
    let kind = binary_kind(op, a.kind, b.kind)?;
    if op == Binary::Pow && kind == Kind::Int && b.data.iter().any(|&v| v < 0.0) {
        return Err(EvalError(
            "integers to negative integer powers are not allowed (as in torch)".into(),
        ));
    }
    let shape = broadcast_shape(&a.shape, &b.shape)?;
    checked_size(&shape, limit)?;
    let (ma, mb) = (
        broadcast_map(&a.shape, &shape),
        broadcast_map(&b.shape, &shape),
    );
    let data = ma
        .iter()
        .zip(&mb)
        .map(|(&i, &j)| binary_value(op, a.data[i], b.data[j], alpha))
        .collect();
    Ok(Array::new(shape, data, kind))
}

/// The gradients of both operands of a broadcast binary function (each summed back to
/// its operand's shape).
pub fn binary_grad(
    op: Binary,
    a: &Array,
    b: &Array,
    alpha: f64,
    y: &Array,
    g: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let (ma, mb) = (
        broadcast_map(&a.shape, &y.shape),
        broadcast_map(&b.shape, &y.shape),
    );
    let (mut ga, mut gb) = (vec![0.0; a.numel()], vec![0.0; b.numel()]);
    for (k, (&i, &j)) in ma.iter().zip(&mb).enumerate() {
        if g[k] == 0.0 {
            continue;
        }
        let (da, db) = binary_partials(op, a.data[i], b.data[j], y.data[k], alpha);
        ga[i] += g[k] * da;
        gb[j] += g[k] * db;
    }
    (ga, gb)
}

/// Which operand an element of `clamp` took.
#[derive(Clone, Copy, PartialEq)]
enum Took {
    Input,
    Low,
    High,
}

fn clamp_choice(x: f64, lo: f64, hi: f64) -> Took {
    // torch: a lower bound above the upper one gives the upper bound.
    if lo > hi {
        Took::High
    } else if x < lo {
        Took::Low
    } else if x > hi {
        Took::High
    } else {
        Took::Input
    }
}

/// Broadcasts several operands together: the output shape and each operand's map.
fn broadcast_all(
    operands: &[&Array],
    limit: usize,
) -> Result<(Vec<usize>, Vec<Vec<usize>>), EvalError> {
    let mut shape = Vec::new();
    for a in operands {
        shape = broadcast_shape(&shape, &a.shape)?;
    }
    checked_size(&shape, limit)?;
    let maps = operands
        .iter()
        .map(|a| broadcast_map(&a.shape, &shape))
        .collect();
    Ok((shape, maps))
}

/// `clamp(x, lo, hi)` with tensor (or absent: infinite) bounds.
pub fn clamp(x: &Array, lo: &Array, hi: &Array, limit: usize) -> Result<Array, EvalError> {
    let (shape, maps) = broadcast_all(&[x, lo, hi], limit)?;
    let data = (0..maps[0].len())
        .map(|k| {
            let (v, l, h) = (x.data[maps[0][k]], lo.data[maps[1][k]], hi.data[maps[2][k]]);
            match clamp_choice(v, l, h) {
                Took::Input => v,
                Took::Low => l,
                Took::High => h,
            }
        })
        .collect();
    Ok(Array::new(shape, data, x.kind.max(lo.kind).max(hi.kind)))
}

/// The gradients of `clamp`'s input and bounds.
pub fn clamp_grad(x: &Array, lo: &Array, hi: &Array, y: &Array, g: &[f64]) -> [Vec<f64>; 3] {
    let maps = [&x, &lo, &hi].map(|a| broadcast_map(&a.shape, &y.shape));
    let mut grads = [x, lo, hi].map(|a| vec![0.0; a.numel()]);
    for (k, &gk) in g.iter().enumerate() {
        let (v, l, h) = (x.data[maps[0][k]], lo.data[maps[1][k]], hi.data[maps[2][k]]);
        let which = match clamp_choice(v, l, h) {
            Took::Input => 0,
            Took::Low => 1,
            Took::High => 2,
        };
        grads[which][maps[which][k]] += gk;
    }
    grads
}

/// `where(cond, a, b)`.
pub fn select(cond: &Array, a: &Array, b: &Array, limit: usize) -> Result<Array, EvalError> {
    if cond.kind != Kind::Bool {
        return Err(EvalError(
            "where's condition must be a bool tensor (a comparison)".into(),
        ));
    }
    let (shape, maps) = broadcast_all(&[cond, a, b], limit)?;
    let data = (0..maps[0].len())
        .map(|k| {
            if cond.data[maps[0][k]] != 0.0 {
                a.data[maps[1][k]]
            } else {
                b.data[maps[2][k]]
            }
        })
        .collect();
    Ok(Array::new(shape, data, a.kind.max(b.kind)))
}

/// The gradients of `where`'s two value operands.
pub fn select_grad(
    cond: &Array,
    a: &Array,
    b: &Array,
    y: &Array,
    g: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let mc = broadcast_map(&cond.shape, &y.shape);
    let (ma, mb) = (
        broadcast_map(&a.shape, &y.shape),
        broadcast_map(&b.shape, &y.shape),
    );
    let (mut ga, mut gb) = (vec![0.0; a.numel()], vec![0.0; b.numel()]);
    for (k, &gk) in g.iter().enumerate() {
        if cond.data[mc[k]] != 0.0 {
            ga[ma[k]] += gk;
        } else {
            gb[mb[k]] += gk;
        }
    }
    (ga, gb)
}

/// `x.masked_fill(mask, value)`: the mask broadcasts to `x`'s shape.
pub fn masked_fill(x: &Array, mask: &Array, value: &Array) -> Result<Array, EvalError> {
    if mask.kind != Kind::Bool {
        return Err(EvalError("masked_fill's mask must be a bool tensor".into()));
    }
    if value.numel() != 1 || value.rank() != 0 {
        return Err(EvalError(
            "masked_fill's value must be a number or a 0-d tensor".into(),
        ));
    }
    if broadcast_shape(&mask.shape, &x.shape)? != x.shape {
        return Err(EvalError(format!(
            "masked_fill's mask of shape {:?} does not broadcast to the input's {:?}",
            mask.shape, x.shape
        )));
    }
    let mm = broadcast_map(&mask.shape, &x.shape);
    let data = x
        .data
        .iter()
        .zip(&mm)
        .map(|(&v, &m)| {
            if mask.data[m] != 0.0 {
                value.data[0]
            } else {
                v
            }
        })
        .collect();
    Ok(Array::new(x.shape.clone(), data, x.kind))
}

/// The gradients of `masked_fill`'s input and of its (0-d) value.
pub fn masked_fill_grad(x: &Array, mask: &Array, g: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mm = broadcast_map(&mask.shape, &x.shape);
    let mut gv = 0.0;
    let gx = g
        .iter()
        .zip(&mm)
        .map(|(&gk, &m)| {
            if mask.data[m] != 0.0 {
                gv += gk;
                0.0
            } else {
                gk
            }
        })
        .collect();
    (gx, vec![gv])
}
