//! Group-relative advantages.

/// Rewards minus their group's mean (GRPO without the std division, as the Tinker
/// cookbook does). A group whose rewards are all equal gets zeros: it carries no signal.
pub fn group_centred(rewards: &[f64]) -> Vec<f64> {
    if rewards.is_empty() {
        return Vec::new();
    }
    let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
    rewards.iter().map(|r| r - mean).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantages_are_centred_per_group() {
        assert_eq!(
            group_centred(&[1.0, -0.25, -0.25, 1.0]),
            [0.625, -0.625, -0.625, 0.625]
        );
        assert_eq!(group_centred(&[1.0, 1.0]), [0.0, 0.0]);
        assert!(group_centred(&[]).is_empty());
    }
}
