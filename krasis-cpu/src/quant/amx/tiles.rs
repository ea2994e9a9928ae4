//! The eight AMX tile registers as [`super::matmul`] uses them, behind the [`Tiles`] trait: the
//! hardware ([`HwTiles`], inline `asm!`: the `core::arch` AMX intrinsics are unstable in Rust
//! 1.95) or, in tests, a scalar emulation of the same instructions (`super::emu`), so the
//! kernel's blocking, INT4 unpacking and epilogue are checked on machines without AMX too.
//!
//! Tile roles (fixed, so the `asm!` strings can name them): C tiles `tmm0..tmm3` (i32
//! accumulators, C[2·a + b] for A tile a and B tile b), A tiles `tmm4`, `tmm5` (16 activation
//! rows × `kt` signed bytes), B tiles `tmm6`, `tmm7` (`kt/4` rows of one packed 64-byte weight
//! chunk each: 16 weight rows × 4 consecutive k, unsigned).

/// The 64-byte `ldtilecfg` operand (palette 1).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TileConfig {
    pub palette: u8,
    pub start_row: u8,
    pub reserved: [u8; 14],
    /// Bytes per row of each tile.
    pub colsb: [u16; 16],
    /// Rows of each tile.
    pub rows: [u8; 16],
}

/// First A tile (activations).
pub(crate) const TILE_A: usize = 4;
/// First B tile (weights).
pub(crate) const TILE_B: usize = 6;

impl TileConfig {
    /// C tiles 16 × 16 i32, A tiles 16 rows × `kt` bytes, B tiles `kt / 4` rows × 64 bytes.
    pub fn new(kt: usize) -> TileConfig {
        assert!(kt == 32 || kt == 64, "AMX tile K must be 32 or 64, not {kt}");
        let mut c = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for t in 0..TILE_A {
            c.colsb[t] = 64;
            c.rows[t] = 16;
        }
        for t in TILE_A..TILE_B {
            c.colsb[t] = kt as u16;
            c.rows[t] = 16;
        }
        for t in TILE_B..8 {
            c.colsb[t] = 64;
            c.rows[t] = (kt / 4) as u8;
        }
        c
    }
}

/// The tile operations the kernel needs. Tile numbers are small constants at every call site
/// (the kernel is monomorphised per blocking), so the hardware `match`es fold away.
pub(crate) trait Tiles {
    /// `ldtilecfg`.
    ///
    /// # Safety
    /// Hardware: AMX must be usable by this thread (see `super::detect`).
    unsafe fn configure(&mut self, cfg: &TileConfig);
    /// `tilezero tmm{t}`.
    ///
    /// # Safety
    /// A configuration is loaded.
    unsafe fn zero(&mut self, t: usize);
    /// `tileloadd tmm{t}, [p + stride·row]`.
    ///
    /// # Safety
    /// `p + stride·r .. + colsb` is readable for every configured row r of tile t.
    unsafe fn load(&mut self, t: usize, p: *const u8, stride: usize);
    /// `tdpbsud tmm{c}, tmm{4 + c/2}, tmm{6 + c%2}`: C[c] += A (signed) · B (unsigned).
    ///
    /// # Safety
    /// A configuration is loaded.
    unsafe fn dp(&mut self, c: usize);
    /// `tdpbf16ps tmm{c}, tmm{4 + c/2}, tmm{6 + c%2}`: C[c] (f32) += A (BF16 pairs) · B (BF16
    /// pairs), the tiles configured as by `TileConfig::new(64)` (A 16 rows × 32 BF16, B 16 k-pair
    /// rows × 16 columns × 2 BF16).
    ///
    /// # Safety
    /// A configuration is loaded; the CPU has AMX-BF16 (hardware).
    unsafe fn dp_bf16(&mut self, c: usize);
    /// `tilestored [p + stride·row], tmm{t}`.
    ///
    /// # Safety
    /// `p + stride·r .. + colsb` is writable for every configured row r of tile t.
    unsafe fn store(&mut self, t: usize, p: *mut u8, stride: usize);
    /// `tilerelease`.
    ///
    /// # Safety
    /// As `configure`.
    unsafe fn release(&mut self);
}

