//! Runs a compiled loss on one datum: a forward pass over the steps that keeps every
//! value, then reverse-mode differentiation back to `logprobs`.

use std::rc::Rc;

use super::array::{checked_shape, scatter_add, wrap_dim, Array, Kind};
use super::compile::{Arg, Binary, Func, Program, Reduce, Step};
use super::elementwise::{self as ew, binary_differentiable, unary_differentiable};
use super::shape;
use super::value::{arg_nodes, cast_value, eval_arg, Val};
use super::{EvalError, MAX_ELEMENTS, MAX_TOTAL_ELEMENTS};

/// A loss's value on one datum, with its gradient and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluated {
    /// The loss.
    pub loss: f64,
    /// `dLoss/dlogprobs`, laid out as `logprobs`.
    pub grad: Vec<f64>,
    /// The metrics, in the program's order.
    pub metrics: Vec<f64>,
    /// Elements of all the tensors the forward evaluation made (a measure of its work).
    pub elements: usize,
}

/// Runs `program` with `inputs` (`logprobs` first).
pub fn run(program: &Program, inputs: Vec<Array>) -> Result<Evaluated, EvalError> {
    let mut values: Vec<Val> = Vec::with_capacity(program.steps.len());
    let mut needs: Vec<bool> = Vec::with_capacity(program.steps.len());
    let mut inputs: Vec<Option<Array>> = inputs.into_iter().map(Some).collect();
    let mut used = 0usize;
    for (i, step) in program.steps.iter().enumerate() {
        let at = |e: EvalError| EvalError(format!("node {:?}: {}", program.names[i], e.0));
        let (value, grad) = match step {
            Step::Input(k) => {
                let input = inputs[*k]
                    .take()
                    .expect("each input is read by one placeholder");
                (Val::Array(Rc::new(input)), *k == 0)
            }
            Step::Call { func, args } => {
                let vals = eval_args(args, &values);
                let value = call(*func, &vals).map_err(at)?;
                let from_logprobs = args.iter().flatten().any(|a| {
                    let mut nodes = Vec::new();
                    arg_nodes(a, &mut nodes);
                    nodes.iter().any(|&n| needs[n])
                });
                let float = matches!(&value, Val::Array(a) if a.kind == Kind::Float);
                (value, from_logprobs && float && differentiable(*func))
            }
        };
        if let Val::Array(a) = &value {
            checked_shape(&a.shape).map_err(at)?;
            used = used.saturating_add(a.numel());
            if used > MAX_TOTAL_ELEMENTS {
                return Err(at(EvalError(format!(
                    "the loss's tensors exceed {MAX_TOTAL_ELEMENTS} elements in all"
                ))));
            }
        }
        values.push(value);
        needs.push(grad);
    }
    let loss = match &values[program.loss] {
        Val::Array(a) if a.rank() == 0 => a.data[0],
        other => {
            return Err(EvalError(format!(
                "the loss must be a 0-d tensor, got {}",
                other.describe()
            )))
        }
    };
    if !loss.is_finite() {
        return Err(EvalError(format!(
            "the loss is {loss}, not a finite number"
        )));
    }
    let metrics = program
        .metrics
        .iter()
        .map(|(key, at)| {
            let v = match &values[*at] {
                Val::Array(a) if a.numel() == 1 => a.data[0],
                Val::Scalar(v, _) => *v,
                other => {
                    return Err(EvalError(format!(
                        "metric {key:?} must hold one number, got {}",
                        other.describe()
                    )))
                }
            };
            if v.is_finite() {
                Ok(v)
            } else {
                Err(EvalError(format!(
                    "metric {key:?} is {v}, not a finite number"
                )))
            }
        })
        .collect::<Result<_, _>>()?;
    let grad = backward(program, &values, &needs)?;
    Ok(Evaluated {
        loss,
        grad,
        metrics,
        elements: used,
    })
}

fn eval_args(args: &[Option<Arg>], values: &[Val]) -> Vec<Option<Val>> {
    args.iter()
        .map(|a| a.as_ref().map(|a| eval_arg(a, values)))
        .collect()
}

