//! Wire types of the Tinker HTTP protocol (serde only).
//!
//! Field names and defaults follow the official Python SDK (`tinker` 0.22), which
//! serialises with `exclude_none`: an absent field and `null` mean the same thing, so every
//! optional field is an `Option` skipped when `None`. Unknown fields are ignored on input,
//! because newer SDKs add fields. The server deserialises exactly these types, so client
//! and server can never disagree about a field.

mod completions;
mod custom_loss;
mod data;
pub mod mint;
pub mod openai;
mod protocol;
mod session;
mod uri;

pub use completions::*;
pub use custom_loss::*;
pub use data::*;
pub use protocol::*;
pub use session::*;
pub use uri::*;
