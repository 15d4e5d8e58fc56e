//! [`SamplingClient`]: sampling from saved or snapshotted weights, or the base model.

use reqwest::Method;

use super::error::{Error, Result};
use super::future::{decode, ApiFuture};
use super::service::ServiceClient;
use crate::types::{
    ModelInput, SampleRequest, SampleResponse, SamplingParams, TopkEntry, UntypedApiFuture,
};

/// A sampling session on the server. Cheap to clone; requests need no ordering and run
/// batched with other sessions' requests.
#[derive(Clone, Debug)]
pub struct SamplingClient {
    service: ServiceClient,
    sampler_id: String,
    base_model: Option<String>,
}

fn check(num_samples: usize, p: &SamplingParams) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidInput(m));
    if num_samples == 0 {
        return bad("num_samples must be at least 1".into());
    }
    if p.max_tokens == Some(0) {
        return bad("max_tokens must be at least 1".into());
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return bad(format!("top_p must be in (0, 1], got {}", p.top_p));
    }
    if !(p.temperature.is_finite() && p.temperature >= 0.0) {
        return bad(format!(
            "temperature must be finite and >= 0, got {}",
            p.temperature
        ));
    }
    Ok(())
}

impl SamplingClient {
    pub(crate) fn new(
        service: ServiceClient,
        sampler_id: String,
        base_model: Option<String>,
    ) -> Self {
        Self {
            service,
            sampler_id,
            base_model,
        }
    }

    /// The sampling session id (`<session>:sample:<n>`).
    pub fn sampler_id(&self) -> &str {
        &self.sampler_id
    }

    /// The base model, when the client was made for it.
    pub fn base_model(&self) -> Option<&str> {
        self.base_model.as_deref()
    }

    async fn submit(
        &self,
        prompt: &ModelInput,
        num_samples: usize,
        params: &SamplingParams,
        prompt_logprobs: bool,
        topk_prompt_logprobs: usize,
    ) -> Result<String> {
        if prompt.length() == 0 {
            return Err(Error::InvalidInput("the prompt is empty".into()));
        }
        check(num_samples, params)?;
        let request = SampleRequest {
            sampling_session_id: Some(self.sampler_id.clone()),
            prompt_logprobs,
            topk_prompt_logprobs,
            ..SampleRequest::new(prompt.clone(), params.clone(), num_samples)
        };
        let body =
            serde_json::to_value(&request).map_err(|e| Error::InvalidInput(e.to_string()))?;
        let fut: UntypedApiFuture = self
            .service
            .transport()
            .execute(Method::POST, "/api/v1/asample", Some(&body))
            .await
            .and_then(decode)?;
        Ok(fut.request_id)
    }

    /// `num_samples` continuations of `prompt`. Each sequence's tokens include the stop
    /// token that ended it; `logprobs` are the model's log-probabilities of the sampled
    /// tokens (equal to what training computes for them).
    pub async fn sample(
        &self,
        prompt: &ModelInput,
        num_samples: usize,
        params: &SamplingParams,
    ) -> Result<ApiFuture<SampleResponse>> {
        let id = self.submit(prompt, num_samples, params, false, 0).await?;
        Ok(ApiFuture::with_protobuf(
            self.service.transport().clone(),
            vec![id],
            |mut bodies| bodies.pop().expect("one request").sample_response(),
        ))
    }

    /// The log-probability of every prompt token given the ones before it (the first is
    /// `None`).
    pub async fn compute_logprobs(
        &self,
        prompt: &ModelInput,
    ) -> Result<ApiFuture<Vec<Option<f64>>>> {
        let params = SamplingParams {
            max_tokens: Some(1),
            ..Default::default()
        };
        let id = self.submit(prompt, 1, &params, true, 0).await?;
        Ok(ApiFuture::with_protobuf(
            self.service.transport().clone(),
            vec![id],
            |mut bodies| {
                let resp = bodies.pop().expect("one request").sample_response()?;
                resp.prompt_logprobs
                    .ok_or_else(|| Error::decode("no prompt_logprobs", "sample response"))
            },
        ))
    }

    /// The `k` most likely tokens at every prompt position given the tokens before it,
    /// as `(token id, logprob)` pairs, most likely first (the first position is `None`).
    /// The server allows `k` up to 64.
    pub async fn compute_topk_logprobs(
        &self,
        prompt: &ModelInput,
        k: usize,
    ) -> Result<ApiFuture<Vec<Option<Vec<TopkEntry>>>>> {
        if k == 0 {
            return Err(Error::InvalidInput("k must be at least 1".into()));
        }
        let params = SamplingParams {
            max_tokens: Some(1),
            ..Default::default()
        };
        let id = self.submit(prompt, 1, &params, false, k).await?;
        Ok(ApiFuture::with_protobuf(
            self.service.transport().clone(),
            vec![id],
            |mut bodies| {
                let resp = bodies.pop().expect("one request").sample_response()?;
                resp.topk_prompt_logprobs
                    .ok_or_else(|| Error::decode("no topk_prompt_logprobs", "sample response"))
            },
        ))
    }
}
