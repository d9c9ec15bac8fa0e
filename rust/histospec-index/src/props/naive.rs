//! Brute-force oracle over raw token strings, used by the property tests.
#![allow(dead_code)]

/// Number of positions where `pat` ends in any of `strings` (overlaps counted).
pub fn occurrences(strings: &[Vec<u32>], pat: &[u32]) -> usize {
    if pat.is_empty() {
        return strings.iter().map(|s| s.len()).sum();
    }
    strings
        .iter()
        .map(|s| s.windows(pat.len()).filter(|w| *w == pat).count())
        .sum()
}

/// Whether `pat` occurs somewhere followed by at least one more token.
pub fn occurs_with_continuation(strings: &[Vec<u32>], pat: &[u32]) -> bool {
    strings
        .iter()
        .any(|s| s.len() > pat.len() && s.windows(pat.len() + 1).any(|w| &w[..pat.len()] == pat))
}

/// Length of the longest suffix of `ctx` (at least `min_len`) that occurs followed by a token.
pub fn longest_match(strings: &[Vec<u32>], ctx: &[u32], min_len: usize) -> Option<usize> {
    (min_len.max(1)..=ctx.len())
        .rev()
        .find(|&l| occurs_with_continuation(strings, &ctx[ctx.len() - l..]))
}

/// Whether the bigram (a, b) occurs in any string.
pub fn has_bigram(strings: &[Vec<u32>], a: u32, b: u32) -> bool {
    strings
        .iter()
        .any(|s| s.windows(2).any(|w| w[0] == a && w[1] == b))
}

/// Whether `pat` occurs as a substring of any string.
pub fn contains(strings: &[Vec<u32>], pat: &[u32]) -> bool {
    occurrences(strings, pat) > 0
}
