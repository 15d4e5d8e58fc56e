//! Rebuilds a traced loss from its wire graph using only this module's allow-list: each
//! node becomes a typed [`Step`] whose function is a [`Func`] and whose arguments are
//! bound to that function's parameters. Nothing the client names is ever looked up or
//! executed by name; a node this list does not know is refused with its name.

use std::collections::HashMap;

use lathe_sdk::types::{CustomLossGraph, CustomLossInput, CustomLossNodeOp, GraphArg, TaggedArg};

use super::array::Kind;
use super::{CompileError, MAX_ARGS, MAX_INPUTS, MAX_METRICS, MAX_NODES};

/// Elementwise functions of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unary {
    Exp,
    Log,
    Log1p,
    Expm1,
    Neg,
    Pos,
    Abs,
    Sqrt,
    Rsqrt,
    Sigmoid,
    LogSigmoid,
    Tanh,
    Relu,
    Square,
    Reciprocal,
    Sign,
    Floor,
    Ceil,
    Round,
    LogicalNot,
}

/// Elementwise functions of two tensors (or numbers), with broadcasting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    FloorDiv,
    Pow,
    Minimum,
    Maximum,
    Gt,
    Lt,
    Ge,
    Le,
    Eq,
    Ne,
    And,
    Or,
}

/// Reductions over some or all dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Mean,
    Amax,
    Amin,
}

/// Every function a custom loss may call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Func {
    Unary(Unary),
    Binary(Binary),
    /// `clamp(input, min, max)`.
    Clamp,
    /// `clamp_min(input, min)`.
    ClampMin,
    /// `clamp_max(input, max)`.
    ClampMax,
    /// `where(condition, input, other)`.
    Where,
    /// `input.masked_fill(mask, value)`.
    MaskedFill,
    Reduce(Reduce),
    /// `max`/`min`: a full reduction with one argument, elementwise with a tensor.
    MaxMin {
        max: bool,
    },
    LogSumExp,
    Softmax {
        log: bool,
    },
    Cumsum,
    /// `float()`, `long()`, `bool()` ...
    Cast(Kind),
    /// `to(dtype)`.
    To,
    /// `type_as(other)`.
    TypeAs,
    Detach,
    /// `contiguous()` and `clone()`: the same values.
    Identity,
    GetItem,
    /// `getattr(x, "shape" | "ndim")`.
    GetAttr,
    Unsqueeze,
    Squeeze,
    /// `reshape` and `view`, whose shape may come as separate arguments.
    Reshape,
    Flatten,
    Size,
    Numel,
    Dim,
    /// `zeros_like` (0), `ones_like` (1), `full_like` (its `fill_value`).
    Like {
        fill: Option<f64>,
    },
}

impl Func {
    /// Parameter names, in positional order; arguments bind to them.
    pub fn params(self) -> &'static [&'static str] {
        match self {
            Func::Unary(_) | Func::Detach | Func::Identity | Func::Numel | Func::Dim => &["input"],
            Func::Binary(Binary::Add | Binary::Sub) => &["input", "other", "alpha"],
            Func::Binary(Binary::Pow) => &["input", "exponent"],
            Func::Binary(_) => &["input", "other"],
            Func::Clamp => &["input", "min", "max"],
            Func::ClampMin => &["input", "min"],
            Func::ClampMax => &["input", "max"],
            Func::Where => &["condition", "input", "other"],
            Func::MaskedFill => &["input", "mask", "value"],
            Func::Reduce(_) => &["input", "dim", "keepdim", "dtype"],
            Func::MaxMin { .. } => &["input", "other"],
            Func::LogSumExp => &["input", "dim", "keepdim"],
            Func::Softmax { .. } => &["input", "dim", "_stacklevel", "dtype"],
            Func::Cumsum => &["input", "dim", "dtype"],
            Func::Cast(_) => &["input", "memory_format"],
            Func::To => &["input", "dtype", "non_blocking", "copy"],
            Func::TypeAs => &["input", "other"],
            Func::GetItem => &["input", "index"],
            Func::GetAttr => &["input", "name"],
            Func::Unsqueeze => &["input", "dim"],
            Func::Squeeze => &["input", "dim"],
            Func::Reshape => &["input", "shape"],
            Func::Flatten => &["input", "start_dim", "end_dim"],
            Func::Size => &["input", "dim"],
            Func::Like { fill: None } => &["input", "fill_value", "dtype"],
            Func::Like { .. } => &["input", "dtype"],
        }
    }
}

