//! Group-relative advantages.

/// Rewards minus their group's mean (GRPO without the std division, as the Tinker
/// cookbook does). A group whose rewards are all equal gets zeros, exactly (not the
/// rounding residue of `0.1 - mean(0.1, 0.1, 0.1)`): it carries no signal.
pub fn group_centred(rewards: &[f64]) -> Vec<f64> {
    if rewards.is_empty() {
        return Vec::new();
    }
    if rewards.iter().all(|&r| r == rewards[0]) {
        return vec![0.0; rewards.len()];
    }
    let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
    rewards.iter().map(|r| r - mean).collect()
}

/// Rewards normalised within their group: `(r − mean) / std` with the unbiased std
/// (AstraFlow's `reward_norm: {mean: group, std: group}`). A singleton group uses std 1;
/// a group whose rewards are all equal gets zeros (dynamic sampling drops it).
pub fn group_normalised(rewards: &[f64]) -> Vec<f64> {
    let centred = group_centred(rewards);
    if rewards.len() < 2 {
        return centred;
    }
    let var = centred.iter().map(|c| c * c).sum::<f64>() / (rewards.len() - 1) as f64;
    if var <= 1e-12 {
        return vec![0.0; rewards.len()];
    }
    let std = var.sqrt();
    centred.iter().map(|c| c / std).collect()
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
        assert_eq!(group_centred(&[0.1, 0.1, 0.1]), [0.0, 0.0, 0.0]);
        assert!(group_centred(&[]).is_empty());
    }

    #[test]
    fn normalised_advantages_have_unit_sample_std() {
        let a = group_normalised(&[1.0, 0.0, 0.0, 1.0]);
        // mean 0.5, unbiased std sqrt(1/3)
        let expect = 0.5 / (1.0f64 / 3.0).sqrt();
        for (x, s) in a.iter().zip([1.0, -1.0, -1.0, 1.0]) {
            assert!((x - s * expect).abs() < 1e-12, "{a:?}");
        }
        assert_eq!(group_normalised(&[0.7, 0.7, 0.7]), [0.0, 0.0, 0.0]);
        assert_eq!(group_normalised(&[0.7]), [0.0]);
    }
}
