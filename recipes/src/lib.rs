//! Multi-agent RL recipes on the Lathe SDK, and the library they are built from:
//! environments ([`env`]) played in batched rounds against each role's sampler
//! ([`play`]), credited and turned into datums for any loss ([`credit`]), trained by one
//! loop with held-out evaluation, checkpoints and exact resume ([`rl`], [`resume`]);
//! plus the graders, data sets and run bookkeeping the recipe binaries in `src/bin/`
//! share.

pub mod advantages;
pub mod clinic;
pub mod credit;
pub mod data;
pub mod env;
pub mod grade;
pub mod kl;
pub mod play;
pub mod plot;
pub mod resume;
pub mod rl;
pub mod rollout;
pub mod run;
pub mod setup;
