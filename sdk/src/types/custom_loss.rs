//! Server-side custom losses (tinker 0.38's `create_custom_loss`, behind the
//! client-config flag `custom_loss_server_side`): a loss traced by `torch.fx` on the
//! client, sent as plain data, rebuilt by the server from its own list of allowed
//! operations, and named by its `loss_id` in `forward_backward` requests with
//! `loss_fn: "custom"`.

use std::collections::BTreeMap;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// One input of a custom loss, with the rank every datum's value has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CustomLossInput {
    /// `logprobs`, or the `loss_fn_inputs` key the loss reads.
    pub name: String,
    /// 0 for a scalar, 1 for `[T]`, 2 for `[T, K]`.
    pub rank: u8,
}

/// What a graph node does, as `torch.fx` records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CustomLossNodeOp {
    /// An input of the loss.
    Placeholder,
    /// A tensor captured from outside the function (never allowed).
    GetAttr,
    /// A function call (`torch.exp`, `operator.mul`, `getattr` ...).
    CallFunction,
    /// A tensor method call (`sum`, `float` ...).
    CallMethod,
    /// A `torch.nn` module call (never allowed).
    CallModule,
    /// The value the loss returns.
    Output,
}

/// An encoded argument of a graph node. JSON scalars and strings stand for themselves
/// and lists for lists; anything else is a one-key object ([`TaggedArg`]).
///
/// Decoded by a visitor of its own rather than serde's `untagged`: that buffers each
/// value and, for every level of nesting, copies the subtree below it again: memory
/// a body's size times its depth.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum GraphArg {
    /// Python's `None`.
    None,
    /// A bool.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A finite float.
    Float(f64),
    /// A string.
    Str(String),
    /// A Python list.
    List(Vec<GraphArg>),
    /// Everything else.
    Tagged(TaggedArg),
}

impl<'de> Deserialize<'de> for GraphArg {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(GraphArgVisitor)
    }
}

/// Builds a [`GraphArg`] from whatever JSON value comes, streaming (no buffering).
struct GraphArgVisitor;

impl<'de> Visitor<'de> for GraphArgVisitor {
    type Value = GraphArg;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("null, a bool, a number, a string, a list or a one-key object")
    }

    fn visit_unit<E: de::Error>(self) -> Result<GraphArg, E> {
        Ok(GraphArg::None)
    }

    fn visit_none<E: de::Error>(self) -> Result<GraphArg, E> {
        Ok(GraphArg::None)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<GraphArg, E> {
        Ok(GraphArg::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<GraphArg, E> {
        Ok(GraphArg::Int(v))
    }

    /// An integer past `i64` is a float, as it was for the untagged form.
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<GraphArg, E> {
        Ok(i64::try_from(v).map_or(GraphArg::Float(v as f64), GraphArg::Int))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<GraphArg, E> {
        Ok(GraphArg::Float(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<GraphArg, E> {
        Ok(GraphArg::Str(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<GraphArg, E> {
        Ok(GraphArg::Str(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<GraphArg, A::Error> {
        // Not `size_hint`-sized: the hint comes from the wire.
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(GraphArg::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<GraphArg, A::Error> {
        let tagged = TaggedArg::deserialize(de::value::MapAccessDeserializer::new(&mut map))?;
        if map.next_key::<de::IgnoredAny>()?.is_some() {
            return Err(de::Error::custom(
                "a tagged graph argument is an object of one key",
            ));
        }
        Ok(GraphArg::Tagged(tagged))
    }
}

/// The one-key object forms of [`GraphArg`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum TaggedArg {
    /// The value of the node of this name.
    Ref(String),
    /// A Python tuple.
    Tuple(Vec<GraphArg>),
    /// A dict with string keys.
    Dict(BTreeMap<String, GraphArg>),
    /// A slice's `[start, stop, step]`.
    Slice(Vec<GraphArg>),
    /// `...`.
    Ellipsis(bool),
    /// A non-finite float: `"inf"`, `"-inf"` or `"nan"`.
    Float(String),
    /// A torch dtype, e.g. `"float32"`.
    Dtype(String),
    /// A torch device, e.g. `"cpu"`.
    Device(String),
    /// A torch layout.
    Layout(String),
    /// A torch memory format.
    MemoryFormat(String),
}

/// One node of a traced custom loss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CustomLossNode {
    /// What the node does.
    pub op: CustomLossNodeOp,
    /// Unique within the graph; later nodes refer to this node by it.
    pub name: String,
    /// The parameter name (placeholder), the function's qualified name (`torch.exp`,
    /// `operator.mul`), the method name, or `output`.
    pub target: String,
    /// Positional arguments.
    #[serde(default)]
    pub args: Vec<GraphArg>,
    /// Keyword arguments.
    #[serde(default)]
    pub kwargs: BTreeMap<String, GraphArg>,
}

/// A traced custom loss: its nodes in execution order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CustomLossGraph {
    /// The encoding's version (1).
    #[serde(default = "graph_format")]
    pub format: u32,
    /// The nodes.
    pub nodes: Vec<CustomLossNode>,
}

fn graph_format() -> u32 {
    1
}

/// `POST /api/v1/create_custom_loss`; answered with a future of
/// [`CreateCustomLossResponse`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateCustomLossRequest {
    /// The session whose training clients may use the loss.
    pub session_id: String,
    /// The loss's number within its session.
    pub custom_loss_seq_id: u64,
    /// The loss's name (the traced function's).
    pub name: String,
    /// The graph's inputs in order, `logprobs` first.
    pub inputs: Vec<CustomLossInput>,
    /// The traced loss.
    pub graph: CustomLossGraph,
}

/// The result of `create_custom_loss`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateCustomLossResponse {
    /// Names the loss in `forward_backward` requests of the same session
    /// (`loss_fn: "custom"`, `loss_fn_config: {"loss_id": ...}`).
    pub loss_id: String,
}