/// A `call_function` target the allow-list knows.
fn function(target: &str) -> Option<Func> {
    use Binary as B;
    use Unary as U;
    let name = target
        .strip_prefix("torch.nn.functional.")
        .or_else(|| target.strip_prefix("torch._C._nn."))
        .or_else(|| target.strip_prefix("torch.special."))
        .map(|n| ("torch", n))
        .or_else(|| target.strip_prefix("torch.").map(|n| ("torch", n)))
        .or_else(|| target.strip_prefix("operator.").map(|n| ("operator", n)));
    Some(match name {
        Some(("operator", op)) => match op {
            "add" => Func::Binary(B::Add),
            "sub" => Func::Binary(B::Sub),
            "mul" => Func::Binary(B::Mul),
            "truediv" => Func::Binary(B::Div),
            "floordiv" => Func::Binary(B::FloorDiv),
            "pow" => Func::Binary(B::Pow),
            "gt" => Func::Binary(B::Gt),
            "lt" => Func::Binary(B::Lt),
            "ge" => Func::Binary(B::Ge),
            "le" => Func::Binary(B::Le),
            "eq" => Func::Binary(B::Eq),
            "ne" => Func::Binary(B::Ne),
            "and_" => Func::Binary(B::And),
            "or_" => Func::Binary(B::Or),
            "neg" => Func::Unary(U::Neg),
            "pos" => Func::Unary(U::Pos),
            "abs" => Func::Unary(U::Abs),
            "invert" => Func::Unary(U::LogicalNot),
            "getitem" => Func::GetItem,
            _ => return None,
        },
        Some(("torch", f)) => torch_function(f)?,
        _ if target == "getattr" => Func::GetAttr,
        _ => return None,
    })
}

/// A `torch.*` function (or one of `torch.nn.functional`, `torch._C._nn` or
/// `torch.special`), by its short name.
fn torch_function(name: &str) -> Option<Func> {
    Some(match name {
        "where" => Func::Where,
        "zeros_like" => Func::Like { fill: Some(0.0) },
        "ones_like" => Func::Like { fill: Some(1.0) },
        "full_like" => Func::Like { fill: None },
        "max" => Func::MaxMin { max: true },
        "min" => Func::MaxMin { max: false },
        "logical_and" => Func::Binary(Binary::And),
        "logical_or" => Func::Binary(Binary::Or),
        "expit" => Func::Unary(Unary::Sigmoid),
        // torch.nn.functional.logsigmoid is this builtin.
        "log_sigmoid" => Func::Unary(Unary::LogSigmoid),
        "numel" => Func::Numel,
        // Methods and functions share the rest of their names.
        other => method(other)?,
    })
}