/// Whether gradients flow through `func` at all.
fn differentiable(func: Func) -> bool {
    match func {
        Func::Unary(op) => unary_differentiable(op),
        Func::Binary(op) => binary_differentiable(op),
        Func::Detach | Func::GetAttr | Func::Size | Func::Numel | Func::Dim | Func::Like { .. } => {
            false
        }
        _ => true,
    }
}

/// Reverse mode from the loss to `logprobs` (step 0).
fn backward(program: &Program, values: &[Val], needs: &[bool]) -> Result<Vec<f64>, EvalError> {
    let Val::Array(logprobs) = &values[0] else {
        unreachable!("step 0 is the logprobs input")
    };
    let mut grads: Vec<Option<Vec<f64>>> = vec![None; values.len()];
    if needs[program.loss] {
        grads[program.loss] = Some(vec![1.0]);
    }
    for i in (1..program.steps.len()).rev() {
        let (Some(g), Step::Call { func, args }) = (grads[i].take(), &program.steps[i]) else {
            continue;
        };
        let Val::Array(out) = &values[i] else {
            continue;
        };
        let vals = eval_args(args, values);
        for (param, grad) in input_grads(*func, &vals, out, &g)? {
            if let Some(Arg::Node(n)) = &args[param] {
                if needs[*n] {
                    match &mut grads[*n] {
                        Some(acc) => acc.iter_mut().zip(&grad).for_each(|(a, b)| *a += b),
                        slot => *slot = Some(grad),
                    }
                }
            }
        }
    }
    let grad = grads[0]
        .take()
        .unwrap_or_else(|| vec![0.0; logprobs.numel()]);
    if let Some(bad) = grad.iter().find(|g| !g.is_finite()) {
        return Err(EvalError(format!(
            "the gradient of the loss in logprobs holds {bad}, not a finite number"
        )));
    }
    Ok(grad)
}

/// A required argument (the compiler checked it is bound).
fn req(vals: &[Option<Val>], i: usize) -> &Val {
    vals[i].as_ref().expect("required arguments are bound")
}

/// An optional argument, `None` when absent or Python's `None`.
fn opt(vals: &[Option<Val>], i: usize) -> Option<&Val> {
    vals.get(i)
        .and_then(|v| v.as_ref())
        .filter(|v| !matches!(v, Val::None))
}

fn array(v: &Val, what: &str) -> Result<Rc<Array>, EvalError> {
    match v {
        Val::Array(a) => Ok(a.clone()),
        other => Err(EvalError(format!(
            "{what} must be a tensor, got {}",
            other.describe()
        ))),
    }
}

fn number(v: &Val, what: &str) -> Result<f64, EvalError> {
    match v {
        Val::Scalar(x, _) => Ok(*x),
        Val::Array(a) if a.numel() == 1 && a.rank() == 0 => Ok(a.data[0]),
        other => Err(EvalError(format!(
            "{what} must be a number, got {}",
            other.describe()
        ))),
    }
}

fn with_shape(x: &Array, shape: Vec<usize>) -> Val {
    Val::Array(Rc::new(Array::new(shape, x.data.clone(), x.kind)))
}

fn cast(x: &Array, kind: Kind) -> Val {
    Val::Array(Rc::new(Array::new(
        x.shape.clone(),
        x.data.iter().map(|&v| cast_value(v, kind)).collect(),
        kind,
    )))
}

/// `clamp`'s bounds as tensors (an absent bound is infinite).
fn bounds(func: Func, vals: &[Option<Val>]) -> Result<(Rc<Array>, Rc<Array>), EvalError> {
    let bound = |v: Option<&Val>, inf: f64| match v {
        Some(v) => v.operand("a clamp bound"),
        None => Ok(Rc::new(Array::scalar(inf, Kind::Float))),
    };
    let (lo, hi) = match func {
        Func::ClampMin => (opt(vals, 1), None),
        Func::ClampMax => (None, opt(vals, 1)),
        _ => (opt(vals, 1), opt(vals, 2)),
    };
    if func == Func::Clamp && lo.is_none() && hi.is_none() {
        return Err(EvalError("clamp needs min, max or both".into()));
    }
    Ok((bound(lo, f64::NEG_INFINITY)?, bound(hi, f64::INFINITY)?))
}

/// The one dimension of a softmax or cumsum (`None` for a 0-d tensor).
fn one_dim(x: &Array, v: &Val) -> Result<Option<usize>, EvalError> {
    let d = v.int("dim")?;
    let w = wrap_dim(d, x.rank())?;
    Ok((x.rank() > 0).then_some(w))
}

