//! Multi-agent RL recipes on the Lathe SDK: graders, data sets, advantages, rollout
//! helpers and run bookkeeping shared by the recipe binaries in `src/bin/`.

pub mod advantages;
pub mod clinic;
pub mod data;
pub mod grade;
pub mod plot;
pub mod rollout;
pub mod run;
pub mod setup;