/// A `call_method` target (a `torch.Tensor` method) the allow-list knows. In-place
/// methods (a trailing `_`) are not on it.
fn method(name: &str) -> Option<Func> {
    use Binary as B;
    use Unary as U;
    Some(match name {
        "exp" => Func::Unary(U::Exp),
        "log" => Func::Unary(U::Log),
        "log1p" => Func::Unary(U::Log1p),
        "expm1" => Func::Unary(U::Expm1),
        "neg" | "negative" => Func::Unary(U::Neg),
        "abs" => Func::Unary(U::Abs),
        "sqrt" => Func::Unary(U::Sqrt),
        "rsqrt" => Func::Unary(U::Rsqrt),
        "sigmoid" => Func::Unary(U::Sigmoid),
        "logsigmoid" => Func::Unary(U::LogSigmoid),
        "tanh" => Func::Unary(U::Tanh),
        "relu" => Func::Unary(U::Relu),
        "square" => Func::Unary(U::Square),
        "reciprocal" => Func::Unary(U::Reciprocal),
        "sign" => Func::Unary(U::Sign),
        "floor" => Func::Unary(U::Floor),
        "ceil" => Func::Unary(U::Ceil),
        "round" => Func::Unary(U::Round),
        "logical_not" => Func::Unary(U::LogicalNot),
        "add" => Func::Binary(B::Add),
        "sub" | "subtract" => Func::Binary(B::Sub),
        "mul" | "multiply" => Func::Binary(B::Mul),
        "div" | "divide" | "true_divide" => Func::Binary(B::Div),
        "floor_divide" => Func::Binary(B::FloorDiv),
        "pow" => Func::Binary(B::Pow),
        "minimum" => Func::Binary(B::Minimum),
        "maximum" => Func::Binary(B::Maximum),
        "gt" | "greater" => Func::Binary(B::Gt),
        "lt" | "less" => Func::Binary(B::Lt),
        "ge" | "greater_equal" => Func::Binary(B::Ge),
        "le" | "less_equal" => Func::Binary(B::Le),
        "eq" => Func::Binary(B::Eq),
        "ne" | "not_equal" => Func::Binary(B::Ne),
        "logical_and" => Func::Binary(B::And),
        "logical_or" => Func::Binary(B::Or),
        "clamp" | "clip" => Func::Clamp,
        "clamp_min" => Func::ClampMin,
        "clamp_max" => Func::ClampMax,
        "masked_fill" => Func::MaskedFill,
        "sum" => Func::Reduce(Reduce::Sum),
        "mean" => Func::Reduce(Reduce::Mean),
        "amax" => Func::Reduce(Reduce::Amax),
        "amin" => Func::Reduce(Reduce::Amin),
        "max" => Func::MaxMin { max: true },
        "min" => Func::MaxMin { max: false },
        "logsumexp" => Func::LogSumExp,
        "softmax" => Func::Softmax { log: false },
        "log_softmax" => Func::Softmax { log: true },
        "cumsum" => Func::Cumsum,
        "float" | "double" => Func::Cast(Kind::Float),
        "long" | "int" => Func::Cast(Kind::Int),
        "bool" => Func::Cast(Kind::Bool),
        "to" => Func::To,
        "type_as" => Func::TypeAs,
        "detach" => Func::Detach,
        "contiguous" | "clone" => Func::Identity,
        "unsqueeze" => Func::Unsqueeze,
        "squeeze" => Func::Squeeze,
        "reshape" | "view" => Func::Reshape,
        "flatten" => Func::Flatten,
        "size" => Func::Size,
        "numel" => Func::Numel,
        "dim" => Func::Dim,
        _ => return None,
    })
}

/// An argument: another node's value, or a constant (possibly holding node values, as a
/// tuple of sizes may).
#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    Node(usize),
    None,
    Scalar(f64, Kind),
    Str(String),
    Seq(Vec<Arg>),
    Slice(Box<[Arg; 3]>),
    Ellipsis,
    Dtype(Kind),
}

/// One step of a compiled loss.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// The loss's `i`-th input (`logprobs` is 0).
    Input(usize),
    /// A call, its arguments bound to `func.params()` (absent ones `None`).
    Call { func: Func, args: Vec<Option<Arg>> },
}

/// A compiled loss: steps in execution order, and what it returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// The steps.
    pub steps: Vec<Step>,
    /// Each step's node name, for error messages.
    pub names: Vec<String>,
    /// The step whose value is the loss.
    pub loss: usize,
    /// Metric keys and the steps holding them.
    pub metrics: Vec<(String, usize)>,
}

/// Most elements of a constant sequence, and deepest nesting of constants.
const MAX_SEQ: usize = 64;
const MAX_DEPTH: usize = 8;