/// Whether `max`/`min` reduces everything (one tensor) or is elementwise (two).
fn max_min_is_reduction(vals: &[Option<Val>]) -> Result<bool, EvalError> {
    match opt(vals, 1) {
        None => Ok(true),
        Some(Val::Array(_)) | Some(Val::Scalar(_, Kind::Float)) => Ok(false),
        Some(_) => Err(EvalError(
            "max/min along a dimension return values and indices, which custom losses do not \
             support; use amax/amin"
                .into(),
        )),
    }
}

fn call(func: Func, vals: &[Option<Val>]) -> Result<Val, EvalError> {
    let x = req(vals, 0);
    Ok(match func {
        Func::Unary(op) => match x {
            Val::Scalar(v, k) => {
                let (v, k) = ew::unary_scalar(op, *v, *k)?;
                Val::Scalar(v, k)
            }
            other => Val::Array(Rc::new(ew::unary(op, &*other.operand("input")?)?)),
        },
        Func::Binary(op) => {
            let y = req(vals, 1);
            let alpha = opt(vals, 2).map_or(Ok(1.0), |a| number(a, "alpha"))?;
            match (x, y) {
                (Val::Scalar(a, ka), Val::Scalar(b, kb)) => {
                    let (v, k) = ew::binary_scalar(op, (*a, *ka), (*b, *kb), alpha)?;
                    Val::Scalar(v, k)
                }
                _ => Val::Array(Rc::new(ew::binary(
                    op,
                    &*x.operand("input")?,
                    &*y.operand("other")?,
                    alpha,
                    MAX_ELEMENTS,
                )?)),
            }
        }
        Func::Clamp | Func::ClampMin | Func::ClampMax => {
            let (lo, hi) = bounds(func, vals)?;
            Val::Array(Rc::new(ew::clamp(
                &*x.operand("input")?,
                &lo,
                &hi,
                MAX_ELEMENTS,
            )?))
        }
        Func::Where => Val::Array(Rc::new(ew::select(
            &*x.operand("condition")?,
            &*req(vals, 1).operand("input")?,
            &*req(vals, 2).operand("other")?,
            MAX_ELEMENTS,
        )?)),
        Func::MaskedFill => Val::Array(Rc::new(ew::masked_fill(
            &*array(x, "input")?,
            &*array(req(vals, 1), "mask")?,
            &*req(vals, 2).operand("value")?,
        )?)),
        Func::Reduce(op) => {
            let x = array(x, "input")?;
            let dims = shape::reduce_dims(x.rank(), opt(vals, 1).unwrap_or(&Val::None))?;
            let keepdim = opt(vals, 2).map_or(Ok(false), |v| v.flag("keepdim"))?;
            let out = shape::reduce(op, &x, &dims, keepdim)?;
            match opt(vals, 3) {
                Some(Val::Dtype(kind)) => cast(&out, *kind),
                Some(other) => {
                    return Err(EvalError(format!(
                        "dtype must be a torch dtype, got {}",
                        other.describe()
                    )))
                }
                None => Val::Array(Rc::new(out)),
            }
        }
        Func::MaxMin { max } => {
            let x = array(x, "input")?;
            if max_min_is_reduction(vals)? {
                let op = if max { Reduce::Amax } else { Reduce::Amin };
                let dims = shape::reduce_dims(x.rank(), &Val::None)?;
                Val::Array(Rc::new(shape::reduce(op, &x, &dims, false)?))
            } else {
                let op = if max {
                    Binary::Maximum
                } else {
                    Binary::Minimum
                };
                let y = req(vals, 1).operand("other")?;
                Val::Array(Rc::new(ew::binary(op, &x, &y, 1.0, MAX_ELEMENTS)?))
            }
        }
        Func::LogSumExp => {
            let x = array(x, "input")?;
            let dims = shape::reduce_dims(x.rank(), req(vals, 1))?;
            let keepdim = opt(vals, 2).map_or(Ok(false), |v| v.flag("keepdim"))?;
            Val::Array(Rc::new(shape::logsumexp(&x, &dims, keepdim)))
        }
        Func::Softmax { log } => {
            let x = array(x, "input")?;
            let dim: Vec<usize> = one_dim(&x, req(vals, 1))?.into_iter().collect();
            Val::Array(Rc::new(shape::softmax(&x, &dim, log)))
        }
        Func::Cumsum => {
            let x = array(x, "input")?;
            let dim = one_dim(&x, req(vals, 1))?;
            Val::Array(Rc::new(shape::cumsum(&x, dim)))
        }
        Func::Cast(kind) => cast(&*array(x, "input")?, kind),
        Func::To => match opt(vals, 1) {
            Some(Val::Dtype(kind)) => cast(&*array(x, "input")?, *kind),
            None => x.clone(),
            Some(other) => {
                return Err(EvalError(format!(
                    "to() takes a dtype here, got {}",
                    other.describe()
                )))
            }
        },
        Func::TypeAs => cast(&*array(x, "input")?, array(req(vals, 1), "other")?.kind),
        Func::Detach | Func::Identity => Val::Array(array(x, "input")?),
        Func::GetItem => match x {
            Val::Seq(items) => {
                let i = req(vals, 1).int("a sequence index")?;
                let n = items.len() as i64;
                let at = if i < 0 { i + n } else { i };
                items
                    .get(usize::try_from(at).unwrap_or(usize::MAX))
                    .cloned()
                    .ok_or_else(|| EvalError(format!("index {i} is out of range for {n} items")))?
            }
            other => {
                let x = array(other, "input")?;
                let (shape, map) = shape::index_map(&x.shape, req(vals, 1))?;
                let data = map.iter().map(|&i| x.data[i]).collect();
                Val::Array(Rc::new(Array::new(shape, data, x.kind)))
            }
        },
        Func::GetAttr => {
            let x = array(x, "input")?;
            match req(vals, 1) {
                Val::Str(name) if name == "shape" => shape_of(&x),
                _ => Val::Scalar(x.rank() as f64, Kind::Int),
            }
        }
        Func::Unsqueeze => {
            let x = array(x, "input")?;
            with_shape(&x, shape::unsqueezed(&x.shape, req(vals, 1).int("dim")?)?)
        }
        Func::Squeeze => {
            let x = array(x, "input")?;
            let dims = opt(vals, 1).map(|v| v.ints("dim")).transpose()?;
            with_shape(&x, shape::squeezed(&x.shape, dims.as_deref())?)
        }
        Func::Reshape => {
            let x = array(x, "input")?;
            with_shape(
                &x,
                shape::reshaped(&x.shape, &req(vals, 1).ints("a size")?)?,
            )
        }
        Func::Flatten => {
            let x = array(x, "input")?;
            let start = opt(vals, 1).map_or(Ok(0), |v| v.int("start_dim"))?;
            let end = opt(vals, 2).map_or(Ok(-1), |v| v.int("end_dim"))?;
            with_shape(&x, shape::flattened(&x.shape, start, end)?)
        }
        Func::Size => {
            let x = array(x, "input")?;
            match opt(vals, 1) {
                None => shape_of(&x),
                Some(d) => {
                    let d = wrap_dim(d.int("dim")?, x.rank())?;
                    Val::Scalar(x.shape.get(d).copied().unwrap_or(1) as f64, Kind::Int)
                }
            }
        }
        Func::Numel => Val::Scalar(array(x, "input")?.numel() as f64, Kind::Int),
        Func::Dim => Val::Scalar(array(x, "input")?.rank() as f64, Kind::Int),
        Func::Like { fill } => {
            let x = array(x, "input")?;
            let (value, dtype_at) = match fill {
                Some(v) => (Val::Scalar(v, x.kind), 1),
                None => (req(vals, 1).clone(), 2),
            };
            let kind = match opt(vals, dtype_at) {
                Some(Val::Dtype(k)) => *k,
                Some(other) => {
                    return Err(EvalError(format!(
                        "dtype must be a torch dtype, got {}",
                        other.describe()
                    )))
                }
                None => x.kind,
            };
            let v = cast_value(number(&value, "fill_value")?, kind);
            Val::Array(Rc::new(Array::new(
                x.shape.clone(),
                vec![v; x.numel()],
                kind,
            )))
        }
    })
}

