//! Playing environments against the roles' samplers, in rounds: every open environment's
//! prompts of a round are in flight together, so the server decodes them in one batch, and
//! identical prompts of a round (a group's shared first prompt) go as one request with
//! several samples, so the server prefills them once.

use std::collections::HashMap;

use anyhow::Context;
use lathe::types::{ModelInput, SamplingParams, StopCondition};
use lathe::{SamplingClient, Tokenizer};

use crate::env::{Env, Episode, Observation, Reply};
use crate::rollout::Sample;

/// Rounds after which an environment that still asks for replies is an error (a recipe
/// bug, not a long dialogue).
pub const MAX_ROUNDS: usize = 256;

/// How a role samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Softmax temperature (0 = greedy).
    pub temperature: f64,
    /// Nucleus mass (1 = all tokens).
    pub top_p: f64,
}

impl Sampling {
    /// Greedy decoding.
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_p: 1.0,
    };

    /// Sampling at `temperature` from every token.
    pub fn at(temperature: f64) -> Self {
        Self {
            temperature,
            top_p: 1.0,
        }
    }
}

/// What one role samples from in a round.
#[derive(Clone)]
pub struct Policy {
    /// The sampler.
    pub sampler: SamplingClient,
    /// Which published weights it holds (recorded in every [`Reply`]).
    pub version: u64,
    /// How it samples.
    pub sampling: Sampling,
}

/// Mixes `seed` with the coordinates of a request (splitmix64), so that every request
/// of a run has its own seed and a rerun samples the same.
pub fn mix_seed(seed: u64, parts: &[u64]) -> u64 {
    let mut x = seed;
    for &p in parts {
        x = x.wrapping_add(p.wrapping_add(0x9e37_79b9_7f4a_7c15));
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
    }
    x
}

/// New tokens allowed after a prompt of `prompt_len` tokens within `context` (0: none).
pub fn room(max_tokens: usize, prompt_len: usize, context: Option<usize>) -> usize {
    context.map_or(max_tokens, |limit| {
        max_tokens.min(limit.saturating_sub(prompt_len))
    })
}

/// One request of a round: the observations it answers, as `(env, observation)` indices.
struct Request {
    observation: Observation,
    askers: Vec<(usize, usize)>,
}

/// Plays `envs` to the end and returns their episodes, in order. `policy(role)` gives
/// each round's sampler of a role (it may change between rounds: the asynchronous mode
/// publishes new weights while a dialogue runs). A prompt that leaves no room in the
/// model's `context` gets an empty reply, as Miles skips it.
pub async fn play(
    mut envs: Vec<Box<dyn Env>>,
    policy: &dyn Fn(usize) -> Policy,
    tok: &Tokenizer,
    context: Option<usize>,
    seed: u64,
) -> anyhow::Result<Vec<Episode>> {
    let mut open: Vec<(usize, Vec<Observation>)> = envs
        .iter_mut()
        .enumerate()
        .map(|(i, e)| (i, e.initial_observations()))
        .filter(|(_, obs)| !obs.is_empty())
        .collect();
    let mut round = 0u64;
    while !open.is_empty() {
        anyhow::ensure!(
            (round as usize) < MAX_ROUNDS,
            "an environment asked for more than {MAX_ROUNDS} rounds of replies (a turn limit that high, or an environment that never finishes)"
        );
        let mut requests: Vec<Request> = Vec::new();
        let mut index: HashMap<&Observation, usize> = HashMap::new();
        for (e, observations) in &open {
            for (o, observation) in observations.iter().enumerate() {
                match index.get(observation) {
                    Some(&i) => requests[i].askers.push((*e, o)),
                    None => {
                        index.insert(observation, requests.len());
                        requests.push(Request {
                            observation: observation.clone(),
                            askers: vec![(*e, o)],
                        });
                    }
                }
            }
        }
        let mut pending = Vec::with_capacity(requests.len());
        for request in &requests {
            let ob = &request.observation;
            let ids = tok.encode(&ob.prompt)?;
            let room = room(ob.max_tokens, ids.len(), context);
            let p = policy(ob.role);
            let future = if room == 0 {
                None
            } else {
                let (e, o) = request.askers[0];
                let params = SamplingParams {
                    max_tokens: Some(room),
                    seed: Some(mix_seed(seed, &[round, e as u64, o as u64])),
                    stop: (!ob.stop.is_empty()).then(|| StopCondition::Texts(ob.stop.clone())),
                    temperature: p.sampling.temperature,
                    top_p: p.sampling.top_p,
                    ..Default::default()
                };
                let n = request.askers.len();
                Some(
                    p.sampler
                        .sample(&ModelInput::from_ints(ids.clone()), n, &params)
                        .await?,
                )
            };
            pending.push((future, ids, p.version));
        }
        let mut replies: Vec<Vec<Option<Reply>>> =
            open.iter().map(|(_, obs)| vec![None; obs.len()]).collect();
        let slot = |e: usize| open.iter().position(|(i, _)| *i == e).expect("open env");
        for (request, (future, prompt, version)) in requests.iter().zip(pending) {
            let samples: Vec<Sample> = match future {
                None => vec![Sample::default(); request.askers.len()],
                Some(f) => f
                    .result()
                    .await?
                    .sequences
                    .into_iter()
                    .map(|s| Sample {
                        text: tok.decode(&s.tokens).unwrap_or_default(),
                        logprobs: s.logprobs.unwrap_or_default(),
                        tokens: s.tokens,
                    })
                    .collect(),
            };
            anyhow::ensure!(
                samples.len() == request.askers.len(),
                "asked for {} samples, got {}",
                request.askers.len(),
                samples.len()
            );
            for (&(e, o), sample) in request.askers.iter().zip(samples) {
                replies[slot(e)][o] = Some(Reply {
                    prompt: prompt.clone(),
                    sample,
                    version,
                });
            }
        }
        let mut next = Vec::with_capacity(open.len());
        for ((e, _), replies) in open.iter().zip(replies) {
            let replies: Vec<Reply> = replies
                .into_iter()
                .map(|r| r.context("a reply went missing"))
                .collect::<anyhow::Result<_>>()?;
            let observations = envs[*e].step(replies);
            if !observations.is_empty() {
                next.push((*e, observations));
            }
        }
        open = next;
        round += 1;
    }
    Ok(envs.into_iter().map(|e| e.finish()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_differ_per_coordinate_and_repeat() {
        let a = mix_seed(7, &[0, 1, 2]);
        assert_eq!(a, mix_seed(7, &[0, 1, 2]));
        assert_ne!(a, mix_seed(7, &[0, 2, 1]));
        assert_ne!(a, mix_seed(8, &[0, 1, 2]));
    }

    #[test]
    fn max_tokens_shrink_to_fit_the_context() {
        assert_eq!(room(16, 1000, None), 16);
        assert_eq!(
            (
                room(16, 50, Some(100)),
                room(16, 90, Some(100)),
                room(16, 100, Some(100)),
                room(16, 120, Some(100))
            ),
            (16, 10, 0, 0)
        );
    }
}
