//! The values a loss's nodes hold while it runs: tensors, Python numbers and the few
//! other things a traced graph passes around (shapes, slices, dtypes).

use std::rc::Rc;

use super::array::{Array, Kind};
use super::compile::Arg;
use super::EvalError;

/// A node's value.
#[derive(Debug, Clone)]
pub enum Val {
    /// A tensor.
    Array(Rc<Array>),
    /// A Python number (a bool is `Kind::Bool`, an int `Kind::Int`).
    Scalar(f64, Kind),
    /// `None`.
    None,
    /// A string (an attribute name).
    Str(String),
    /// A tuple or list.
    Seq(Vec<Val>),
    /// A slice's start, stop and step.
    Slice(Box<[Val; 3]>),
    /// `...`.
    Ellipsis,
    /// A dtype.
    Dtype(Kind),
}

impl Val {
    /// What the value is, for error messages.
    pub fn describe(&self) -> String {
        match self {
            Val::Array(a) => format!("a tensor of shape {:?}", a.shape),
            Val::Scalar(v, _) => format!("the number {v}"),
            Val::None => "None".into(),
            Val::Str(s) => format!("the string {s:?}"),
            Val::Seq(items) => format!("a sequence of {} items", items.len()),
            Val::Slice(_) => "a slice".into(),
            Val::Ellipsis => "...".into(),
            Val::Dtype(_) => "a dtype".into(),
        }
    }

    /// A tensor operand: a tensor, or a number as a 0-d tensor.
    pub fn operand(&self, what: &str) -> Result<Rc<Array>, EvalError> {
        match self {
            Val::Array(a) => Ok(a.clone()),
            Val::Scalar(v, kind) => Ok(Rc::new(Array::scalar(*v, *kind))),
            other => Err(EvalError(format!(
                "{what} must be a tensor or a number, got {}",
                other.describe()
            ))),
        }
    }

    /// An integer (a Python int, or a 0-d integer tensor).
    pub fn int(&self, what: &str) -> Result<i64, EvalError> {
        let v = match self {
            Val::Scalar(v, Kind::Int | Kind::Bool) => *v,
            Val::Array(a) if a.numel() == 1 && a.kind != Kind::Float && a.rank() == 0 => a.data[0],
            other => {
                return Err(EvalError(format!(
                    "{what} must be an integer, got {}",
                    other.describe()
                )))
            }
        };
        Ok(v as i64)
    }

    /// A list of integers: one integer, or a sequence of them.
    pub fn ints(&self, what: &str) -> Result<Vec<i64>, EvalError> {
        match self {
            Val::Seq(items) => items.iter().map(|v| v.int(what)).collect(),
            other => Ok(vec![other.int(what)?]),
        }
    }

    /// A bool flag (`keepdim`).
    pub fn flag(&self, what: &str) -> Result<bool, EvalError> {
        match self {
            Val::Scalar(v, Kind::Bool | Kind::Int) => Ok(*v != 0.0),
            other => Err(EvalError(format!(
                "{what} must be True or False, got {}",
                other.describe()
            ))),
        }
    }
}

/// Evaluates a compiled argument against the values computed so far.
pub fn eval_arg(arg: &Arg, values: &[Val]) -> Val {
    match arg {
        Arg::Node(i) => values[*i].clone(),
        Arg::None => Val::None,
        Arg::Scalar(v, k) => Val::Scalar(*v, *k),
        Arg::Str(s) => Val::Str(s.clone()),
        Arg::Seq(items) => Val::Seq(items.iter().map(|a| eval_arg(a, values)).collect()),
        Arg::Slice(parts) => Val::Slice(Box::new([
            eval_arg(&parts[0], values),
            eval_arg(&parts[1], values),
            eval_arg(&parts[2], values),
        ])),
        Arg::Ellipsis => Val::Ellipsis,
        Arg::Dtype(k) => Val::Dtype(*k),
    }
}

/// The nodes an argument reads (directly or inside a sequence).
pub fn arg_nodes(arg: &Arg, out: &mut Vec<usize>) {
    match arg {
        Arg::Node(i) => out.push(*i),
        Arg::Seq(items) => items.iter().for_each(|a| arg_nodes(a, out)),
        Arg::Slice(parts) => parts.iter().for_each(|a| arg_nodes(a, out)),
        _ => {}
    }
}

/// Values of `kind` stored as f64: integers truncate toward zero, bools are 0 or 1.
pub fn cast_value(v: f64, kind: Kind) -> f64 {
    match kind {
        Kind::Float => v,
        Kind::Int => v.trunc(),
        Kind::Bool => f64::from(u8::from(v != 0.0)),
    }
}
