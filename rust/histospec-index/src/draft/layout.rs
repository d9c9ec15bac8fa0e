//! Writing drafts into SGLang's buffers: BFS-ordered nodes padded to the verify width, their
//! tokens, tree masks and probabilities.

use super::Node;
use crate::sam::NONE;

/// An element type SGLang's mask buffer may have (int64 as NGRAM returns it, or bool/uint8).
pub trait MaskElem: Copy + Send {
    const ZERO: Self;
    const ONE: Self;
    /// Row pieces: entry `n` holds the four elements of bits `n & 1`, `n >> 1 & 1`, ... (so a
    /// row is written four elements per lookup, not one bit at a time).
    const NIBBLES: [[Self; 4]; 16];
    /// `ONE` for bit 1, `ZERO` for bit 0 (`bit` is 0 or 1), without a branch.
    fn from_bit(bit: u64) -> Self;
}

/// [`MaskElem`] for a type whose `ZERO`/`ONE` are `$zero`/`$one` and whose `from_bit` is `$from`.
macro_rules! mask_elem {
    ($t:ty, $zero:expr, $one:expr, $from:expr) => {
        impl MaskElem for $t {
            const ZERO: $t = $zero;
            const ONE: $t = $one;
            const NIBBLES: [[$t; 4]; 16] = {
                let mut t = [[$zero; 4]; 16];
                let mut n = 0;
                while n < 16 {
                    let mut j = 0;
                    while j < 4 {
                        if (n >> j) & 1 == 1 {
                            t[n][j] = $one;
                        }
                        j += 1;
                    }
                    n += 1;
                }
                t
            };
            #[inline(always)]
            fn from_bit(bit: u64) -> $t {
                $from(bit)
            }
        }
    };
}
mask_elem!(i64, 0, 1, |b: u64| b as i64);
mask_elem!(i32, 0, 1, |b: u64| b as i32);
mask_elem!(u8, 0, 1, |b: u64| b as u8);
mask_elem!(bool, false, true, |b: u64| b != 0);

/// Writes `nodes` (BFS order, at most `d`) padded to exactly `d` nodes into one request's slices:
/// `tokens[d]`, `mask[d*d]` (row i = i and its ancestors) and optionally `probs[d]`.
/// Returns the number of real (unpadded) nodes.
pub fn write_tree<M: MaskElem>(
    nodes: &[Node],
    d: usize,
    tokens: &mut [i64],
    mask: &mut [M],
    mut probs: Option<&mut [f32]>,
) -> usize {
    let n = nodes.len().min(d);
    // Every row is written whole, so the buffer needs no clearing first: half the memory traffic
    // of a 256-request batch's int64 masks. Up to 64 nodes, each node's ancestor set is a bit
    // mask and its row is written from the bits; beyond, a row is its parent's row copied.
    let mut anc = [0u64; 64];
    for i in 0..d {
        let (tok, parent, prob) = if i < n {
            let nd = nodes[i];
            (nd.tok as i64, nd.parent, nd.prob)
        } else {
            // Pad chain: each pad is the only child of the previous slot.
            (0, (i - 1) as u32, 0.0)
        };
        tokens[i] = tok;
        if let Some(p) = probs.as_deref_mut() {
            p[i] = prob;
        }
        if d <= 64 {
            let bits = if parent == NONE {
                0
            } else {
                anc[parent as usize]
            } | 1 << i;
            anc[i] = bits;
            let row = &mut mask[i * d..(i + 1) * d];
            let mut quads = row.chunks_exact_mut(4);
            let mut b = bits;
            for q in &mut quads {
                q.copy_from_slice(&M::NIBBLES[(b & 15) as usize]);
                b >>= 4;
            }
            for (j, m) in quads.into_remainder().iter_mut().enumerate() {
                *m = M::from_bit((b >> j) & 1);
            }
            continue;
        }
        if parent != NONE {
            let (before, row) = mask.split_at_mut(i * d);
            row[..d].copy_from_slice(&before[parent as usize * d..parent as usize * d + d]);
        } else {
            mask[i * d..(i + 1) * d].fill(M::ZERO);
        }
        mask[i * d + i] = M::ONE;
    }
    n
}

/// Writes a chain (the nodes after the root, in order) into `tokens[k]`, padding with 0;
/// returns its real length.
pub fn write_chain(nodes: &[Node], tokens: &mut [i64], mut probs: Option<&mut [f32]>) -> usize {
    let n = nodes.len().saturating_sub(1).min(tokens.len());
    for (i, t) in tokens.iter_mut().enumerate() {
        *t = if i < n { nodes[i + 1].tok as i64 } else { 0 };
        if let Some(p) = probs.as_deref_mut() {
            p[i] = if i < n { nodes[i + 1].prob } else { 0.0 };
        }
    }
    n
}
