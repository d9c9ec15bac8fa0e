//! A model of SGLang's NGRAM drafter (0.5.23, `ngram_corpus/trie.cpp`), written from its documented
//! behaviour so that the offline replay can compare against it on the same data in the same run.
//!
//! It is a suffix trie of depth `max_depth` (18): `insert(window)` adds every suffix of the window,
//! truncated to the depth, and marks each edge it walks as the parent's most recent child. A
//! draft matches every suffix of the context up to the depth (longest first), and from each
//! matched node runs a breadth-first expansion over children in most-recent-first order; the
//! breadth shrinks linearly from `max_breadth` (1-token match) to `min_breadth` (full-depth
//! match). Expansions from different anchors merge into one tree by token. Recency is kept as a
//! per-node clock instead of intrusive LRU lists; the order it induces is the same.
//!
//! Not a product path: it exists to measure a peer. Capacity is unbounded (SGLang evicts leaves
//! from a fixed pool; with per-prompt history the pool is never full).

use histospec_index::{FixedMap, Node};

/// Parameters, with SGLang's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrieConfig {
    /// `--speculative-ngram-max-trie-depth`.
    pub max_depth: usize,
    /// `--speculative-ngram-min-bfs-breadth`.
    pub min_breadth: usize,
    /// `--speculative-ngram-max-bfs-breadth`.
    pub max_breadth: usize,
}

impl Default for TrieConfig {
    fn default() -> Self {
        TrieConfig {
            max_depth: 18,
            min_breadth: 1,
            max_breadth: 10,
        }
    }
}

#[derive(Clone, Debug)]
struct TNode {
    tok: u32,
    touched: u64,
    children: Vec<u32>,
}

/// The trie. Node 0 is the root.
#[derive(Clone, Debug)]
pub struct TriePeer {
    cfg: TrieConfig,
    nodes: Vec<TNode>,
    edges: FixedMap<u64, u32>,
    clock: u64,
}

#[inline]
fn key(parent: u32, tok: u32) -> u64 {
    ((parent as u64) << 32) | tok as u64
}

impl TriePeer {
    pub fn new(cfg: TrieConfig) -> Self {
        TriePeer {
            cfg: TrieConfig {
                max_depth: cfg.max_depth.max(1),
                min_breadth: cfg.min_breadth.max(1),
                max_breadth: cfg.max_breadth.max(cfg.min_breadth.max(1)),
            },
            nodes: vec![TNode {
                tok: 0,
                touched: 0,
                children: Vec::new(),
            }],
            edges: FixedMap::default(),
            clock: 0,
        }
    }

    pub fn config(&self) -> TrieConfig {
        self.cfg
    }

    /// Nodes including the root.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }

    pub fn clear(&mut self) {
        self.nodes.truncate(1);
        self.nodes[0].children.clear();
        self.edges.clear();
    }

    fn child(&self, n: u32, tok: u32) -> Option<u32> {
        self.edges.get(&key(n, tok)).copied()
    }

    /// Inserts every suffix of `tokens`, each truncated to `max_depth` (SGLang `Trie::insert`).
    pub fn insert(&mut self, tokens: &[u32]) {
        for i in 0..tokens.len() {
            let end = (i + self.cfg.max_depth).min(tokens.len());
            let mut cur = 0u32;
            for &t in &tokens[i..end] {
                self.clock += 1;
                let next = match self.child(cur, t) {
                    Some(c) => c,
                    None => {
                        let id = self.nodes.len() as u32;
                        self.nodes.push(TNode {
                            tok: t,
                            touched: 0,
                            children: Vec::new(),
                        });
                        self.nodes[cur as usize].children.push(id);
                        self.edges.insert(key(cur, t), id);
                        id
                    }
                };
                self.nodes[next as usize].touched = self.clock;
                cur = next;
            }
        }
    }

