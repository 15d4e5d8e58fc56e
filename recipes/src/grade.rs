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
}
