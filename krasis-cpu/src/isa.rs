//! Instruction-set selection: detected once at run time, overridable with `KRASIS_ISA`.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA.
    Avx2,
    /// AVX-512 F/BW/VNNI.
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The best ISA this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
            {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every ISA this host can run, lowest first (for tests that compare them).
    pub fn available() -> Vec<Isa> {
        let best = Isa::detect();
        [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|&i| i <= best).collect()
    }
}

/// Parse a `KRASIS_ISA` value. `amx` is AVX-512 with the AMX tiles on (`quant::amx::enabled`:
/// any other value turns them off), so it names the `Avx512` vector level.
pub fn parse_isa(s: &str) -> Option<Isa> {
    match s.trim().to_ascii_lowercase().as_str() {
        "scalar" => Some(Isa::Scalar),
        "avx2" => Some(Isa::Avx2),
        "avx512" | "amx" => Some(Isa::Avx512),
        _ => None,
    }
}

/// AVX-512 lane mask of elements `j..min(j + 16, end)` (empty when `j ≥ end`): the masked part
/// of a 16-float step at the end of a row.
#[inline]
pub fn lane_mask16(j: usize, end: usize) -> u16 {
    let w = end.saturating_sub(j).min(16);
    if w == 16 {
        0xffff
    } else {
        (1u16 << w) - 1
    }
}

/// The ISA the kernels use: the detected one, lowered by `KRASIS_ISA` if set. Asking for more
/// than the CPU has, or an unknown name, falls back to the detected ISA with a warning.
pub fn active() -> Isa {
    static ACTIVE: OnceLock<Isa> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let best = Isa::detect();
        use krasis_core::knobs::IsaChoice;
        let isa = match &krasis_core::knobs::knobs().isa {
            None => best,
            Some(IsaChoice::Unknown(v)) => {
                tracing::warn!("KRASIS_ISA={v:?} is not one of scalar|avx2|avx512|amx; using {}", best.name());
                best
            }
            Some(choice) => {
                let req = match choice {
                    IsaChoice::Scalar => Isa::Scalar,
                    IsaChoice::Avx2 => Isa::Avx2,
                    IsaChoice::Avx512 | IsaChoice::Amx | IsaChoice::Unknown(_) => Isa::Avx512,
                };
                if req <= best {
                    req
                } else {
                    tracing::warn!("KRASIS_ISA={} is not supported by this CPU; using {}", req.name(), best.name());
                    best
                }
            }
        };
        tracing::debug!("kernels use {} (the CPU has {})", isa.name(), best.name());
        isa
    })
}
