//! Multi-agent RL recipes on the Lathe SDK: graders, data sets, advantages and rollout
//! helpers shared by the recipe binaries.