/// Compiles `graph` for a loss taking `inputs` (already checked by the caller).
pub fn compile(
    graph: &CustomLossGraph,
    inputs: &[CustomLossInput],
) -> Result<Program, CompileError> {
    if graph.format != 1 {
        return Err(CompileError(format!(
            "graph format {} is not supported; this server reads format 1",
            graph.format
        )));
    }
    if graph.nodes.len() > MAX_NODES {
        return Err(CompileError(format!(
            "the graph has {} nodes; the limit is {MAX_NODES}",
            graph.nodes.len()
        )));
    }
    debug_assert!(inputs.len() <= MAX_INPUTS);
    let mut by_name: HashMap<&str, usize> = HashMap::new();
    let mut program = Program {
        steps: Vec::new(),
        names: Vec::new(),
        loss: 0,
        metrics: Vec::new(),
    };
    let mut output = None;
    let mut budget = MAX_ARGS;
    for node in &graph.nodes {
        let at = |what: String| CompileError(format!("node {:?}: {what}", node.name));
        if output.is_some() {
            return Err(at("nodes follow the output node".into()));
        }
        if node.name.is_empty() || node.name.len() > 128 {
            return Err(at("a node name must have 1 to 128 characters".into()));
        }
        let step = match node.op {
            CustomLossNodeOp::Placeholder => {
                let i = program.steps.len();
                let Some(input) = inputs.get(i) else {
                    return Err(at(format!(
                        "the graph has more placeholders than the {} declared inputs",
                        inputs.len()
                    )));
                };
                if program.steps.iter().any(|s| !matches!(s, Step::Input(_))) {
                    return Err(at("placeholders must come before every other node".into()));
                }
                if node.target != input.name {
                    return Err(at(format!(
                        "placeholder {:?} does not match declared input {i} ({:?})",
                        node.target, input.name
                    )));
                }
                Step::Input(i)
            }
            CustomLossNodeOp::CallFunction | CustomLossNodeOp::CallMethod => {
                let is_method = node.op == CustomLossNodeOp::CallMethod;
                let func = if is_method {
                    method(&node.target)
                } else {
                    function(&node.target)
                };
                let Some(func) = func else {
                    let kind = if is_method { "method" } else { "function" };
                    return Err(at(format!(
                        "{kind} {:?} is not one this server allows in a custom loss",
                        node.target
                    )));
                };
                let args = node
                    .args
                    .iter()
                    .map(|a| arg(a, &by_name, 0, &mut budget))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| at(e.0))?;
                let kwargs = node
                    .kwargs
                    .iter()
                    .map(|(k, a)| Ok((k.as_str(), arg(a, &by_name, 0, &mut budget)?)))
                    .collect::<Result<Vec<_>, CompileError>>()
                    .map_err(|e| at(e.0))?;
                let args = bind(func, args, kwargs).map_err(|e| {
                    at(format!(
                        "{} {:?}: {}",
                        node_kind(is_method),
                        node.target,
                        e.0
                    ))
                })?;
                if func == Func::GetAttr {
                    match &args[1] {
                        Some(Arg::Str(name)) if name == "shape" || name == "ndim" => {}
                        other => {
                            return Err(at(format!(
                                "getattr may read shape or ndim only, not {other:?}"
                            )))
                        }
                    }
                }
                Step::Call { func, args }
            }
            CustomLossNodeOp::Output => {
                output = Some(output_of(node, &by_name)?);
                continue;
            }
            CustomLossNodeOp::GetAttr => {
                return Err(at(
                    "captured tensors (get_attr) are not allowed: a custom loss reads only \
                     logprobs and its declared inputs"
                        .into(),
                ))
            }
            CustomLossNodeOp::CallModule => {
                return Err(at(
                    "torch.nn modules cannot be called in a custom loss".into()
                ))
            }
        };
        if by_name
            .insert(node.name.as_str(), program.steps.len())
            .is_some()
        {
            return Err(at("two nodes have this name".into()));
        }
        program.steps.push(step);
        program.names.push(node.name.clone());
    }
    let placeholders = program
        .steps
        .iter()
        .filter(|s| matches!(s, Step::Input(_)))
        .count();
    if placeholders != inputs.len() {
        return Err(CompileError(format!(
            "the graph has {placeholders} placeholders for {} declared inputs",
            inputs.len()
        )));
    }
    let (loss, metrics) =
        output.ok_or_else(|| CompileError("the graph has no output node".into()))?;
    program.loss = loss;
    program.metrics = metrics;
    Ok(program)
}

fn node_kind(is_method: bool) -> &'static str {
    if is_method {
        "method"
    } else {
        "function"
    }
}

