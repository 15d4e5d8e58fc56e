//! Generated data sets with fixed seeds.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// A question with a known numeric answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The question text.
    pub question: String,
    /// The exact answer string.
    pub answer: String,
}

/// Every `a + b` with `a, b` in `lo..=hi`, shuffled with `seed`, split into
/// (train, held-out) with `held_out` problems held out. The split never shares a problem.
pub fn addition(lo: u32, hi: u32, seed: u64, held_out: usize) -> (Vec<Problem>, Vec<Problem>) {
    let mut all: Vec<Problem> = (lo..=hi)
        .flat_map(|a| (lo..=hi).map(move |b| (a, b)))
        .map(|(a, b)| Problem {
            question: format!("What is {a} + {b}?"),
            answer: (a + b).to_string(),
        })
        .collect();
    all.shuffle(&mut StdRng::seed_from_u64(seed));
    let held_out = held_out.min(all.len() / 2);
    let train = all.split_off(held_out);
    (train, all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_are_disjoint_and_deterministic() {
        let (train, test) = addition(10, 19, 3, 20);
        assert_eq!((train.len(), test.len()), (80, 20));
        assert!(test.iter().all(|p| !train.contains(p)));
        assert_eq!(addition(10, 19, 3, 20).1, test);
        assert_ne!(addition(10, 19, 4, 20).1, test);
        let p = &test[0];
        let nums: Vec<u32> = p.question[8..p.question.len() - 1]
            .split(" + ")
            .map(|n| n.parse().unwrap())
            .collect();
        assert_eq!((nums[0] + nums[1]).to_string(), p.answer);
    }
}