    /// Matched nodes with children for every suffix of `context` up to `max_depth`, longest first.
    fn anchors(&self, context: &[u32]) -> Vec<(u32, usize)> {
        let max = context.len().min(self.cfg.max_depth);
        let mut out = Vec::new();
        for depth in (1..=max).rev() {
            let mut cur = 0u32;
            let mut ok = true;
            for &t in &context[context.len() - depth..] {
                match self.child(cur, t) {
                    Some(c) => cur = c,
                    None => {
                        ok = false;
                        break;
                    }
                }
            }
            if ok && !self.nodes[cur as usize].children.is_empty() {
                out.push((cur, depth));
            }
        }
        out
    }

    /// Children of `n`, most recently touched first.
    fn by_recency(&self, n: u32, scratch: &mut Vec<(u64, u32)>) {
        scratch.clear();
        for &c in &self.nodes[n as usize].children {
            scratch.push((self.nodes[c as usize].touched, c));
        }
        scratch.sort_unstable_by_key(|b| std::cmp::Reverse(b.0));
    }

    /// Draft tree of at most `budget` nodes including the root (SGLang's recency BFS, "BFS"
    /// match type). Parents precede children.
    pub fn draft(&self, context: &[u32], budget: usize) -> Vec<Node> {
        let mut tree: Vec<Node> = vec![Node {
            tok: context.last().copied().unwrap_or(0),
            parent: u32::MAX,
            prob: 1.0,
        }];
        // (tree node, token) -> tree node, to merge expansions from several anchors.
        let mut next: FixedMap<u64, u32> = FixedMap::default();
        let max_match = (self.cfg.max_depth as i64 - 1).max(1) as f64;
        let scale = (self.cfg.max_breadth - self.cfg.min_breadth) as f64 / max_match;
        let mut scratch = Vec::new();
        let mut queue = std::collections::VecDeque::new();
        for (anchor, depth) in self.anchors(context) {
            if tree.len() >= budget {
                break;
            }
            queue.clear();
            let b0 = (max_match - depth as f64) * scale + self.cfg.min_breadth as f64;
            queue.push_back((0u32, b0, anchor));
            while let Some((parent, breadth, tnode)) = queue.pop_front() {
                if tree.len() >= budget {
                    break;
                }
                let width = (breadth as i64).max(1) as usize;
                self.by_recency(tnode, &mut scratch);
                for &(_, c) in scratch.iter().take(width) {
                    if tree.len() >= budget {
                        break;
                    }
                    let tok = self.nodes[c as usize].tok;
                    let pos = *next.entry(key(parent, tok)).or_insert_with(|| {
                        tree.push(Node {
                            tok,
                            parent,
                            prob: 0.0,
                        });
                        tree.len() as u32 - 1
                    });
                    queue.push_back((pos, breadth - scale, c));
                }
            }
        }
        tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_anchor_first_then_merges_shorter() {
        let mut t = TriePeer::new(TrieConfig {
            max_depth: 4,
            min_breadth: 1,
            max_breadth: 2,
        });
        t.insert(&[1, 2, 3, 4]);
        t.insert(&[9, 2, 5]);
        // Context ends in [1, 2]: the 2-token anchor yields 3 -> 4; the 1-token anchor [2] then
        // adds its most recent child, 5 (breadth 1 at this depth).
        let d = t.draft(&[1, 2], 8);
        let toks: Vec<u32> = d.iter().skip(1).map(|n| n.tok).collect();
        assert_eq!(toks, vec![3, 4, 5]);
        assert_eq!(d[1].parent, 0);
        assert_eq!(d[2].parent, 1);
        assert_eq!(d[3].parent, 0);
    }

    #[test]
    fn budget_and_depth_are_respected() {
        let mut t = TriePeer::new(TrieConfig::default());
        let seq: Vec<u32> = (0..100).collect();
        t.insert(&seq);
        // A suffix is truncated at depth 18, so a 1-token match continues 17 tokens at most.
        let d = t.draft(&[5], 64);
        assert_eq!(d.len(), 18);
        let d = t.draft(&[5], 4);
        assert_eq!(d.len(), 4);
        assert!(t.draft(&[1000], 16).len() == 1);
    }
}
