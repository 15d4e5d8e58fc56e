//! Sampled tokens to the text an OpenAI client sees: incremental detokenization that
//! never emits half a UTF-8 character, and stop strings cut out of the text. Streamed and
//! whole answers both go through [`ChoiceText`], so a stream's chunks always add up to
//! the text the same request answers without streaming.

use crate::model::{ModelError, TextTokenizer};

/// Tokens a character may span (a UTF-8 character has at most 4 bytes, and byte-level
/// vocabularies hold at least one per token).
const MAX_PENDING: usize = 4;

/// Decodes a growing token list piece by piece: each pushed token yields the text that
/// became final with it. A token that ends inside a multi-byte character yields nothing
/// until a later token completes it (the prefix/read offsets of TGI's and vLLM's
/// incremental detokenizers: only a short window is re-decoded per token).
struct Detokenizer {
    ids: Vec<u32>,
    /// Start of the window decoded for context.
    prefix: usize,
    /// End of the tokens whose text has been emitted.
    read: usize,
}

impl Detokenizer {
    fn new() -> Self {
        Self {
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds a token; returns the text that became final. Bytes that never form a
    /// character (invalid UTF-8) are given up as replacement characters once
    /// [`MAX_PENDING`] tokens wait, so the window stays short.
    fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, ModelError> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        let stuck = self.ids.len() - self.read > MAX_PENDING;
        if now.len() > before.len()
            && (stuck || !now.ends_with('\u{FFFD}'))
            && now.starts_with(&before)
        {
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(now[before.len()..].to_string())
        } else if stuck {
            // Given up: tokens that decode to nothing (ids the tokenizer does not know,
            // where the model's vocabulary is larger than its tokenizer's), or text that
            // no longer extends what was sent (a character completed by bytes after a
            // lead byte already sent as a replacement character). Were the window kept,
            // every later token would re-decode a window growing with them; the text
            // past what was sent goes out.
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(past_common_prefix(&before, &now).to_string())
        } else {
            Ok(String::new())
        }
    }

    /// The text of tokens still pending (an incomplete character at the very end).
    fn flush(&mut self, tok: &TextTokenizer) -> Result<String, ModelError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(past_common_prefix(&before, &now).to_string())
    }
}

/// The part of `now` past the characters it shares with the start of `before` (all of
/// `now` past `before` when it extends it).
fn past_common_prefix<'a>(before: &str, now: &'a str) -> &'a str {
    let shared = before
        .char_indices()
        .zip(now.chars())
        .find(|((_, a), b)| a != b)
        .map_or(before.len().min(now.len()), |((at, _), _)| at);
    // `shared` is a character boundary of both: the characters before it are equal.
    &now[shared..]
}

/// One choice's text as its tokens arrive: what may be shown so far, ended at the first
/// stop string. Text that could be the start of a stop string is held back until the
/// next tokens show it is not.
pub struct ChoiceText {
    detok: Detokenizer,
    stops: Vec<String>,
    /// All text decoded so far (stop strings included).
    text: String,
    /// Bytes of `text` released to the client.
    released: usize,
    /// Where a stop string begins, once one has.
    cut: Option<usize>,
    /// Per token: where its text starts in `text` (bytes).
    starts: Vec<usize>,
    /// Per token: where its text starts in `text` (characters).
    char_starts: Vec<usize>,
    /// Characters in `text`.
    chars: usize,
}

