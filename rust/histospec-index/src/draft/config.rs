//! The draft policy's knobs: one table ([`DraftConfig::KNOBS`]) that the binding reads and writes
//! by name, so each knob is declared once.

/// A knob's value as it crosses the binding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KnobValue {
    Int(u32),
    Float(f32),
}

/// A knob's type: converted from and to the binding's numbers.
trait Knob: Sized {
    fn from_f64(name: &str, v: f64) -> Result<Self, String>;
    fn value(self) -> KnobValue;
}

impl Knob for u32 {
    fn from_f64(name: &str, v: f64) -> Result<Self, String> {
        if v.fract() != 0.0 || !(0.0..=f64::from(u32::MAX)).contains(&v) {
            return Err(format!("{name} must be an integer in [0, 2**32), got {v}"));
        }
        Ok(v as u32)
    }
    fn value(self) -> KnobValue {
        KnobValue::Int(self)
    }
}

impl Knob for f32 {
    fn from_f64(name: &str, v: f64) -> Result<Self, String> {
        if !v.is_finite() {
            return Err(format!("{name} must be a finite number, got {v}"));
        }
        Ok(v as f32)
    }
    fn value(self) -> KnobValue {
        KnobValue::Float(self)
    }
}

macro_rules! draft_config {
    ($( $(#[doc = $doc:literal])* $name:ident: $ty:ty = $default:expr, )*) => {
        /// Knobs of the draft policy; see the module docs of [`crate::draft`] for what each does.
        #[derive(Clone, Debug, PartialEq)]
        pub struct DraftConfig {
            $( $(#[doc = $doc])* pub $name: $ty, )*
        }

        impl Default for DraftConfig {
            fn default() -> Self {
                DraftConfig { $( $name: $default, )* }
            }
        }

        impl DraftConfig {
            /// Every knob's name, in declaration order.
            pub const KNOBS: &'static [&'static str] = &[$( stringify!($name) ),*];

            /// The value of knob `name` (`None`: no such knob).
            pub fn get(&self, name: &str) -> Option<KnobValue> {
                match name {
                    $( stringify!($name) => Some(Knob::value(self.$name)), )*
                    _ => None,
                }
            }

            /// Sets knob `name` (its type checked; its domain is checked by
            /// [`DraftConfig::validate`]).
            pub fn set(&mut self, name: &str, value: f64) -> Result<(), String> {
                match name {
                    $( stringify!($name) => self.$name = <$ty as Knob>::from_f64(name, value)?, )*
                    _ => {
                        return Err(format!(
                            "unknown draft knob {name:?}; known: {}",
                            Self::KNOBS.join(", ")
                        ))
                    }
                }
                Ok(())
            }
        }
    };
}

draft_config! {
    /// Shortest suffix (in tokens) that may anchor a draft or a fallback. At least 1.
    min_match: u32 = 1,
    /// Nodes whose estimated path probability is below this are not drafted.
    min_prob: f32 = 0.0,
    /// Pseudo-count of "something new follows", in units of one newest-version occurrence.
    escape: f32 = 1.0,
    /// Extra escape for short matches: a context of length `L` escapes with
    /// `escape + escape_short / L` pseudo-counts, so one occurrence behind a long match is trusted
    /// more than one behind a one-token match.
    escape_short: f32 = 2.0,
    /// Weight of the recency estimate against the frequency estimate, in [0, 1].
    recency: f32 = 0.3,
    /// Geometric decay β of the recency estimate over recency ranks, in [0, 1).
    recency_decay: f32 = 0.5,
    /// Most children a tree node offers to the frontier (a chain uses 1).
    max_children: u32 = 8,
    /// Prior weight of the request's source pointer while it is in step (its last prediction
    /// held): a node's estimate becomes `(1-λ)·automaton + λ·[token = the source's next]`, where λ
    /// is the share of the request's own pointer predictions that held where the automaton's
    /// favourite said otherwise, shrunk towards this prior. 0 turns source following off.
    follow: f32 = 0.5,
    /// The same prior for the first prediction after the pointer fell out of step (its guess at
    /// where the source resumes).
    follow_resync: f32 = 0.1,
    /// A root anchored at a hub (a context with at least `hub_follow_degree` continuations: a
    /// short match, after the last token broke a longer one) drafts the source pointer's path
    /// alone when the pointer's weight is at least this, instead of spreading the budget over the
    /// hub's many continuations (and reading each of them). 1 = never.
    hub_follow: f32 = 0.1,
    /// How many continuations make a root a hub for `hub_follow` (at least 2). Lower values defer
    /// to the pointer at more roots: faster, and better where each response rewrites one earlier
    /// response, worse on the real rollouts.
    hub_follow_degree: u32 = crate::sam::HUB_DEGREE,
}

impl DraftConfig {
    /// Checks every field's domain.
    pub fn validate(&self) -> Result<(), String> {
        fn within(name: &str, v: f32, lo: f32, hi: f32, hi_open: bool) -> Result<(), String> {
            let ok = v >= lo && if hi_open { v < hi } else { v <= hi };
            if ok {
                return Ok(());
            }
            let close = if hi_open { ")" } else { "]" };
            Err(format!("{name} must be in [{lo}, {hi}{close}, got {v}"))
        }
        if self.min_match == 0 {
            return Err("min_match must be at least 1".into());
        }
        within("min_prob", self.min_prob, 0.0, 1.0, false)?;
        for (name, v) in [("escape", self.escape), ("escape_short", self.escape_short)] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(format!("{name} must be a finite number >= 0, got {v}"));
            }
        }
        within("recency", self.recency, 0.0, 1.0, false)?;
        within("recency_decay", self.recency_decay, 0.0, 1.0, true)?;
        within("follow", self.follow, 0.0, 1.0, true)?;
        within("follow_resync", self.follow_resync, 0.0, 1.0, true)?;
        within("hub_follow", self.hub_follow, 0.0, 1.0, false)?;
        if self.hub_follow_degree < 2 {
            return Err(format!(
                "hub_follow_degree must be at least 2, got {}",
                self.hub_follow_degree
            ));
        }
        if self.max_children == 0 {
            return Err("max_children must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knobs_round_trip_by_name() {
        let mut c = DraftConfig::default();
        for (i, name) in DraftConfig::KNOBS.iter().enumerate() {
            let v = match c.get(name).unwrap() {
                KnobValue::Int(_) => 2.0 + i as f64,
                KnobValue::Float(_) => 0.01 * i as f64,
            };
            c.set(name, v).unwrap();
            match c.get(name).unwrap() {
                KnobValue::Int(x) => assert_eq!(f64::from(x), v),
                KnobValue::Float(x) => assert_eq!(x, v as f32),
            }
        }
        assert!(c
            .set("blend", 1.0)
            .unwrap_err()
            .contains("unknown draft knob"));
        assert!(c.set("min_match", 1.5).unwrap_err().contains("integer"));
        assert!(c.set("escape", f64::NAN).unwrap_err().contains("finite"));
        assert!(c.get("nope").is_none());
    }
}