fn shape_of(x: &Array) -> Val {
    Val::Seq(
        x.shape
            .iter()
            .map(|&d| Val::Scalar(d as f64, Kind::Int))
            .collect(),
    )
}

/// The gradients `func` passes to its tensor parameters (by parameter index), given
/// its output `y` and the output's gradient `g`.
fn input_grads(
    func: Func,
    vals: &[Option<Val>],
    y: &Array,
    g: &[f64],
) -> Result<Vec<(usize, Vec<f64>)>, EvalError> {
    let x = req(vals, 0);
    Ok(match func {
        Func::Unary(op) => vec![(0, ew::unary_grad(op, &*x.operand("input")?, y, g))],
        Func::Binary(op) => {
            let alpha = opt(vals, 2).map_or(Ok(1.0), |a| number(a, "alpha"))?;
            let (a, b) = (x.operand("input")?, req(vals, 1).operand("other")?);
            let (ga, gb) = ew::binary_grad(op, &a, &b, alpha, y, g);
            vec![(0, ga), (1, gb)]
        }
        Func::Clamp | Func::ClampMin | Func::ClampMax => {
            let (lo, hi) = bounds(func, vals)?;
            let [gx, glo, ghi] = ew::clamp_grad(&*x.operand("input")?, &lo, &hi, y, g);
            match func {
                Func::ClampMin => vec![(0, gx), (1, glo)],
                Func::ClampMax => vec![(0, gx), (1, ghi)],
                _ => vec![(0, gx), (1, glo), (2, ghi)],
            }
        }
        Func::Where => {
            let (c, a, b) = (
                x.operand("condition")?,
                req(vals, 1).operand("input")?,
                req(vals, 2).operand("other")?,
            );
            let (ga, gb) = ew::select_grad(&c, &a, &b, y, g);
            vec![(1, ga), (2, gb)]
        }
        Func::MaskedFill => {
            let (gx, gv) =
                ew::masked_fill_grad(&*array(x, "input")?, &*array(req(vals, 1), "mask")?, g);
            vec![(0, gx), (2, gv)]
        }
        Func::Reduce(op) => {
            let x = array(x, "input")?;
            let dims = shape::reduce_dims(x.rank(), opt(vals, 1).unwrap_or(&Val::None))?;
            vec![(0, shape::reduce_grad(op, &x, &dims, y, g))]
        }
        Func::MaxMin { max } => {
            let x = array(x, "input")?;
            if max_min_is_reduction(vals)? {
                let op = if max { Reduce::Amax } else { Reduce::Amin };
                let dims = shape::reduce_dims(x.rank(), &Val::None)?;
                vec![(0, shape::reduce_grad(op, &x, &dims, y, g))]
            } else {
                let op = if max {
                    Binary::Maximum
                } else {
                    Binary::Minimum
                };
                let other = req(vals, 1).operand("other")?;
                let (ga, gb) = ew::binary_grad(op, &x, &other, 1.0, y, g);
                vec![(0, ga), (1, gb)]
            }
        }
        Func::LogSumExp => {
            let x = array(x, "input")?;
            let dims = shape::reduce_dims(x.rank(), req(vals, 1))?;
            vec![(0, shape::logsumexp_grad(&x, &dims, y, g))]
        }
        Func::Softmax { log } => {
            let x = array(x, "input")?;
            let dim: Vec<usize> = one_dim(&x, req(vals, 1))?.into_iter().collect();
            vec![(0, shape::softmax_grad(&x, &dim, y, g, log))]
        }
        Func::Cumsum => {
            let x = array(x, "input")?;
            vec![(0, shape::cumsum_grad(&x, one_dim(&x, req(vals, 1))?, g))]
        }
        Func::GetItem => {
            let x = array(x, "input")?;
            let (_, map) = shape::index_map(&x.shape, req(vals, 1))?;
            vec![(0, scatter_add(g, &map, x.numel()))]
        }
        // Same values in a new shape or dtype: the gradient passes unchanged.
        Func::Cast(_)
        | Func::To
        | Func::TypeAs
        | Func::Identity
        | Func::Unsqueeze
        | Func::Squeeze
        | Func::Reshape
        | Func::Flatten => vec![(0, g.to_vec())],
        Func::Detach | Func::GetAttr | Func::Size | Func::Numel | Func::Dim | Func::Like { .. } => {
            Vec::new()
        }
    })
}