/// Binds positional and keyword arguments to `func`'s parameters. `reshape`/`view`
/// also take their shape as separate positional arguments.
fn bind(
    func: Func,
    mut args: Vec<Arg>,
    kwargs: Vec<(&str, Arg)>,
) -> Result<Vec<Option<Arg>>, CompileError> {
    let params = func.params();
    if func == Func::Reshape && args.len() > 2 {
        let sizes = args.split_off(1);
        if sizes.len() > MAX_SEQ {
            return Err(CompileError(format!(
                "a shape of {} sizes; the limit is {MAX_SEQ}",
                sizes.len()
            )));
        }
        args.push(Arg::Seq(sizes));
    }
    if args.len() > params.len() {
        return Err(CompileError(format!(
            "takes at most {} arguments ({}), got {}",
            params.len(),
            params.join(", "),
            args.len()
        )));
    }
    let mut bound: Vec<Option<Arg>> = args.into_iter().map(Some).collect();
    bound.resize(params.len(), None);
    for (key, value) in kwargs {
        // torch.nn.functional records `inplace=False`; nothing here runs in place.
        if key == "inplace" {
            if value == Arg::Scalar(0.0, Kind::Bool) {
                continue;
            }
            return Err(CompileError("in-place operations are not supported".into()));
        }
        let Some(i) = params.iter().position(|p| *p == key) else {
            return Err(CompileError(format!(
                "has no keyword argument {key:?} this server supports (it takes {})",
                params.join(", ")
            )));
        };
        if bound[i].replace(value).is_some() {
            return Err(CompileError(format!("got {key:?} twice")));
        }
    }
    let required = match func {
        Func::Where | Func::MaskedFill => 3,
        Func::Binary(_)
        | Func::TypeAs
        | Func::ClampMin
        | Func::ClampMax
        | Func::Softmax { .. }
        | Func::LogSumExp
        | Func::Cumsum
        | Func::Unsqueeze
        | Func::Reshape
        | Func::Like { fill: None }
        | Func::GetItem
        | Func::GetAttr => 2,
        _ => 1,
    };
    if let Some(missing) = (0..required).find(|&i| bound[i].is_none()) {
        return Err(CompileError(format!(
            "needs its {:?} argument",
            params[missing]
        )));
    }
    Ok(bound)
}

/// An encoded argument as a compiled [`Arg`]; references must name earlier nodes.
/// Each argument, at any depth, takes one unit of `budget` (so that a graph's compiled
/// form stays small whatever the request's size).
fn arg(
    a: &GraphArg,
    by_name: &HashMap<&str, usize>,
    depth: usize,
    budget: &mut usize,
) -> Result<Arg, CompileError> {
    if depth > MAX_DEPTH {
        return Err(CompileError(format!(
            "arguments nest deeper than {MAX_DEPTH} levels"
        )));
    }
    *budget = budget.checked_sub(1).ok_or_else(|| {
        CompileError(format!(
            "the graph's arguments hold more than {MAX_ARGS} constants and references"
        ))
    })?;
    let seq = |items: &[GraphArg], budget: &mut usize| -> Result<Arg, CompileError> {
        if items.len() > MAX_SEQ {
            return Err(CompileError(format!(
                "a sequence argument has {} items; the limit is {MAX_SEQ}",
                items.len()
            )));
        }
        Ok(Arg::Seq(
            items
                .iter()
                .map(|x| arg(x, by_name, depth + 1, budget))
                .collect::<Result<_, _>>()?,
        ))
    };
    Ok(match a {
        GraphArg::None => Arg::None,
        GraphArg::Bool(b) => Arg::Scalar(f64::from(u8::from(*b)), Kind::Bool),
        GraphArg::Int(i) => Arg::Scalar(*i as f64, Kind::Int),
        GraphArg::Float(f) => Arg::Scalar(*f, Kind::Float),
        GraphArg::Str(s) if s.len() <= 64 => Arg::Str(s.clone()),
        GraphArg::Str(_) => return Err(CompileError("a string argument is too long".into())),
        GraphArg::List(items) => seq(items, budget)?,
        GraphArg::Tagged(t) => match t {
            TaggedArg::Ref(name) => Arg::Node(*by_name.get(name.as_str()).ok_or_else(|| {
                CompileError(format!("refers to {name:?}, which is not an earlier node"))
            })?),
            TaggedArg::Tuple(items) => seq(items, budget)?,
            TaggedArg::Slice(parts) => {
                let [start, stop, step] = parts.as_slice() else {
                    return Err(CompileError("a slice has three parts".into()));
                };
                Arg::Slice(Box::new([
                    arg(start, by_name, depth + 1, budget)?,
                    arg(stop, by_name, depth + 1, budget)?,
                    arg(step, by_name, depth + 1, budget)?,
                ]))
            }
            TaggedArg::Ellipsis(_) => Arg::Ellipsis,
            TaggedArg::Float(s) => Arg::Scalar(
                match s.as_str() {
                    "inf" => f64::INFINITY,
                    "-inf" => f64::NEG_INFINITY,
                    "nan" => f64::NAN,
                    other => {
                        return Err(CompileError(format!(
                            "{other:?} is not a non-finite float (inf, -inf or nan)"
                        )))
                    }
                },
                Kind::Float,
            ),
            TaggedArg::Dtype(name) => Arg::Dtype(dtype(name)?),
            TaggedArg::Dict(_) => {
                return Err(CompileError(
                    "dict arguments are only allowed as the returned metrics".into(),
                ))
            }
            TaggedArg::Device(_) | TaggedArg::Layout(_) | TaggedArg::MemoryFormat(_) => {
                return Err(CompileError(
                    "device, layout and memory_format arguments are not supported: the loss \
                     runs where the server runs it"
                        .into(),
                ))
            }
        },
    })
}