impl ChoiceText {
    /// A choice that ends at the first of `stops`.
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            detok: Detokenizer::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            released: 0,
            cut: None,
            starts: Vec::new(),
            char_starts: Vec::new(),
            chars: 0,
        }
    }

    /// Adds the next sampled token; returns the text now safe to show.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, ModelError> {
        self.starts.push(self.text.len());
        self.char_starts.push(self.chars);
        let piece = self.detok.push(tok, id)?;
        self.append(&piece);
        Ok(self.release(false))
    }

    /// No more tokens: returns whatever was held back.
    pub fn finish(&mut self, tok: &TextTokenizer) -> Result<String, ModelError> {
        let piece = self.detok.flush(tok)?;
        self.append(&piece);
        Ok(self.release(true))
    }

    fn append(&mut self, piece: &str) {
        self.text.push_str(piece);
        self.chars += piece.chars().count();
    }

    /// The visible text so far (all of it, after [`Self::finish`]).
    pub fn visible(&self) -> &str {
        &self.text[..self.released]
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.cut.is_some()
    }

    /// How many pushed tokens begin inside the visible text (those after a stop string
    /// are not part of the answer).
    pub fn visible_tokens(&self) -> usize {
        let end = self.cut.unwrap_or(self.text.len());
        self.starts.iter().take_while(|&&s| s < end).count()
    }

    /// Where token `i`'s text starts in the visible text, in characters (OpenAI's
    /// `text_offset`).
    pub fn char_offset(&self, i: usize) -> usize {
        self.char_starts.get(i).copied().unwrap_or(self.chars)
    }

    fn release(&mut self, last: bool) -> String {
        if self.cut.is_none() {
            self.cut = self.find_stop();
        }
        let end = match self.cut {
            Some(cut) => cut,
            None if last => self.text.len(),
            None => self.text.len() - self.held_back(),
        };
        if end <= self.released {
            return String::new();
        }
        let out = self.text[self.released..end].to_string();
        self.released = end;
        out
    }

    /// The first stop string's start in `text`. Only the part that may contain a new
    /// match is searched.
    fn find_stop(&self) -> Option<usize> {
        let longest = self.stops.iter().map(String::len).max()?;
        let mut from = self.released.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min()
    }

    /// Bytes at the end of `text` that begin some stop string.
    fn held_back(&self) -> usize {
        let unreleased = &self.text[self.released..];
        (1..=unreleased.len())
            .rev()
            .filter(|&n| unreleased.is_char_boundary(unreleased.len() - n))
            .find(|&n| {
                let tail = &unreleased[unreleased.len() - n..];
                self.stops
                    .iter()
                    .any(|s| s.len() > n && s.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tiny::tiny_tokenizer;

    fn run(stops: &[&str], text: &str) -> (Vec<String>, ChoiceText) {
        let tok = tiny_tokenizer().unwrap();
        let mut c = ChoiceText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut chunks = Vec::new();
        for id in tok.encode(text).unwrap() {
            chunks.push(c.push(&tok, id).unwrap());
        }
        chunks.push(c.finish(&tok).unwrap());
        (chunks, c)
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        let (chunks, c) = run(&[], "né ☃ ok");
        assert_eq!(c.visible(), "né ☃ ok");
        for chunk in &chunks {
            assert!(!chunk.contains('\u{FFFD}'), "{chunks:?}");
        }
        assert_eq!(chunks.concat(), "né ☃ ok");
    }

    #[test]
    fn the_text_ends_before_the_first_stop_string() {
        let (chunks, c) = run(&["END", "\n\n"], "an answer\n\nEND more");
        assert_eq!(c.visible(), "an answer");
        assert!(c.stopped());
        assert_eq!(chunks.concat(), "an answer");
        assert_eq!(c.visible_tokens(), "an answer".len());
    }

    #[test]
    fn a_possible_stop_prefix_is_held_back_then_released() {
        let tok = tiny_tokenizer().unwrap();
        let mut c = ChoiceText::new(vec!["STOP".into()]);
        let mut shown = String::new();
        for id in tok.encode("x ST").unwrap() {
            shown.push_str(&c.push(&tok, id).unwrap());
        }
        assert_eq!(shown, "x ", "`ST` may begin `STOP`");
        for id in tok.encode("AY").unwrap() {
            shown.push_str(&c.push(&tok, id).unwrap());
        }
        assert_eq!(shown, "x STAY");
        shown.push_str(&c.finish(&tok).unwrap());
        assert_eq!(shown, "x STAY");
        assert!(!c.stopped());
    }

    #[test]
    fn invalid_bytes_are_given_up_without_holding_the_window() {
        let tok = tiny_tokenizer().unwrap();
        // Lone continuation bytes (0x80) never form a character.
        let ids: Vec<u32> = vec![0x80; 50];
        let mut c = ChoiceText::new(Vec::new());
        let mut shown = String::new();
        for &id in &ids {
            shown.push_str(&c.push(&tok, id).unwrap());
            assert!(c.detok.ids.len() - c.detok.read <= MAX_PENDING + 1);
        }
        shown.push_str(&c.finish(&tok).unwrap());
        assert_eq!(shown, c.visible());
        assert!(shown.chars().all(|ch| ch == '\u{FFFD}') && !shown.is_empty());
    }

    /// Invalid bytes given up as replacement characters, then a character completed by
    /// bytes after them (its lead byte was given up too): the window moves on, so later
    /// tokens are not decoded again and again, and nothing is sent twice.
    #[test]
    fn a_character_completed_after_given_up_bytes_does_not_pin_the_window() {
        let tok = tiny_tokenizer().unwrap();
        let mut ids: Vec<u32> = vec![0x80; 4];
        ids.extend([0xE2, 0x82, 0xAC]);
        ids.extend(std::iter::repeat_n(u32::from(b'a'), 300));
        let mut c = ChoiceText::new(Vec::new());
        let mut shown = String::new();
        for &id in &ids {
            shown.push_str(&c.push(&tok, id).unwrap());
            assert!(
                c.detok.ids.len() - c.detok.prefix <= 2 * (MAX_PENDING + 1),
                "window of {} tokens",
                c.detok.ids.len() - c.detok.prefix
            );
        }
        shown.push_str(&c.finish(&tok).unwrap());
        assert_eq!(shown, c.visible());
        assert_eq!(shown.matches('a').count(), 300, "{shown:?}");
        assert!(shown.ends_with(&"a".repeat(300)), "{shown:?}");
    }

    #[test]
    fn ids_that_decode_to_nothing_do_not_grow_the_window() {
        let tok = tiny_tokenizer().unwrap();
        let a = tok.encode("a").unwrap();
        let b = tok.encode("b").unwrap();
        let unknown = 1_000_000;
        assert_eq!(tok.decode(&[unknown]).unwrap_or_default(), "");
        let mut c = ChoiceText::new(Vec::new());
        let mut shown = String::new();
        for &id in a.iter().chain(&[unknown; 200]).chain(&b) {
            shown.push_str(&c.push(&tok, id).unwrap());
            assert!(c.detok.ids.len() - c.detok.prefix <= 2 * (MAX_PENDING + 1));
        }
        shown.push_str(&c.finish(&tok).unwrap());
        assert_eq!(shown, "ab");
    }

    #[test]
    fn offsets_count_characters() {
        let (_, c) = run(&[], "é!");
        // `é` is two byte tokens; `!` starts at character 1.
        assert_eq!(c.char_offset(2), 1);
        assert_eq!(c.char_offset(0), 0);
    }
}
