//! Answer graders.

/// The first number in `text` (`-?\d+(\.\d+)?`), as written.
pub fn first_number(text: &str) -> Option<&str> {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let neg = bytes[i] == b'-' && bytes.get(i + 1).is_some_and(u8::is_ascii_digit);
        if bytes[i].is_ascii_digit() || neg {
            let start = i;
            i += usize::from(neg);
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if i + 1 < bytes.len() && bytes[i] == b'.' && bytes[i + 1].is_ascii_digit() {
                i += 1;
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
            }
            return Some(&text[start..i]);
        }
        i += 1;
    }
    None
}

/// The content of the last `\boxed{...}` in `text` (braces balanced).
pub fn boxed_answer(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[start..start + i].trim());
                }
            }
            _ => {}
        }
    }
    None
}

/// Whether the first number of `response` is exactly `answer` (MinT's check: "5.0" is not
/// "5", "2 + 3 = 5" answers "2").
pub fn first_number_correct(response: &str, answer: &str) -> bool {
    first_number(response) == Some(answer)
}

/// MinT's multi-agent reward: +1 for a correct first number, −0.25 otherwise.
pub fn math_reward(response: &str, answer: &str) -> f64 {
    if first_number_correct(response, answer) {
        1.0
    } else {
        -0.25
    }
}

/// The last integer in `text` after removing commas (the Tinker cookbook's arithmetic
/// grader: "7 + 8 = 15" answers 15).
pub fn last_integer(text: &str) -> Option<i64> {
    let cleaned = text.replace(',', "");
    let bytes = cleaned.as_bytes();
    let mut end = bytes.len();
    while end > 0 {
        if bytes[end - 1].is_ascii_digit() {
            let mut start = end;
            while start > 0 && bytes[start - 1].is_ascii_digit() {
                start -= 1;
            }
            if start > 0 && bytes[start - 1] == b'-' {
                start -= 1;
            }
            return cleaned[start..end].parse().ok();
        }
        end -= 1;
    }
    None
}

/// 1.0 when the last integer of `response` equals `answer`, else 0.0.
pub fn last_integer_reward(response: &str, answer: &str) -> f64 {
    let gold = answer.trim().replace(',', "").parse::<i64>().ok();
    if gold.is_some() && last_integer(response) == gold {
        1.0
    } else {
        0.0
    }
}

/// A verifier's verdict: AstraFlow's `<verify>approve|reject</verify>` (case-insensitive),
/// else exactly one of the keywords "approve" / "reject" anywhere. `None` when neither
/// decides (AstraFlow then treats it as approve, unparsed).
pub fn verdict(text: &str) -> Option<bool> {
    let lower = text.to_lowercase();
    for (tag, approved) in [
        ("<verify>approve</verify>", true),
        ("<verify>reject</verify>", false),
    ] {
        if lower.contains(tag) {
            return Some(approved);
        }
    }
    match (lower.contains("approve"), lower.contains("reject")) {
        (true, false) => Some(true),
        (false, true) => Some(false),
        _ => None,
    }
}

/// Miles' selector answer: the first `Judgment:\s*(\d+)`, 1-based.
pub fn judgment(text: &str) -> Option<usize> {
    let mut rest = text;
    while let Some(at) = rest.find("Judgment:") {
        rest = &rest[at + "Judgment:".len()..];
        let digits: String = rest
            .trim_start()
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        if let Ok(n) = digits.parse() {
            return Some(n);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_number_follows_mints_regex() {
        assert_eq!(first_number(" 42\nQuestion"), Some("42"));
        assert_eq!(first_number("2 + 3 = 5"), Some("2"));
        assert_eq!(first_number("is -7."), Some("-7"));
        assert_eq!(first_number("3.25 apples"), Some("3.25"));
        assert_eq!(first_number("x-y"), None);
        assert_eq!(first_number("none"), None);
    }

    #[test]
    fn rewards_are_plus_one_or_minus_a_quarter() {
        assert_eq!(math_reward(" 5", "5"), 1.0);
        assert_eq!(math_reward("5.0", "5"), -0.25);
        assert_eq!(math_reward("", "5"), -0.25);
    }

    #[test]
    fn boxed_answers_handle_nested_braces() {
        assert_eq!(
            boxed_answer(r"so \boxed{\frac{1}{2}} done"),
            Some(r"\frac{1}{2}")
        );
        assert_eq!(boxed_answer(r"\boxed{1} then \boxed{ 7 }"), Some("7"));
        assert_eq!(boxed_answer("no box"), None);
    }

    #[test]
    fn last_integer_reads_the_final_number() {
        assert_eq!(last_integer("7 + 8 = 15"), Some(15));
        assert_eq!(last_integer("it is 1,024."), Some(1024));
        assert_eq!(last_integer("down to -3"), Some(-3));
        assert_eq!(last_integer("none"), None);
        assert_eq!(last_integer_reward("7 + 8 = 15\n", "15"), 1.0);
        assert_eq!(last_integer_reward("15 or 16", "15"), 0.0);
        assert_eq!(last_integer_reward("15", "x"), 0.0);
    }

    #[test]
    fn verdicts_follow_astraflow() {
        assert_eq!(verdict("looks right <verify>APPROVE</verify>"), Some(true));
        assert_eq!(verdict("<verify>reject</verify> approve?"), Some(false));
        assert_eq!(verdict("I reject it"), Some(false));
        assert_eq!(verdict("approve or reject"), None);
        assert_eq!(verdict("fine"), None);
    }

    #[test]
    fn judgments_are_the_first_parsable_index() {
        assert_eq!(judgment("analysis... Judgment: 3"), Some(3));
        assert_eq!(judgment("Judgment: x then Judgment:12 end"), Some(12));
        assert_eq!(judgment("Judgment 2"), None);
    }
}