fn dtype(name: &str) -> Result<Kind, CompileError> {
    Ok(match name {
        "float32" | "float64" | "float" | "double" | "float16" | "bfloat16" | "half" => Kind::Float,
        "int64" | "int32" | "int16" | "int8" | "uint8" | "long" | "int" => Kind::Int,
        "bool" => Kind::Bool,
        other => return Err(CompileError(format!("dtype {other:?} is not supported"))),
    })
}

type Output = (usize, Vec<(String, usize)>);

/// The output node: `(loss, {metric: value})`.
fn output_of(
    node: &lathe_sdk::types::CustomLossNode,
    by_name: &HashMap<&str, usize>,
) -> Result<Output, CompileError> {
    let bad = |what: &str| CompileError(format!("the output must be (loss, metrics): {what}"));
    let [returned] = node.args.as_slice() else {
        return Err(bad("the output node takes one argument"));
    };
    let pair = match returned {
        GraphArg::List(items) => items,
        GraphArg::Tagged(TaggedArg::Tuple(items)) => items,
        _ => return Err(bad("it does not return a pair")),
    };
    let [loss, metrics] = pair.as_slice() else {
        return Err(bad("it does not return a pair"));
    };
    let node_ref = |a: &GraphArg| match a {
        GraphArg::Tagged(TaggedArg::Ref(name)) => by_name.get(name.as_str()).copied(),
        _ => None,
    };
    let loss = node_ref(loss).ok_or_else(|| bad("the loss is not a node of the graph"))?;
    let GraphArg::Tagged(TaggedArg::Dict(metrics)) = metrics else {
        return Err(bad("the metrics are not a dict"));
    };
    if metrics.len() > MAX_METRICS {
        return Err(CompileError(format!(
            "the loss returns {} metrics; the limit is {MAX_METRICS}",
            metrics.len()
        )));
    }
    let metrics = metrics
        .iter()
        .map(|(key, value)| {
            if !metric_key(key) {
                return Err(CompileError(format!(
                    "metric {key:?} must be named custom/<name>:sum or custom/<name>:mean in \
                     lowercase"
                )));
            }
            let at = node_ref(value)
                .ok_or_else(|| CompileError(format!("metric {key:?} is not a node")))?;
            Ok((key.clone(), at))
        })
        .collect::<Result<_, _>>()?;
    Ok((loss, metrics))
}

/// The SDK's rule for metric keys: `custom/[a-z0-9_./-]{1,64}:(sum|mean)`.
pub fn metric_key(key: &str) -> bool {
    let Some(rest) = key.strip_prefix("custom/") else {
        return false;
    };
    let Some((name, reduce)) = rest.rsplit_once(':') else {
        return false;
    };
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'.' | b'/' | b'-'))
        && (reduce == "sum" || reduce == "mean")
}
