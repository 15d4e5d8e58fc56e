//! Typed SDK for Lathe and other services that speak the Tinker HTTP protocol.
//!
//! The [`types`] module holds the wire types, shared with the server so that a field can
//! never differ between the two. The asynchronous HTTP client is built behind the default
//! `client` feature.
//!
//! ```
//! use lathe_sdk::types::{Datum, ModelInput, TensorData};
//!
//! // One supervised example: predict tokens 2 and 3 from tokens 1 and 2.
//! let datum = Datum::cross_entropy(ModelInput::from_ints(vec![1, 2]), vec![2, 3], vec![1.0, 1.0]);
//! assert_eq!(datum.model_input.length(), 2);
//! assert_eq!(datum.loss_fn_inputs["target_tokens"], TensorData::int64(vec![2, 3]));
//! ```

pub mod types;
