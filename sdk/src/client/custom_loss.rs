//! Server-side custom losses: [`ServiceClient::create_custom_loss`] uploads a traced loss
//! graph and [`TrainingClient::forward_backward_custom`] trains with it in one request.

use std::collections::BTreeMap;

use reqwest::Method;

use super::error::{Error, Result};
use super::future::{decode, poll, ApiFuture};
use super::service::ServiceClient;
use super::training::TrainingClient;
use crate::types::{
    CreateCustomLossRequest, CreateCustomLossResponse, CustomLossGraph, CustomLossInput, Datum,
    ForwardBackwardOutput, LossConfigValue, UntypedApiFuture,
};

/// A loss the server holds for this session (the counterpart of tinker's `LossHandle`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustomLoss {
    /// The loss's name.
    pub name: String,
    /// Its inputs, `logprobs` first: every datum must carry the others in
    /// `loss_fn_inputs`, with the declared ranks.
    pub inputs: Vec<CustomLossInput>,
    /// The server's id for it.
    pub loss_id: String,
    /// The session that created it; only its training clients can use it.
    pub session_id: String,
}

impl ServiceClient {
    /// Uploads a per-datum loss `(logprobs, *inputs) -> (loss, metrics)`, written as the
    /// `torch.fx` graph encoding that tinker 0.38's `create_custom_loss` sends. The
    /// server rebuilds it from its own list of allowed operations and refuses anything
    /// else with [`Error::Api`] (400) naming the node.
    pub async fn create_custom_loss(
        &self,
        name: &str,
        inputs: Vec<CustomLossInput>,
        graph: CustomLossGraph,
    ) -> Result<CustomLoss> {
        let request = CreateCustomLossRequest {
            session_id: self.session_id().to_string(),
            custom_loss_seq_id: self.next_custom_loss_seq(),
            name: name.to_string(),
            inputs: inputs.clone(),
            graph,
        };
        let fut: UntypedApiFuture = self
            .transport()
            .send(
                Method::POST,
                "/api/v1/create_custom_loss",
                &request,
                Some("create_custom_loss"),
            )
            .await
            .and_then(decode)?;
        let created: CreateCustomLossResponse =
            decode(poll(self.transport(), &fut.request_id).await?)?;
        Ok(CustomLoss {
            name: name.to_string(),
            inputs,
            loss_id: created.loss_id,
            session_id: self.session_id().to_string(),
        })
    }
}

impl TrainingClient {
    /// `forward_backward` with a custom loss, run on the server: the loss, its
    /// `custom/...` metrics and `surrogate_loss:sum` (the sum of `dLoss/dlp * lp`) come
    /// back in the output's metrics.
    pub async fn forward_backward_custom(
        &self,
        data: &[Datum],
        loss: &CustomLoss,
    ) -> Result<ApiFuture<ForwardBackwardOutput>> {
        if loss.session_id != self.service.session_id() {
            return Err(Error::InvalidInput(format!(
                "custom loss {:?} was created in session {}; only that session's training \
                 clients can use it",
                loss.name, loss.session_id
            )));
        }
        for (i, d) in data.iter().enumerate() {
            for input in loss.inputs.iter().skip(1) {
                let Some(t) = d.loss_fn_inputs.get(&input.name) else {
                    return Err(Error::InvalidInput(format!(
                        "datum {i} has no loss_fn_inputs[{:?}], which custom loss {:?} reads",
                        input.name, loss.name
                    )));
                };
                let rank = t.shape.as_ref().map_or(1, Vec::len);
                if rank != usize::from(input.rank) {
                    return Err(Error::InvalidInput(format!(
                        "datum {i}: loss_fn_inputs[{:?}] has rank {rank}, but custom loss {:?} \
                         declared rank {}",
                        input.name, loss.name, input.rank
                    )));
                }
            }
        }
        let config = BTreeMap::from([(
            "loss_id".to_string(),
            LossConfigValue::Text(loss.loss_id.clone()),
        )]);
        self.forward_like(true, data, "custom", Some(config)).await
    }
}
