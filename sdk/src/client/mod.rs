//! The asynchronous HTTP client (feature `client`).

mod config;
mod custom_loss;
mod error;
mod future;
mod http;
mod rest;
mod sampling;
mod service;
mod tokenizer;
mod training;

pub use config::{ClientBuilder, ClientConfig, RetryPolicy};
pub use custom_loss::CustomLoss;
pub use error::{Error, Result};
pub use future::ApiFuture;
pub use rest::RestClient;
pub use sampling::SamplingClient;
pub use service::{SamplingSource, ServiceClient};
pub use tokenizer::{Message, Tokenizer};
pub use training::{
    merge_outputs, validate_data, LossFnConfig, TrainingClient, MAX_CHUNK_BYTES, MAX_CHUNK_DATUMS,
};