/// The AMX hardware.
pub(crate) struct HwTiles;

macro_rules! per_tile {
    ($t:expr, $($n:literal => $body:expr),* $(,)?) => {
        match $t {
            $($n => $body,)*
            _ => unreachable!("tile {}", $t),
        }
    };
}

impl Tiles for HwTiles {
    #[inline(always)]
    unsafe fn configure(&mut self, cfg: &TileConfig) {
        std::arch::asm!("ldtilecfg [{0}]", in(reg) cfg as *const TileConfig, options(nostack, readonly, preserves_flags));
    }

    #[inline(always)]
    unsafe fn zero(&mut self, t: usize) {
        use std::arch::asm;
        per_tile!(t,
            0 => asm!("tilezero tmm0", options(nostack, nomem, preserves_flags)),
            1 => asm!("tilezero tmm1", options(nostack, nomem, preserves_flags)),
            2 => asm!("tilezero tmm2", options(nostack, nomem, preserves_flags)),
            3 => asm!("tilezero tmm3", options(nostack, nomem, preserves_flags)),
        )
    }

    #[inline(always)]
    unsafe fn load(&mut self, t: usize, p: *const u8, stride: usize) {
        use std::arch::asm;
        per_tile!(t,
            4 => asm!("tileloadd tmm4, [{0} + {1}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags)),
            5 => asm!("tileloadd tmm5, [{0} + {1}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags)),
            6 => asm!("tileloadd tmm6, [{0} + {1}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags)),
            7 => asm!("tileloadd tmm7, [{0} + {1}*1]", in(reg) p, in(reg) stride, options(nostack, readonly, preserves_flags)),
        )
    }

    #[inline(always)]
    unsafe fn dp(&mut self, c: usize) {
        use std::arch::asm;
        per_tile!(c,
            0 => asm!("tdpbsud tmm0, tmm4, tmm6", options(nostack, nomem, preserves_flags)),
            1 => asm!("tdpbsud tmm1, tmm4, tmm7", options(nostack, nomem, preserves_flags)),
            2 => asm!("tdpbsud tmm2, tmm5, tmm6", options(nostack, nomem, preserves_flags)),
            3 => asm!("tdpbsud tmm3, tmm5, tmm7", options(nostack, nomem, preserves_flags)),
        )
    }

    #[inline(always)]
    unsafe fn dp_bf16(&mut self, c: usize) {
        use std::arch::asm;
        per_tile!(c,
            0 => asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem, preserves_flags)),
            1 => asm!("tdpbf16ps tmm1, tmm4, tmm7", options(nostack, nomem, preserves_flags)),
            2 => asm!("tdpbf16ps tmm2, tmm5, tmm6", options(nostack, nomem, preserves_flags)),
            3 => asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem, preserves_flags)),
        )
    }

    #[inline(always)]
    unsafe fn store(&mut self, t: usize, p: *mut u8, stride: usize) {
        use std::arch::asm;
        per_tile!(t,
            0 => asm!("tilestored [{0} + {1}*1], tmm0", in(reg) p, in(reg) stride, options(nostack, preserves_flags)),
            1 => asm!("tilestored [{0} + {1}*1], tmm1", in(reg) p, in(reg) stride, options(nostack, preserves_flags)),
            2 => asm!("tilestored [{0} + {1}*1], tmm2", in(reg) p, in(reg) stride, options(nostack, preserves_flags)),
            3 => asm!("tilestored [{0} + {1}*1], tmm3", in(reg) p, in(reg) stride, options(nostack, preserves_flags)),
        )
    }

    #[inline(always)]
    unsafe fn release(&mut self) {
        std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags));
    }
}
